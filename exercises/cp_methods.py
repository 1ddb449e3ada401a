# GENERATED from solutions/cp_methods.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/11_long_sequences.ipynb.
# untouched-stub fingerprint: 330d3781edae99f2
"""Context parallelism three more ways: all-gather K/V, Ulysses all-to-all, and the hybrid (notebook 11_long_sequences).

Every method takes this rank's pieces of the sequence, q, k, v [B, H, n, hd] (``take(x, SPLITS[split](s, c,
mesh.coord("cp")))``, s = n c) and returns this rank's rows of causal attention over the whole sequence, as the
ring does (ring_attention.py); they differ in what travels and what each rank holds.

    all-gather K/V   (Llama 3, arXiv 2407.21783, section 3.3.2) each rank keeps its zigzag query pieces (chunks r
                     and 2c-1-r: the same causal work everywhere), all-gathers K and V over cp and attends to
                     them at their global positions; backward reduce-scatters dK, dV. Holds the full K, V.
    Ulysses          (DeepSpeed-Ulysses, arXiv 2309.14509) an all-to-all swaps sequence-sharding for
                     head-sharding: each rank then holds the WHOLE sequence for H/c heads, runs ordinary causal
                     attention, and an all-to-all swaps back. Needs H (per tp rank) divisible by c.
    hybrid           (Megatron/TransformerEngine cp_comm_type "a2a+p2p") Ulysses inside each group of `local`
                     ranks (a node: fast links), then a ring across the c/local groups over the gathered blocks.

Bytes per call, X = B H n hd x element bytes (one of q, k, v, out on one rank), c ranks in cp, as
`labkit.comm` counts them (wire = payload x bus factor; a point-to-point message counts as sent by
`isend` and as received by `irecv`). Every call first agrees on the shapes: one all-gather of 5 int64
per rank over the cp group (payload 40 c bytes, wire 40 (c-1)), left out of the lines below:
    ring        forward: c-1 isends of K,V (2X each); backward: c-1 more of K,V and c of dK,dV (2X each)
                sent = 2X (3c-2); received the same
    all-gather  forward: one all-gather of K,V, payload 2Xc, wire 2X (c-1); backward: one reduce-scatter of
                dK,dV, payload 2Xc, wire 2X (c-1); total wire 4X (c-1)
    Ulysses     4 all-to-alls forward (q, k, v in; out back), 4 backward (dout in; dq, dk, dv back), each
                payload X, wire X (c-1)/c; total wire 8X (c-1)/c
    hybrid      l = local, o = c/l nodes: the 8 all-to-alls of Ulysses over l ranks (wire 8X (l-1)/l); then
                the ring over o nodes on blocks of l n positions and H/l heads (2X per K,V block again):
                sent 2X (3o-2) when o > 1, received the same (0 when o = 1)

Which is an exercise: `seq_to_heads` and `heads_to_seq`, Ulysses' two all-to-alls, are yours: notebook 12's
all-to-all, now swapping which dimension is sharded, and the whole method is those two swaps around ordinary
attention. The all-gather method and the hybrid are given: the first is an all-gather and a mask you have already
met (notebook 11's positions, notebook 08's gather/reduce-scatter pair; tested in tests/test_cp_given_methods.py),
the second composes your Ulysses swaps with the ring of notebook 11 (graded with your swaps in
tests/grading/test_cp_methods.py). Their building blocks (the K/V gather, attention at global positions, the cp
axis as nodes `CPLevels`, the ring across nodes, the heads check) are labkit's: labkit/parallel/context_methods.py.

GQA: the lab's model has as many K/V heads as query heads (labkit/model/llama.py has no n_kv_heads). With GQA
(n_kv < H K/V heads), the all-gather moves n_kv/H as many bytes (Llama 3's reason for it: 8 K/V heads of 128);
Ulysses needs n_kv divisible by c as well, or each K/V head replicated on c/n_kv ranks (c/n_kv times the K/V
bytes and memory that GQA saved), so its degree stops at n_kv (8 for Llama 3) unless replicated.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.grading import impl
from labkit.mesh import Mesh
from labkit.parallel.context_methods import CPLevels, GatherKV, NodeRing, attend_at_positions, check_heads  # given

NOTEBOOK = "11_long_sequences"


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def seq_to_heads(x, *, group: dist.ProcessGroup | None = None):
    """Ulysses' first all-to-all: [B, H, n, hd] (this rank's n positions, every head) -> [B, H/c, c n, hd].

    c = the group's size. Head group j (heads j H/c .. (j+1) H/c - 1) goes to group rank j; what comes back
    from group rank i (its n positions of MY head group) is placed i-th along the sequence, so the output's
    sequence is the ranks' pieces in group-rank order. One ``dist.all_to_all_single(out, inp, group=group)``
    on ``inp`` = x's head groups stacked along dim 0 ([c, B, H/c, n, hd], contiguous): chunk j of dim 0 goes to
    rank j, and chunk i of ``out`` comes from rank i. Returns x itself when c = 1. ValueError when c does not
    divide H (`check_heads`), before any message.
    """
    c = _world(group)
    if c == 1:
        return x
    B, H, n, hd = x.shape
    check_heads(H, c, "seq_to_heads")
    raise NotImplementedError("exercise seq_to_heads is not implemented yet: edit exercises/cp_methods.py, see notebooks/11_long_sequences.ipynb")


def heads_to_seq(y, *, group: dist.ProcessGroup | None = None):
    """Ulysses' second all-to-all, the inverse of `seq_to_heads`: [B, H/c, c n, hd] -> [B, H, n, hd].

    Sequence chunk i (group rank i's n positions) goes back to group rank i; what comes from group rank j
    (head group j at MY positions) is placed j-th along the heads. One ``dist.all_to_all_single`` on
    [c, B, H/c, n, hd]. Returns y itself when c = 1. ValueError when c does not divide the sequence.
    """
    c = _world(group)
    if c == 1:
        return y
    B, h, s, hd = y.shape
    if s % c:
        raise ValueError(f"heads_to_seq: a sequence of {s} positions does not split over {c} ranks")
    raise NotImplementedError("exercise heads_to_seq is not implemented yet: edit exercises/cp_methods.py, see notebooks/11_long_sequences.ipynb")


class _SeqToHeads(torch.autograd.Function):
    """seq_to_heads forward; its transpose, heads_to_seq, backward (an all-to-all is a permutation)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group=group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), group=ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return heads_to_seq(y, group=group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), group=ctx.group), None


