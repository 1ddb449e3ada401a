"""Context parallelism: ring attention over a CP group (notebook 11_long_sequences).

Each of the c ranks of a context-parallel (CP) group holds some pieces of the sequence (see
context_parallel.py for the splits): its queries, keys and values at those positions.
Everything in a transformer is per token except attention, where every query needs every
(earlier) key. Ring attention passes the key/value blocks around the ring: at step i rank r
holds the block of rank (r - i) mod c, sends it on to rank r+1 and receives the next from
rank r-1 (isend/irecv, overlapped with the attention on the block in hand). Partial results
over different key blocks are combined exactly with their log-sum-exp (`merge_partials`),
the online softmax of flash attention.

`ring_attention` is the autograd-aware entry point: forward = `ring_attention_forward`,
backward = a second trip around the ring in which each key/value block travels with its
gradient accumulators (dK, dV) and arrives home with every rank's contribution.
The ring is the ``"cp"`` axis of a `labkit.mesh.Mesh` (default: every rank); every function
that takes a mesh is collective over its cp group. The splits come from context_parallel.py
through ``impl("context_parallel")`` at call time (that module's model reaches this one the same
way: neither imports the other).
"""
import math
import time

import torch
import torch.distributed as dist

from labkit.grading import impl
from labkit.mesh import Mesh
from labkit.measure.timeline import NullTimeline
from labkit.renames import renamed_in

NOTEBOOK = "11_long_sequences"


def block_attention(q, k, v, q_pos=None, k_pos=None):
    """Softmax attention of q [..., m, hd] over ONE key block k, v [..., n, hd].

    With positions, key j is hidden from query i when k_pos[j] > q_pos[i] (causal). Returns
    (out [..., m, hd], lse [..., m]): the normalised output and the log-sum-exp of the scaled
    scores. A row with no visible key gets lse = -inf and out = 0 (an empty sum), not NaN.
    """
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if q_pos is not None:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # exp(-inf - 0) = 0, no NaN
    return torch.exp(scores - safe[..., None]) @ v, lse


def merge_partials(out1, lse1, out2, lse2):
    """Combine attention over two disjoint key blocks into attention over both, exactly.

    out_i [..., m, hd] is softmax attention over block i and lse_i [..., m] the log of its
    softmax denominator. Over both blocks: lse = log(e^lse1 + e^lse2), and each partial output
    is reweighted by its share of the denominator, e^(lse_i - lse). Rows that see no key in a
    block have lse_i = -inf (weight 0); rows that see none in either get out 0, lse -inf (no NaN).
    Returns (out, lse) with the inputs' shapes.
    """
    ### BEGIN SOLUTION
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1, w2 = torch.exp(lse1 - safe)[..., None], torch.exp(lse2 - safe)[..., None]
    return w1 * out1 + w2 * out2, lse
    ### END SOLUTION


# ---------------------------------------------------------------------------------------
# The ring


