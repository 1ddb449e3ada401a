"""Measuring: timelines on one clock, plots, throughput and MFU, memory per rank, activation memory,
torch.profiler traces merged across ranks (`profiling`), and when communication hides (`overlap`)."""