def _plan(q, k, v, mesh: Mesh, split: str, mask, seq_len):
    """(c, every cp rank's positions, this rank's positions, mask) after the checks every method shares."""
    cp, ra = impl("context_parallel"), impl("ring_attention")
    if split not in cp.SPLITS:
        raise ValueError(f"split={split!r} is not one of {sorted(cp.SPLITS)}")
    mask, c = cp.check_mask(mask), mesh.size("cp")
    s = q.shape[-2] * c
    if seq_len is not None and seq_len != s:
        raise ValueError(f"this rank holds {q.shape[-2]} positions and the CP group has {c} ranks, which makes {s}, "
                         f"not seq_len={seq_len}: shard the sequence over as many ranks as the CP group has")
    ra.agree_on_shapes((q.shape, k.shape, v.shape), mesh.group("cp") if c > 1 else None, q.device)
    every = [cp.positions(cp.SPLITS[split](s, c, r)).to(q.device) for r in range(c)]
    return c, every, every[mesh.coord("cp")], mask


def allgather_attention(q, k, v, *, mesh: Mesh, split: str = "zigzag", mask="causal", seq_len=None):
    """Llama 3's context parallelism: all-gather K and V over the mesh's cp axis, attend locally (differentiable).

    q, k, v [B, H, n, hd]: this rank's pieces (zigzag: chunks r and 2c-1-r, so that every rank's queries see as
    many keys). K, V arrive in cp-rank order, each rank's pieces at their global positions, and the causal mask
    is read from positions. Backward: autograd through the local attention, then one reduce-scatter sums every
    rank's dK, dV of this rank's pieces. Returns out [B, H, n, hd]. Holds the full K and V ([B, H, s, hd] each).
    """
    c, every, mine, mask = _plan(q, k, v, mesh, split, mask, seq_len)
    if c == 1:
        return attend_at_positions(q, k, v, mine, mine, mask)
    kv = GatherKV.apply(torch.stack([k, v]), mesh.group("cp"))  # [c, 2, B, H, n, hd]
    full_k, full_v = (kv[:, i].permute(1, 2, 0, 3, 4).flatten(2, 3) for i in (0, 1))  # [B, H, c n, hd]
    return attend_at_positions(q, full_k, full_v, mine, torch.cat(every), mask)


