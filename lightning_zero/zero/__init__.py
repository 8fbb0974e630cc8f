"""ZeRO sharding: flat parameter buckets and the optimizer stepping on this rank's shard."""

from lightning_zero.zero.optimizer import (
    ELEMENTWISE,
    ShardedParams,
    ShardingError,
    check_shardable,
    mark_elementwise,
)

__all__ = ["ELEMENTWISE", "ShardedParams", "ShardingError", "check_shardable", "mark_elementwise"]
