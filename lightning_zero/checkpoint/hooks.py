"""What Lightning's checkpoint hooks see in the sharded form, and what is written after them.

[Note: hooks see tensors]
``on_save_checkpoint`` hooks (the LightningModule's and every callback's) receive
``checkpoint["state_dict"]`` before the strategy writes it, and code written for plain Lightning
computes with it (casts it to half for an export, copies it, moves it to another key). So in both
forms the hooks get the full form's state dict: whole tensors, or :class:`~lightning_zero.streamed.Streamed`
tensors for values that live in shards (they gather when computed with). For a sharded save the
strategy then turns what the hooks left into this rank's parts (:func:`to_sharded_state`): an
entry the hooks did not replace becomes its piece, as :func:`sharded_model_state` gives it; a
value a hook put under a parameter's key is written whole, flattened as the sharded layout
stores parameters (every rank holds the same value); Streamed tensors that a hook moved elsewhere
in the checkpoint (``EMAWeightAveraging`` keeps the current weights under another key) are
gathered into whole tensors, on every rank in the same order, since only the model's and the
optimizers' entries are written in pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_zero.checkpoint.states import sharded_model_state
from lightning_zero.streamed import Streamed


def to_sharded_state(
    checkpoint: dict[str, Any], handed: Mapping[str, Any], module: nn.Module, engine: Any
) -> None:
    """Rewrite ``checkpoint`` in place for a sharded save after the hooks ran (see [Note: hooks see
    tensors]); ``handed``: the state dict the hooks were given. Every rank calls it."""
    pieces = sharded_model_state(module, engine)
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    state = checkpoint.get("state_dict", {})
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key in handed and value is handed[key]:
            if key in pieces:  # untouched: this rank's part (a tied parameter's other names are left out)
                out[key] = pieces[key]
            continue
        value = _gathered(value)
        flat = key in params and isinstance(value, Tensor)  # the layout keeps parameters flattened
        out[key] = value.detach().reshape(-1) if flat else value
    checkpoint["state_dict"] = out
    for key in list(checkpoint):
        if key not in ("state_dict", "optimizer_states"):
            checkpoint[key] = _gathered(checkpoint[key])


def _gathered(obj: Any) -> Any:
    """``obj`` with its Streamed tensors gathered into whole tensors (every rank, the same walk)."""
    if isinstance(obj, Streamed):
        return obj.clone()
    if isinstance(obj, dict):
        return (
            type(obj)((k, _gathered(v)) for k, v in obj.items())
            if type(obj) is not dict
            else {k: _gathered(v) for k, v in obj.items()}
        )
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_gathered(v) for v in obj)
    return obj
