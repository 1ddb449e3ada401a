"""Launching ranks: fork from a notebook or script, or join ranks that torchrun, Slurm or mpiexec started; failures, restarts, the %%ranks magic, notebook helpers."""
