"""Measuring: timelines, plots, throughput and MFU, memory per rank, activation memory."""
