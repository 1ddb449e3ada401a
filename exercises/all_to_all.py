# GENERATED from solutions/all_to_all.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/12_experts.ipynb.
# untouched-stub fingerprint: 6395c69847587e9a
"""All-to-all from point-to-point messages (notebook 12_experts).

In an all-to-all every rank holds one chunk FOR every rank: rank i's chunk j goes to
rank j, where it lands as chunk i. Expert parallelism moves tokens this way: each rank
sends every expert's tokens to the rank holding that expert. The chunks may differ in
size (an expert gets as many tokens as the router sends it), so the sizes come as lists:

    input   [ to 0 | to 1 | ... ]   rows: input_split_sizes[j] go to group rank j
    output  [from 0|from 1| ... ]   rows: output_split_sizes[i] come from group rank i

Chunks are cut along dim 0 (rows); a row is everything else, the same on all ranks.
Rank i's output_split_sizes[j] must equal rank j's input_split_sizes[i]; if a receiver
expected another size it would wait forever for bytes that never come. So
`check_splits` first exchanges every rank's sizes (one small all-gather) and every rank
raises the same ValueError when they do not match, instead of hanging.
"""
import torch
import torch.distributed as dist

from labkit.comm.checks import DTYPE_CODES, metadata_device, group_info

NOTEBOOK = "12_experts"


def _splits(sizes, rows, n, name):
    """The sizes as a list of n ints, or an error message."""
    if sizes is None or (isinstance(sizes, (list, tuple)) and len(sizes) == 0):
        if rows % n:
            return None, f"{name}=None splits the {rows} rows equally, but {rows} does not divide by {n} ranks: pass the sizes"
        return [rows // n] * n, None
    sizes = [int(s) for s in sizes]
    if len(sizes) != n:
        return None, f"{name} has {len(sizes)} sizes for a group of {n} ranks: give one size per rank"
    if min(sizes) < 0:
        return None, f"{name}={sizes} holds a negative size"
    if sum(sizes) != rows:
        return None, f"{name}={sizes} adds up to {sum(sizes)} but the tensor has {rows} rows (dim 0)"
    return sizes, None


def check_splits(output, input, output_split_sizes, input_split_sizes, group=None):
    """(input sizes, output sizes) as lists, after checking them against every other rank's.

    Collective: every rank of `group` calls it. Raises the same ValueError on every rank
    when any rank's sizes do not add up, do not match its peers', or the rows differ
    (shape past dim 0, dtype). Sizes None or []: equal split, as in torch.
    """
    info = group_info(group)
    n = info.size
    problem = None
    if not isinstance(input, torch.Tensor) or not isinstance(output, torch.Tensor) or input.dim() == 0 or output.dim() == 0:
        problem = "input and output must be tensors with at least one dimension (the rows)"
        ins = outs = [0] * n
    else:
        ins, problem = _splits(input_split_sizes, input.shape[0], n, "input_split_sizes")
        outs, other = _splits(output_split_sizes, output.shape[0], n, "output_split_sizes")
        problem = problem or other
        if problem is None and (input.shape[1:] != output.shape[1:] or input.dtype != output.dtype):
            problem = (f"input rows {tuple(input.shape[1:])} {input.dtype} and output rows "
                       f"{tuple(output.shape[1:])} {output.dtype} differ: they must have the same shape past dim 0 and dtype")
        if problem is None and not output.is_contiguous():
            problem = "output must be contiguous (received rows are written into it): pass a contiguous tensor"
        ins, outs = (ins or [0] * n), (outs or [0] * n)
    row = input.shape[1:].numel() if isinstance(input, torch.Tensor) and input.dim() else 0
    code = DTYPE_CODES.index(input.dtype) if isinstance(input, torch.Tensor) and input.dtype in DTYPE_CODES else -1
    mine = torch.tensor([problem is not None, row, code] + list(ins) + list(outs), dtype=torch.int64,
                        device=metadata_device(group))  # nccl moves CUDA tensors only
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()  # [n, 3 + 2n]
    bad = table[:, 0].nonzero().flatten().tolist()
    if bad:
        raise ValueError(problem if problem else f"all_to_all_single: rank(s) {bad} of the group got bad sizes "
                         "(their own error says which); every rank stops here")
    if len(set(table[:, 1].tolist())) > 1 or len(set(table[:, 2].tolist())) > 1:
        raise ValueError(f"all_to_all_single: the ranks' rows differ (elements per row {table[:, 1].tolist()}, "
                         f"dtype codes {table[:, 2].tolist()}): every rank must pass rows of the same shape and dtype")
    sent = table[:, 3:3 + n]  # sent[j, i]: rows group rank j sends to rank i
    expected = table[:, 3 + n:]  # expected[i, j]: rows rank i expects from rank j
    if not torch.equal(sent.t(), expected):
        i, j = (sent.t() != expected).nonzero()[0].tolist()
        raise ValueError(f"all_to_all_single: rank {i} expects {int(expected[i, j])} rows from rank {j}, which sends it "
                         f"{int(sent[j, i])}: output_split_sizes[j] on rank i must equal input_split_sizes[i] on rank j "
                         "(exchange the counts first)")
    return ins, outs


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    """Like `dist.all_to_all_single`: rows input_split_sizes[j] of `input` go to group rank j,
    and the rows from rank i land in `output` at chunk i (output_split_sizes[i] rows), in place.

    Built from isend/irecv only. Sizes None: equal chunks. Chunks of size 0 send nothing.
    A rank that is not in `group` returns at once. Returns None.

    Given to you above the exercise: ``info = group_info(group)``, a
    `labkit.comm.checks.GroupInfo` with ``info.rank`` (this rank in the group),
    ``info.size`` and ``info.global_ranks`` (``global_ranks[i]``: the GLOBAL rank of group
    rank i); ``ins, outs``: the checked sizes as lists. Peers: ``dist.isend(t, dst=
    info.global_ranks[j], group=group)`` (or ``group_dst=j``), ``dist.irecv(t, src=..., group=group)``;
    each returns a Work: ``.wait()`` on every one before returning. Slices of the contiguous
    ``input`` and ``output`` along dim 0 are views: receive straight into them.
    """
    info = group_info(group)
    if info is None:
        return
    ins, outs = check_splits(output, input, output_split_sizes, input_split_sizes, group)
    input = input.contiguous()
    raise NotImplementedError("exercise all_to_all_single is not implemented yet: edit exercises/all_to_all.py, see notebooks/12_experts.ipynb")
