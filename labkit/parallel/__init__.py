"""Infrastructure shared by the parallelisms that is not an exercise: pipeline schedules as data
(`schedules`, the V-shaped ones in `v_schedules`, torch's own lists in `torch_schedules`) and stage plumbing
(`stages`), flatten/write-back and bucketing (`flat`), the one sharding rule (`sharding`), the optimizer
wrapper of ZeRO-1/2 (`optim`), tensor-parallel helpers (`tp`), the given pieces of context parallelism's
all-gather, Ulysses and hybrid methods (`context_methods`)."""
