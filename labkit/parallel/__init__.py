"""Infrastructure shared by the parallelisms that is not an exercise (pipeline schedules and stage plumbing, ...)."""
