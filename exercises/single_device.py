# GENERATED from solutions/single_device.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/01_single_device.ipynb.
# untouched-stub fingerprint: b5e718f2cbe5652b
"""Training on one device, from first principles (notebook 01_single_device).

Two facts carry every parallel scheme in this lab:
  1. the gradient of a batch's MEAN loss is the mean of the per-sample gradients, so
     it can be computed in pieces and averaged (data parallelism averages over ranks);
  2. summing the gradients of equal micro-batches, each loss divided by their number,
     gives exactly that full-batch gradient (pipelines feed micro-batches).
`sgd_step` is the update itself, with no optimizer object in between.
"""
import torch
from torch import nn

NOTEBOOK = "01_single_device"


def sgd_step(params, lr: float) -> None:
    """Plain SGD, in place: p <- p - lr * p.grad for every p in `params`.

    params: an iterable of tensors (e.g. model.parameters()); those whose .grad is None
    (unused, or frozen) are skipped. The update must not be recorded by autograd
    (torch.no_grad). Gradients are left as they are: zeroing them is the caller's job.
    Same result as torch.optim.SGD(params, lr).step(). lr < 0: ValueError.
    """
    if lr < 0:
        raise ValueError(f"the learning rate must be >= 0, got {lr}")
    raise NotImplementedError("exercise sgd_step is not implemented yet: edit exercises/single_device.py, see notebooks/01_single_device.ipynb")


def accumulate_gradients(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                         n_microbatches: int) -> torch.Tensor:
    """Gradient of the full batch's mean loss, computed over `n_microbatches` equal pieces.

    model(x, y) must return the mean loss of the batch (x, y) (labkit.model.Transformer does).
    First sets every parameter's .grad to None, then runs forward + backward on each of the
    n_microbatches consecutive row slices of (inputs, targets); afterwards .grad holds the
    gradient of model(inputs, targets) (up to float rounding), as if the whole batch had been
    one. Returns that mean loss as a 0-d tensor, detached from the graph.
    The batch size must divide by n_microbatches (equal pieces: the mean of their means is
    the batch's mean), and n_microbatches >= 1; otherwise ValueError.
    """
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
    if inputs.shape[0] % n_microbatches:
        raise ValueError(f"the batch of {inputs.shape[0]} rows does not split into {n_microbatches} equal "
                         f"micro-batches: use a divisor of {inputs.shape[0]}")
    raise NotImplementedError("exercise accumulate_gradients is not implemented yet: edit exercises/single_device.py, see notebooks/01_single_device.ipynb")
