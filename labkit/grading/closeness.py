"""One tensor against its reference, in words: what differs, by how much, and the likely cause.

    from labkit.grading.closeness import check_close
    check_close(p.grad, want, "the gradient of w1 on rank 1", factors={2: "a sum over the 2 ranks where a mean was due"})

raises AssertionError("the gradient of w1 on rank 1 differs from the reference: largest difference 0.25 at index
(3, 0) (got 0.5, expected 0.25; largest expected magnitude 0.31); got = 2 x expected: a sum over the 2 ranks where a
mean was due") instead of torch's "Tensor-likes are not close!". Notebook check cells and grading tests use it where
the learner needs the quantity, the expected and actual value and the likely cause.

The factor: when `got` is a uniform multiple r of `want` (least squares r = <got, want> / <want, want>, and
every element within 1e-6 of the largest expected magnitude of r x want), the message says "got = r x expected",
and the cause given for that r in `factors` (matched to 1e-6 relative). A factor of 0 reads as "nothing
changed or nothing arrived"; a factor of -1 as the opposite sign.
"""
from __future__ import annotations

import torch

RATIO_TOL = 1e-6  # far above float64 rounding, far below any real mistake's residual
DEFAULT_TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5),
                      torch.bfloat16: (1.6e-2, 1e-5)}  # (rtol, atol), as torch.testing.assert_close documents them


def uniform_factor(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """r when got == r x want element by element (to RATIO_TOL of want's largest magnitude), else None."""
    got, want = got.detach().double().cpu().reshape(-1), want.detach().double().cpu().reshape(-1)
    ww = float((want * want).sum())
    if got.shape != want.shape or not ww or not torch.isfinite(got).all():
        return None
    r = float((got * want).sum()) / ww
    scale = float(want.abs().max())
    return r if float((got - r * want).abs().max()) <= RATIO_TOL * max(scale, abs(r) * scale) else None


def factor_hint(got: torch.Tensor, want: torch.Tensor, factors: dict | None = None) -> str:
    """'got = 4 x expected: <cause>' when got is a uniform multiple of want (r != 1), else ''."""
    r = uniform_factor(got, want)
    if r is None or abs(r - 1) <= RATIO_TOL:
        return ""
    for factor, cause in (factors or {}).items():
        if abs(r - factor) <= RATIO_TOL * max(1.0, abs(factor)):
            return f"got = {r:.4g} x expected: {cause}"
    if abs(r) <= RATIO_TOL:
        return "got = 0 x expected: nothing was added or nothing arrived"
    if abs(r + 1) <= RATIO_TOL:
        return "got = -1 x expected: the opposite sign"
    return f"got = {r:.4g} x expected"


def largest_difference(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Where two same-shaped tensors differ most (a NaN counts as infinitely far), in float64:
    the difference, its flat index, its position, and the two values there."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (g - w).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    index = int(diff.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), diff.shape)) if diff.dim() else ()
    return dict(diff=diff, max=diff.max().item(), index=index, where=where,
                got=g.reshape(-1)[index].item(), want=w.reshape(-1)[index].item())


def difference(got: torch.Tensor, want: torch.Tensor, rtol=None, atol=None) -> str | None:
    """None when close (torch.testing.assert_close's rule), else where and by how much, in words."""
    if tuple(got.shape) != tuple(want.shape):
        return f"it has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, check_dtype=False, check_device=False)
        return None
    except AssertionError:
        pass
    d, w = largest_difference(got, want), want.detach().double().cpu()
    at = f" at index {d['where']}" if d["where"] else ""
    if rtol is None:  # torch.testing.assert_close's defaults for the dtype
        rtol, atol = DEFAULT_TOLERANCES.get(want.dtype, (0.0, 0.0))
    wrong = int((d["diff"] > atol + rtol * w.abs()).sum())
    return (f"largest difference {d['max']:.3g}{at} (got {d['got']:.6g}, expected {d['want']:.6g}; "
            f"largest expected magnitude {w.abs().max().item():.3g}; {wrong} of {w.numel()} elements differ)")


def check_close(got, want, what: str, *, hint: str = "", factors: dict | None = None, rtol=None, atol=None) -> None:
    """AssertionError naming `what`, the first (largest) difference, a uniform factor and its cause, and `hint`.

    rtol/atol as torch.testing.assert_close (give both or neither; None: its defaults for the dtype).
    """
    __tracebackhide__ = True  # pytest and IPython show the caller's line, not this one
    if (rtol is None) != (atol is None):
        raise ValueError(f"give both rtol and atol, or neither (got rtol={rtol}, atol={atol})")
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    text = difference(got, want, rtol, atol)
    if text is None:
        return
    ratio = factor_hint(got, want, factors) if got.shape == want.shape else ""
    raise AssertionError(f"{what} differs from the reference: {text}" + (f"; {ratio}" if ratio else "")
                         + (f". {hint}" if hint else ""))
