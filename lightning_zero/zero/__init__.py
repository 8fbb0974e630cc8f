"""ZeRO sharding: flat parameter buckets and the optimizer stepping on this rank's shard."""

from lightning_zero.zero.optimizer import ShardedParams, ShardingError, param_group_keys

__all__ = ["ShardedParams", "ShardingError", "param_group_keys"]