class RingPlan:
    """What this rank computes at each step of the ring: every rank's pieces, the block pairs, the work.

    The topology is the mesh's: the ring is its ``"cp"`` axis, this rank's place in it
    ``mesh.coord("cp")`` (`index`), its size ``mesh.size("cp")`` (`c`); `exchange` sends to
    ``mesh.next_rank("cp", wrap=True)`` and receives from ``mesh.prev_rank("cp", wrap=True)``
    (GLOBAL ranks: a CP group inside a larger mesh is not ranks 0..c-1) on ``mesh.group("cp")``.
    local_len * c must be the full sequence length `seq_len` (when given): a ValueError
    otherwise, which is what a CP size that does not match the mesh's looks like.
    `shapes` (q, k, v shapes, optional): the ranks first agree on them (one small all-gather),
    so that different local lengths raise ValueError on every rank before any block is sent.
    """

    def __init__(self, local_len: int, *, mesh: Mesh, split: str = "zigzag", mask="causal", seq_len=None,
                 device=None, shapes=None):
        cp = impl("context_parallel")  # the splits (yours, under exercises); no import cycle
        if split not in cp.SPLITS:
            raise ValueError(f"split={split!r} is not one of {sorted(cp.SPLITS)}")
        self.mask, self.mesh = cp.check_mask(mask), mesh
        self.index, self.c = mesh.coord("cp"), mesh.size("cp")
        if shapes is not None:  # before any check that could fail on some ranks only
            agree_on_shapes(shapes, mesh.group("cp") if self.c > 1 else None, device)
        s = local_len * self.c
        if seq_len is not None and seq_len != s:
            raise ValueError(f"this rank holds {local_len} positions and the CP group has {self.c} ranks, "
                             f"which makes {s}, not seq_len={seq_len}: shard the sequence over as many ranks as "
                             f"the CP group has (Mesh(world, cp={self.c}) takes {seq_len // self.c} per rank)")
        self.seq_len, self.device, self._cp = s, device, cp
        self.pieces = [cp.SPLITS[split](s, self.c, r) for r in range(self.c)]
        self.work = [0] * self.c  # query x key pairs computed at each step (dense blocks)

    def holder(self, step: int) -> int:
        """Whose key/value block (an index along cp) this rank holds at `step`."""
        return (self.index - step) % self.c

    def pairs(self, step: int):
        """(q slice, k slice, q_pos or None, k_pos or None) for every pair of pieces that needs computing."""
        cp, out = self._cp, []
        for qp, qs in cp.local_slices(self.pieces[self.index]):
            for kp, ks in cp.local_slices(self.pieces[self.holder(step)]):
                kind = cp.pair_kind(qp, kp, self.mask)
                if kind != "none":
                    pos = (torch.arange(*qp, device=self.device), torch.arange(*kp, device=self.device)) \
                        if kind == "some" else (None, None)
                    out.append((qs, ks) + pos)
        return out

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0):
        """Start sending to the next rank along cp and receiving from the previous one: the two requests."""
        mesh, group = self.mesh, self.mesh.group("cp")
        return [dist.isend(send, mesh.next_rank("cp", wrap=True), group=group, tag=tag),
                dist.irecv(recv, mesh.prev_rank("cp", wrap=True), group=group, tag=tag)]


def ring_mesh(mesh: Mesh | None) -> Mesh:
    """`mesh`, or by default a ring over every rank: ``Mesh(world, cp=world)`` on the default group."""
    if mesh is not None:
        return mesh
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    return Mesh(world, cp=world, rank=dist.get_rank() if initialised else 0, groups=False)


def agree_on_shapes(shapes, group=None, device=None) -> None:
    """ValueError on EVERY rank of `group` unless all hold q, k, v of the same shapes (k, v with q's length).

    Ring attention sends each rank's k/v block into buffers shaped like the receiver's own, so
    different local lengths would corrupt or crash the exchange: one all-gather of the shapes
    first (a few integers) turns that into a clear error before any block travels.
    """
    q, k, v = (tuple(s) for s in shapes)
    if len({len(q), len(k), len(v)}) != 1 or k != v or k[:-2] != q[:-2] or k[-2] != q[-2]:
        raise ValueError(f"ring attention needs q, k, v of the same [B, H, n, hd] shapes on a rank (self-attention: "
                         f"every position has a query, a key and a value), got q {q}, k {k}, v {v}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    mine = torch.tensor(q + k[-1:], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if dist.get_backend(group) == "fake":  # labkit.scale's simulated ranks: the fake group carries no data
        return
    if any(not torch.equal(other, mine) for other in every):
        listed = ", ".join(f"group rank {r}: q {tuple(t[:-1].tolist())}" for r, t in enumerate(every))
        raise ValueError(f"ring attention needs the same local shapes on every rank of the CP group, got {listed}: "
                         "shard the sequence into equal pieces (context_parallel.SPLITS[split](s, c, rank) gives "
                         "each rank s/c positions)")


def ring_attention_forward(q, k, v, *, mesh: Mesh | None = None, split: str = "zigzag", mask="causal",
                           seq_len=None, timeline=NullTimeline()):
    """This rank's rows of attention over the whole sequence, with k/v blocks passed around the ring.

    mesh: the `labkit.mesh.Mesh` whose ``"cp"`` axis is the ring (default: every rank, `ring_mesh`).
    q, k, v [B, H, n, hd] are this rank's pieces (``take(x, SPLITS[split](s, c, mesh.coord("cp")))``),
    s = n*c. Returns (out [B, H, n, hd], lse [B, H, n]), equal to full attention's rows at this
    rank's positions. At each step, first start passing the block in hand on (`ring.exchange`),
    then compute on it pair by pair (`ring.pairs(step)`: skipped pairs left out, a causal mask
    only on pairs that straddle the diagonal), merging into (out, lse), then wait for the next
    block. Records spans 'F' (compute, mb=step) and 'recv' (issue to arrival) on `timeline`, and
    the work per step in ring.work; returns the `RingPlan` as a third value.

    What you need: ``ring.c`` (ranks in the ring); ``ring.exchange(send, recv)`` starts
    ``dist.isend(send)`` to the next rank on the mesh's cp axis and ``dist.irecv(recv)`` from the previous one and
    returns the two requests (``request.wait()`` each before reading ``recv``);
    ``ring.pairs(step)`` lists ``(q slice, k slice, q_pos, k_pos)`` for the block held at
    `step`; ``block_attention(q, k, v, q_pos, k_pos) -> (out, lse)``; your `merge_partials`;
    ``ring.work[step] += rows x keys`` of each pair. Timeline: ``with timeline.span("F", mb=step):``
    around the compute, and ``timeline.record("recv", t0, t1, mb=step)`` with two
    ``time.perf_counter()`` readings (t0 when the exchange is issued, t1 after its wait).
    Start from out = 0 and lse = -inf (``torch.full(q.shape[:-1], float("-inf"))``).
    """
    ring = RingPlan(q.shape[-2], mesh=ring_mesh(mesh), split=split, mask=mask, seq_len=seq_len, device=q.device,
                    shapes=(q.shape, k.shape, v.shape))
    ### BEGIN SOLUTION
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v]).contiguous()  # one message per step
    for step in range(ring.c):
        if step < ring.c - 1:  # start passing this block on before working on it
            incoming, issued = torch.empty_like(kv), time.perf_counter()
            requests = ring.exchange(kv, incoming)
        with timeline.span("F", mb=step):
            for qs, ks, q_pos, k_pos in ring.pairs(step):
                o, l = block_attention(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], q_pos, k_pos)
                out[..., qs, :], lse[..., qs] = merge_partials(out[..., qs, :], lse[..., qs], o, l)
                ring.work[step] += (qs.stop - qs.start) * (ks.stop - ks.start)
        if step < ring.c - 1:
            for request in requests:
                request.wait()
            timeline.record("recv", issued, time.perf_counter(), mb=step)
            kv = incoming
    return out, lse, ring
    ### END SOLUTION


