"""The communication layer: argument checks shared by hand-written collectives, and (see its modules) the one table of torch.distributed ops and the one interception point."""
