"""Your code: fill in the stubs (generated from solutions/ by `python -m labkit.grading.stubgen`)."""