def _ulysses(q, k, v, group, every, mask):
    """Swap to heads over `group`, attend to the whole sequence (positions `every`, in group order), swap back."""
    pos = torch.cat(every)
    order = torch.argsort(pos)  # attend in position order: plain causal attention, as a fused kernel would
    qh, kh, vh = (_SeqToHeads.apply(t, group)[..., order, :] for t in (q, k, v))
    if mask is None:
        y = F.scaled_dot_product_attention(qh, kh, vh)
    else:
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order), device=order.device)
    return _HeadsToSeq.apply(y[..., back, :], group)


def ulysses_attention(q, k, v, *, mesh: Mesh, split: str = "zigzag", mask="causal", seq_len=None):
    """DeepSpeed-Ulysses over the mesh's cp axis (differentiable): your two all-to-alls around full attention.

    q, k, v [B, H, n, hd]: this rank's pieces. ValueError (before any message) unless c divides H. Holds, for
    H/c heads, the whole sequence's q, k, v. Returns out [B, H, n, hd].
    """
    check_heads(q.shape[1], mesh.size("cp"), "Ulysses (cp_method='ulysses')")
    c, every, mine, mask = _plan(q, k, v, mesh, split, mask, seq_len)
    if c == 1:
        return attend_at_positions(q, k, v, mine, mine, mask)
    return _ulysses(q, k, v, mesh.group("cp"), every, mask)


# ------------------------------------------------------------------------------------------ the hybrid
def hybrid_attention(q, k, v, *, levels: CPLevels, split: str = "zigzag", mask="causal", seq_len=None):
    """Megatron's "a2a+p2p": Ulysses inside each node of `levels`, a ring across the nodes (differentiable).

    q, k, v [B, H, n, hd]: this rank's pieces on ``levels.mesh``'s cp axis. Your `seq_to_heads` over the node
    gives each rank H/local heads of its node's local n positions; the ring passes those K, V blocks across
    the nodes; your `heads_to_seq` brings the output back. ValueError (before any message) unless local
    divides H. Returns out [B, H, n, hd].
    """
    check_heads(q.shape[1], levels.local, "the hybrid's all-to-all (cp_method='hybrid')")
    c, every, mine, mask = _plan(q, k, v, levels.mesh, split, mask, seq_len)
    if c == 1:
        return attend_at_positions(q, k, v, mine, mine, mask)
    if levels.nodes == 1:  # one node: Ulysses
        return _ulysses(q, k, v, levels.local_group, every, mask)
    pos = [torch.cat(every[j * levels.local:(j + 1) * levels.local]) for j in range(levels.nodes)]
    qh, kh, vh = (_SeqToHeads.apply(t, levels.local_group) for t in (q, k, v))
    return _HeadsToSeq.apply(NodeRing.apply(qh, kh, vh, levels, pos, mask, impl("ring_attention")), levels.local_group)
