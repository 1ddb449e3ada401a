# GENERATED from solutions/slow_links.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/13_slow_links_and_failures.ipynb.
# untouched-stub fingerprint: 5fe8961a5dd79b8e
"""Training over slow links (notebook 13_slow_links_and_failures): DiLoCo and PowerSGD.

Two ways to send fewer bytes than data parallelism's one all-reduce of every gradient per step:

- **DiLoCo / local SGD** (Douillard et al. 2023, Lin et al. 2018): each replica takes H inner
  steps (AdamW) on its own data, alone. Then the replicas average the *pseudo-gradient*
  Delta = shared weights - local weights, and an outer optimizer (SGD with Nesterov momentum)
  updates the shared weights with it. One all-reduce of the weights' size per H steps.
- **PowerSGD** (Vogels et al. 2019; torch's `powerSGD_hook`): each gradient matrix M (n x m)
  is sent as two thin matrices P (n x r) and Q (m x r), r(n + m) numbers instead of nm.
  What the rank-r approximation drops is kept in a residual (error feedback) and added
  to the next step's gradient, so nothing is lost, only delayed.
  (Top-k with error feedback is the other classic: send the k largest entries and their
  indices, keep the rest as residual. Same bookkeeping, an all-gather instead of an all-reduce.)

All methods that communicate are collective: every rank of `group` calls them in the same order.
"""
import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.flat import allreduce_mean_, trainable as _trainable
from labkit.renames import renamed_in, renamed_method

NOTEBOOK = "13_slow_links_and_failures"


def _positive_int(name: str, value, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}: {fix}")
    return value


def sync_gradients(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """The baseline (not an exercise): plain DP, every .grad averaged over the ranks with ONE flat all-reduce."""
    allreduce_mean_([p.grad for p in _trainable(model)], group=group)


# --------------------------------------------------------------------------- DiLoCo


def average_pseudo_gradients(model: nn.Module, shared: list, *, group: dist.ProcessGroup | None = None) -> None:
    """Set ``shared[i].grad`` = mean over the ranks of ``shared[i] - p_i`` for the model's i-th trainable p.

    `shared` holds the shared (outer) weights, one tensor per trainable parameter, equal on
    every rank; the model holds this rank's weights after its inner steps. The pseudo-gradients
    travel in ONE all-reduce of one flat buffer (as many numbers as the trainable weights),
    so a sync costs exactly one DP step's gradient all-reduce.
    """
    raise NotImplementedError("exercise average_pseudo_gradients is not implemented yet: edit exercises/slow_links.py, see notebooks/13_slow_links_and_failures.ipynb")


class DiLoCo:
    """DiLoCo on this rank: ``step()`` after each ``loss.backward()``.

    ``DiLoCo(model, inner_optimizer, inner_steps, outer_lr=0.7, outer_momentum=0.9,
    nesterov=True, *, group=None)``. The model's weights must be equal on every rank at the
    start (same seed, or a broadcast). ``step()`` takes one inner step (``inner_optimizer.step()``
    then ``zero_grad``); after every `inner_steps`-th one it syncs (collective): the averaged
    pseudo-gradient goes to the outer SGD, which updates ``self.shared``, and the model's
    weights are set to the new shared weights. Returns True when it synced.
    The inner optimizer keeps its state (AdamW moments) across syncs, as in DiLoCo.

    With inner_steps=1, outer SGD lr=1 and no momentum, and an inner optimizer whose update
    is a linear function of the gradient (SGD, with or without momentum and weight decay),
    every sync gives exactly the DP update: mean_i(theta - (theta - lr g_i)) = lr mean_i g_i.
    Raises ValueError for inner_steps < 1 or a non-positive outer_lr.
    """

    def __init__(self, model: nn.Module, inner_optimizer, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, *, group: dist.ProcessGroup | None = None):
        self.inner_steps = _positive_int("inner_steps (H)", inner_steps,
                                         "H is the number of local steps between syncs; H=1 syncs every step")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr!r} (DiLoCo uses 0.7; lr=1 without momentum is local SGD)")
        self.model, self.inner, self.group = model, inner_optimizer, group
        self.shared = [p.detach().clone() for p in _trainable(model)]
        self.outer = torch.optim.SGD(self.shared, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)
        self.steps = 0  # inner steps taken

    def step(self) -> bool:
        """One inner step (``self.inner.step()``, ``self.inner.zero_grad()``); count it in ``self.steps``;
        every ``self.inner_steps``-th step call ``self.sync()`` and return True, else False."""
        raise NotImplementedError("exercise DiLoCo is not implemented yet: edit exercises/slow_links.py, see notebooks/13_slow_links_and_failures.ipynb")

    def sync(self) -> None:
        """The outer step (collective): average the pseudo-gradients, outer SGD, weights = shared.

        Uses your ``average_pseudo_gradients(self.model, self.shared, self.group)``, the outer SGD
        ``self.outer`` (it steps ``self.shared``), and ``_trainable(model)`` (the weights to overwrite)."""
        raise NotImplementedError("exercise DiLoCo is not implemented yet: edit exercises/slow_links.py, see notebooks/13_slow_links_and_failures.ipynb")


