"""Context parallelism: ring attention over a CP group (notebook 11_long_sequences).

Each of the c ranks of a context-parallel (CP) group holds some pieces of the sequence: its
queries, keys and values at those positions. Everything in a transformer is per token except
attention, where every query needs every (earlier) key. Ring attention passes the key/value
blocks around the ring: at step i rank r holds the block of rank (r - i) mod c, sends it on to
rank r+1 and receives the next from rank r-1 (isend/irecv, overlapped with the attention on
the block in hand). Partial results over different key blocks are combined exactly with their
log-sum-exp (`merge_partials`), the online softmax of flash attention.

How the sequence is split decides the work per rank under a causal mask:
    contiguous_split  rank r takes block r of c: rank c-1 attends to everything, rank 0 to one block
    zigzag_split      2c chunks, rank r takes chunks r and 2c-1-r: the same causal work on every rank
A split is a list of (start, stop) pieces per rank; `take` cuts them out of a full tensor.

`ring_attention` is the autograd-aware entry point: forward = `ring_attention_forward`,
backward = a second trip around the ring in which each key/value block travels with its
gradient accumulators (dK, dV) and arrives home with every rank's contribution.
Every function with a group is collective over it (None: the default group).
"""
import math
import time

import torch
import torch.distributed as dist

from labkit.timeline import NullTimeline

NOTEBOOK = "11_long_sequences"


# ---------------------------------------------------------------------------------------
# Splitting the sequence