def _ring_backward(q, k, v, out, lse, dout, ring: RingPlan):
    """dQ, dK, dV of ring attention: each k/v block goes round once more with its dK/dV."""
    scale = 1 / math.sqrt(q.shape[-1])
    delta = (dout * out).sum(-1)  # rowsum(dO * O) = rowsum(P * dP), the softmax's backward term
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dq, kv = torch.zeros_like(q), torch.stack([k, v]).contiguous()
    dkv = torch.zeros_like(kv)  # dK, dV of the block in hand: they travel with it
    for step in range(ring.c):
        if step < ring.c - 1:  # prefetch the next k/v block while computing on this one
            incoming = torch.empty_like(kv)
            requests = ring.exchange(kv, incoming)
        for qs, ks, q_pos, k_pos in ring.pairs(step):
            qb, kb, vb, dob = q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], dout[..., qs, :]
            scores = qb @ kb.transpose(-1, -2) * scale
            if q_pos is not None:
                scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            p = torch.exp(scores - safe[..., qs, None])  # the final softmax, from the final lse
            dkv[1][..., ks, :] += p.transpose(-1, -2) @ dob
            ds = p * (dob @ vb.transpose(-1, -2) - delta[..., qs, None]) * scale
            dq[..., qs, :] += ds @ kb
            dkv[0][..., ks, :] += ds.transpose(-1, -2) @ qb
        if ring.c > 1:  # the accumulators follow their block; after c steps they are home
            arrived = torch.empty_like(dkv)
            for request in ring.exchange(dkv, arrived, tag=1):  # its own tag: never mixed up with k/v
                request.wait()
            dkv = arrived
        if step < ring.c - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Forward: ring_attention_forward. Backward: _ring_backward (saves only this rank's q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, split, mask, seq_len, timeline):
        out, lse, ring = ring_attention_forward(q, k, v, mesh=mesh, split=split, mask=mask, seq_len=seq_len,
                                                timeline=timeline)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return *_ring_backward(q, k, v, out, lse, dout.contiguous(), ctx.ring), None, None, None, None, None


def ring_attention(q, k, v, *, mesh: Mesh | None = None, split="zigzag", mask="causal", seq_len=None,
                   timeline=NullTimeline()):
    """Differentiable ring attention: this rank's output rows [B, H, n, hd] (see ring_attention_forward)."""
    return RingAttention.apply(q, k, v, mesh, split, mask, seq_len, timeline)


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