# --------------------------------------------------------------------------- PowerSGD


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (n x r) of the columns of p (n x r, r <= n): the Q factor of QR.

    Householder QR always returns orthonormal columns, even for a rank-deficient or zero p
    (where Gram-Schmidt would divide by zero).
    """
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGD:
    """Rank-r PowerSGD with error feedback for `model`'s gradients: ``sync_gradients()`` between backward and step.

    ``PowerSGD(model, rank, *, group=None, seed=0)``. Every trainable parameter with >= 2
    dimensions is a matrix M = grad.reshape(shape[0], -1) (n x m), compressed at rank
    r = min(rank, n, m); vectors (biases, norms) are all-reduced uncompressed.
    ``sync_gradients()`` (collective; every trainable parameter must have a .grad) replaces each .grad
    by its compressed average over the ranks:

        M = grad + residual                      error feedback: add what was dropped before
        P = M Q               all-reduce P       Q: n x r from the last step (warm start), first
        P^ = orthonormalize(P)                      from a seeded random draw, equal on all ranks
        Q_i = M^T P^          all-reduce Q -> Q = mean_i Q_i
        grad = P^ Q^T                            = mean_i of this rank's part P^ Q_i^T
        residual = M - P^ Q_i^T                  what this rank's part did not carry

    So each rank's transmitted parts plus its residual add up to the sum of its true
    gradients, step after step (the error-feedback invariant), and at full rank
    (rank >= min(n, m)) grad = P^ P^T mean_i M_i = the DP average (up to rounding).
    Per step: one all-reduce of all vectors, one of all P, one of all Q (in that order).
    Attributes: ``residuals`` and ``transmitted`` (this rank's part P^ Q_i^T, or the vector
    itself) per trainable parameter, in the parameter's shape. Raises ValueError for rank < 1.
    """
    reduce = renamed_method("PowerSGD.reduce")  # an old name, for one release (labkit/renames.py)

    def __init__(self, model: nn.Module, rank: int, *, group: dist.ProcessGroup | None = None, seed: int = 0):
        self.rank = _positive_int("rank r", rank, "PowerSGD sends rank-r factors; r=1 is the smallest, "
                                  "r >= min(n, m) is uncompressed")
        self.model, self.group = model, group
        self.params = _trainable(model)
        g = torch.Generator().manual_seed(seed)
        self.qs = {}  # parameter index -> Q (m x r), the warm start
        for i, p in enumerate(self.params):
            if p.dim() >= 2:
                n, m = p.shape[0], p[0].numel()
                self.qs[i] = torch.randn(m, min(self.rank, n, m), generator=g, dtype=p.dtype).to(p.device)
        self.residuals = [torch.zeros_like(p) for p in self.params]
        self.transmitted = [torch.zeros_like(p) for p in self.params]

    def numbers_sent(self) -> tuple[int, int]:
        """(numbers sent per step, numbers DP would send): the compression ratio is their quotient."""
        sent = sum(p.numel() for i, p in enumerate(self.params) if i not in self.qs)
        sent += sum((self.params[i].shape[0] + q.shape[0]) * q.shape[1] for i, q in self.qs.items())
        return sent, sum(p.numel() for p in self.params)

    def sync_gradients(self) -> None:
        """See the class docstring. What you have: ``self.params`` (trainable, in order), ``self.qs``
        ({parameter index: Q (m x r)} for the matrices; the others are vectors), ``self.residuals``
        and ``self.transmitted`` (to fill), ``orthonormalize(p)``, ``allreduce_mean_(tensors, *, group)``
        (labkit.parallel.flat: one flat all-reduce, averaged, written back), ``dist.all_reduce(t, group=self.group)``."""
        raise NotImplementedError("exercise PowerSGD is not implemented yet: edit exercises/slow_links.py, see notebooks/13_slow_links_and_failures.ipynb")


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
