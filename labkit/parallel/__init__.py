"""Infrastructure shared by the parallelisms that is not an exercise: pipeline schedules as data
(`schedules`) and stage plumbing (`stages`)."""
