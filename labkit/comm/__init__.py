"""The one communication layer: the op table, interception of torch.distributed calls, traffic counts."""
