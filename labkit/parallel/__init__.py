"""Infrastructure shared by the parallelisms that is not an exercise.

`flat`: one flatten / write-back helper, the one bucketing rule, the flat all-reduce mean.
`sharding`: the one sharding rule, for batch rows (`shard_rows`) and for flat parameters
(`shard_size`, `local_shard`), and the reduce-scatter / all-gather of flat shards.
`tp`: the tensor-parallel world and the divisibility check.
"""
