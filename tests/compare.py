"""How far apart two results are: parameters (name -> tensor) and optimizer state dicts."""

from __future__ import annotations


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over the tensors of ``b``'s keys (``a`` must have them all)."""
    missing = set(b) - set(a)
    assert not missing, f"missing {sorted(missing)}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def state_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two optimizer ``state_dict()``s with the same entries."""
    assert a["state"].keys() == b["state"].keys()
    return max(
        (v.float() - b["state"][i][k].float()).abs().max().item()
        for i, e in a["state"].items()
        for k, v in e.items()
    )