def check_split(s: int, parts: int, what: str) -> int:
    """s // parts, or a ValueError that says which sequence lengths would split."""
    if not isinstance(s, int) or s < 1 or s % parts:
        lower, upper = max(parts, s // parts * parts), (s // parts + 1) * parts
        hint = f"{lower} or {upper}" if lower != upper and lower < s else f"{upper}"
        raise ValueError(f"sequence length s={s} does not split into {what}={parts} equal chunks: use a "
                         f"multiple of {parts} (such as {hint}), e.g. pad the sequence")
    return s // parts


def contiguous_split(s: int, c: int, rank: int) -> list[tuple[int, int]]:
    """[(start, stop)]: block `rank` of c equal blocks. ValueError if c does not divide s."""
    n = check_split(s, c, "c")
    return [(rank * n, (rank + 1) * n)]


def zigzag_split(s: int, c: int, rank: int) -> list[tuple[int, int]]:
    """[(start, stop), (start, stop)]: chunks `rank` and 2c-1-rank of 2c equal chunks of range(s).

    Under a causal mask chunk j attends to j+1 chunks, so chunks r and 2c-1-r together attend to
    2c+1 chunks whatever r: every rank does the same work. Raises ValueError (via check_split,
    with what="2c") when s does not split into 2c equal chunks, and when rank is not in range(c).
    """
    ### BEGIN SOLUTION
    if not 0 <= rank < c:
        raise ValueError(f"rank={rank} is not in range(c={c})")
    n = check_split(s, 2 * c, "2c")
    return [(rank * n, (rank + 1) * n), ((2 * c - 1 - rank) * n, (2 * c - rank) * n)]
    ### END SOLUTION


SPLITS = {"contiguous": contiguous_split, "zigzag": zigzag_split}


def take(x: torch.Tensor, pieces, dim: int = -2) -> torch.Tensor:
    """The pieces of x along dim, concatenated (this rank's share of a full tensor)."""
    return torch.cat([x.narrow(dim, a, b - a) for a, b in pieces], dim=dim)


def positions(pieces) -> torch.Tensor:
    """The global positions of the pieces, in the order `take` puts them."""
    return torch.cat([torch.arange(a, b) for a, b in pieces])


def local_slices(pieces):
    """[(piece, slice into the local tensor)] for each piece."""
    out, at = [], 0
    for a, b in pieces:
        out.append(((a, b), slice(at, at + b - a)))
        at += b - a
    return out


def check_mask(mask):
    """'causal' or None ('none' accepted); anything else is a ValueError."""
    if mask == "none":
        return None
    if mask not in ("causal", None):
        raise ValueError(f"mask={mask!r} is not supported: ring attention here takes mask='causal' or "
                         "mask=None (no mask); another mask needs its own rule for which block pairs to skip")
    return mask


def pair_kind(q_piece, k_piece, mask) -> str:
    """Which part of a (query piece, key piece) pair a causal mask keeps: 'none', 'all' or 'some'.

    'none': every key is later than every query (skip the pair); 'all': no key is later than
    any query (no mask needed); 'some': the pair straddles the diagonal (mask inside).
    """
    if mask is None or k_piece[1] - 1 <= q_piece[0]:
        return "all"
    return "none" if k_piece[0] > q_piece[1] - 1 else "some"


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


class Ring:
    """This rank's place in the ring: neighbours (global ranks), every rank's pieces, the mask.

    q_local_len * c must be the full sequence length `seq_len` (when given): a ValueError
    otherwise, which is what a CP size that does not match the mesh's looks like.
    """

    def __init__(self, local_len: int, group=None, split: str = "zigzag", mask="causal", seq_len=None):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not one of {sorted(SPLITS)}")
        self.mask = check_mask(mask)
        initialised = dist.is_available() and dist.is_initialized()
        self.rank, self.c = (dist.get_rank(group), dist.get_world_size(group)) if initialised else (0, 1)
        s = local_len * self.c
        if seq_len is not None and seq_len != s:
            raise ValueError(f"this rank holds {local_len} positions and the CP group has {self.c} ranks, "
                             f"which makes {s}, not seq_len={seq_len}: shard the sequence over as many ranks as "
                             f"the CP group has (Mesh(world, cp={self.c}) takes {seq_len // self.c} per rank)")
        ranks = dist.get_process_group_ranks(group) if initialised else [0]
        self.send_to, self.recv_from = ranks[(self.rank + 1) % self.c], ranks[(self.rank - 1) % self.c]
        self.group, self.seq_len = group, s
        self.pieces = [SPLITS[split](s, self.c, r) for r in range(self.c)]
        self.work = [0] * self.c  # query x key pairs computed at each step (dense blocks)

    def holder(self, step: int) -> int:
        """Whose key/value block this rank holds at `step`."""
        return (self.rank - step) % self.c

    def pairs(self, step: int):
        """(q slice, k slice, q_pos or None, k_pos or None) for every pair of pieces that needs computing."""
        out = []
        for qp, qs in local_slices(self.pieces[self.rank]):
            for kp, ks in local_slices(self.pieces[self.holder(step)]):
                kind = pair_kind(qp, kp, self.mask)
                if kind != "none":
                    pos = (torch.arange(*qp), torch.arange(*kp)) if kind == "some" else (None, None)
                    out.append((qs, ks) + pos)
        return out

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0):
        """Start sending to the next rank and receiving from the previous one: the two requests."""
        return [dist.isend(send, self.send_to, group=self.group, tag=tag),
                dist.irecv(recv, self.recv_from, group=self.group, tag=tag)]


def ring_attention_forward(q, k, v, group=None, split: str = "zigzag", mask="causal", seq_len=None,
                           timeline=NullTimeline()):
    """This rank's rows of attention over the whole sequence, with k/v blocks passed around the ring.

    q, k, v [B, H, n, hd] are this rank's pieces (`take(x, SPLITS[split](s, c, rank))`), s = n*c.
    Returns (out [B, H, n, hd], lse [B, H, n]), equal to full attention's rows at this rank's
    positions. At each step, first start passing the block in hand on (`ring.exchange`), then
    compute on it pair by pair (`ring.pairs(step)`: skipped pairs left out, a causal mask only
    on pairs that straddle the diagonal), merging into (out, lse), then wait for the next block.
    Records spans 'F' (compute, mb=step) and 'recv' (issue to arrival) on `timeline`, and the
    work per step in ring.work; returns the Ring as a third value.
    """
    ring = Ring(q.shape[-2], group, split, mask, seq_len)
    ### BEGIN SOLUTION
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
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


