"""Infrastructure shared by the parallelisms that is not an exercise.

`flat`: one flatten / write-back helper, the one bucketing rule, the flat all-reduce mean.
`sharding`: the one sharding rule, for batch rows (`shard_rows`) and for flat parameters
(`shard_size`, `local_shard`), and the reduce-scatter / all-gather of flat shards.
`optim`: `WrapperOptimizer`, the one `step()` of the sharded optimizers (ZeRO-1, ZeRO-2).
`tp`: the tensor-parallel world and the divisibility check.
"""