def _ring_backward(q, k, v, out, lse, dout, ring: Ring):
    """dQ, dK, dV of ring attention: each k/v block goes round once more with its dK/dV."""
    scale = 1 / math.sqrt(q.shape[-1])
    delta = (dout * out).sum(-1)  # rowsum(dO * O) = rowsum(P * dP), the softmax's backward term
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dq, kv, dkv = torch.zeros_like(q), torch.stack([k, v]).contiguous(), torch.zeros(2, *k.shape, dtype=k.dtype)
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
    def forward(ctx, q, k, v, group, split, mask, seq_len, timeline):
        out, lse, ring = ring_attention_forward(q, k, v, group, split, mask, seq_len, timeline)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return *_ring_backward(q, k, v, out, lse, dout.contiguous(), ctx.ring), None, None, None, None, None


def ring_attention(q, k, v, group=None, split="zigzag", mask="causal", seq_len=None, timeline=NullTimeline()):
    """Differentiable ring attention: this rank's output rows [B, H, n, hd] (see ring_attention_forward)."""
    return RingAttention.apply(q, k, v, group, split, mask, seq_len, timeline)


def attention_work(s: int, c: int, split: str, mask="causal") -> list[int]:
    """Query x key pairs each rank computes in the ring (dense blocks), without any process."""
    mask, work = check_mask(mask), []
    for rank in range(c):
        pieces = [SPLITS[split](s, c, r) for r in range(c)]
        work.append(sum((qp[1] - qp[0]) * (kp[1] - kp[0]) for src in range(c) for qp in pieces[rank]
                        for kp in pieces[src] if pair_kind(qp, kp, mask) != "none"))
    return work


# ---------------------------------------------------------------------------------------
# The whole model with context parallelism


def rotate(x, rope, pos):
    """labkit.model.Rotary at global positions `pos` (a rank's pieces are not positions 0..n-1)."""
    cos, sin = rope.cos[pos].to(x.dtype), rope.sin[pos].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class ContextParallel(torch.nn.Module):
    """labkit.model.Transformer with every attention a ring over the mesh's CP group.

    forward(tokens, targets) takes the FULL batch [B, s] (the same on every CP rank), keeps this
    rank's positions (embedding, norms, MLP and head are per token: no communication) and
    returns this rank's share of the global mean loss: the shares sum to the model's loss.
    After backward, `allreduce_gradients()` sums the parameter gradients over the CP group.
    The parameters are the model's own. ValueError when the mesh has no cp axis.
    """

    def __init__(self, model, mesh, split: str = "zigzag"):
        super().__init__()
        if mesh.size("cp") < 2:
            raise ValueError(f"{mesh} has no cp axis of size >= 2: build it with Mesh(world, cp=c)")
        self.model, self.split, self.c = model, split, mesh.size("cp")
        self.group, self.index = mesh.group("cp"), mesh.index("cp")
        self.timeline = NullTimeline()

    def forward(self, tokens, targets):
        m, s = self.model, tokens.shape[1]
        pos = positions(SPLITS[self.split](s, self.c, self.index))
        x = self.blocks(m.tok_embeddings(tokens[:, pos]), pos, s)
        logits = m.output(m.norm(x))
        logits = logits if logits.dtype == torch.float64 else logits.float()  # as lm_loss; float64 stays
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, pos].flatten(), reduction="sum")
        return loss_sum / targets.numel()

    def blocks(self, x, pos, s: int):
        """The model's blocks on this rank's positions `pos` of an s-long sequence: x [B, n, d] -> [B, n, d]."""
        m = self.model
        for layer in m.layers:
            att, h = layer.attention, layer.attention_norm(x)
            B, n, D = h.shape
            heads = lambda t: t.view(B, n, att.n_heads, D // att.n_heads).transpose(1, 2)
            q, k = rotate(heads(att.wq(h)), m.rope, pos), rotate(heads(att.wk(h)), m.rope, pos)
            y = ring_attention(q, k, heads(att.wv(h)), self.group, self.split, "causal", s, self.timeline)
            x = x + att.wo(y.transpose(1, 2).reshape(B, n, D))
            x = x + layer.feed_forward(layer.ffn_norm(x))
        return x

    def allreduce_gradients(self):
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
