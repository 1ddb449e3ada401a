"""The given pieces of context parallelism's other methods (notebook 11, section 8; solutions/cp_methods.py).

solutions/cp_methods.py holds the methods as the learner calls them (`allgather_attention`, `ulysses_attention`,
`hybrid_attention`) and the exercise, Ulysses' two all-to-alls (`seq_to_heads`, `heads_to_seq`). What they are
built from and no learner writes lives here, in the core:

    check_heads          an all-to-all over heads needs the ranks to divide the heads (ValueError naming the fix)
    GatherKV             K and V all-gathered over cp (one all_gather_single), backward one reduce-scatter of
                         dK, dV: Llama 3's all-gather method (arXiv 2407.21783, section 3.3.2)
    attend_at_positions  softmax attention with the causal mask read from global positions
    CPLevels             the cp axis as a cluster's two levels: groups of `local` cp ranks (a node) and a ring
                         across them (Megatron/TransformerEngine's cp_comm_type "a2a+p2p")
    NodeRing             ring attention across those nodes on blocks at arbitrary positions; the block
                         attention and the log-sum-exp merge are the learner's (notebook 11's ring_attention
                         module, passed in: the core never reaches the exercises)

Bytes per call are in solutions/cp_methods.py's docstring and `labkit.scale.cp_traffic.cp_attention_bytes`.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.mesh import Mesh


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def check_heads(heads: int, ranks: int, what: str) -> None:
    """ValueError unless `ranks` divides `heads`: an all-to-all over heads gives every rank the same number."""
    if heads % ranks:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"{what}: {heads} heads (per tp rank) do not split over {ranks} ranks: the all-to-all gives "
                         f"each rank heads/{ranks} whole heads; use a cp (or local) size among {ok}, or "
                         "cp_method='ring' / 'allgather', which have no such constraint")


class GatherKV(torch.autograd.Function):
    """[2, ...] (K, V stacked) -> [c, 2, ...] in group-rank order by one all-gather; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, kv, group):
        ctx.group, c = group, _world(group)
        out = torch.empty((c * kv.shape[0],) + kv.shape[1:], dtype=kv.dtype, device=kv.device)
        dist.all_gather_single(out, kv.contiguous(), group=group)  # concatenated along dim 0
        return out.view((c,) + kv.shape)

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(out, grad.flatten(0, 1).contiguous(), group=ctx.group)  # every rank's dK, dV of my pieces
        return out, None


def attend_at_positions(q, k, v, q_pos, k_pos, mask):
    """Softmax attention of q over k, v with key j hidden from query i when k_pos[j] > q_pos[i] (causal)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos[None, :] <= q_pos[:, None])


class CPLevels:
    """The cp axis as a cluster's two levels: groups of `local` consecutive cp ranks (a node), and a ring across.

    Collective over the WHOLE world (``dist.new_group``): every rank builds it with the same arguments, once,
    before any attention (``labkit.compose`` does it when it builds the stage). Cp index i sits on node
    i // local at local index i % local: ``local_group`` holds this rank's node (the all-to-all), ``node_group``
    the ranks with its local index on every node (the ring; `exchange` sends to the next node's and receives
    from the previous node's, GLOBAL ranks). ValueError unless `local` divides cp.
    """

    def __init__(self, mesh: Mesh, *, local: int):
        c = mesh.size("cp")
        if isinstance(local, bool) or not isinstance(local, int) or local < 1 or c % local:
            raise ValueError(f"local={local!r} does not divide cp={c}: the all-to-all runs inside groups of `local` "
                             f"cp ranks (a node) and the ring across the cp/local groups; choose local among "
                             f"{[d for d in range(1, c + 1) if c % d == 0]}")
        self.mesh, self.local, self.nodes = mesh, local, c // local
        index = mesh.coord("cp")
        self.node_index, self.local_index = divmod(index, local)
        self.local_group = self.node_group = None
        for ranks in mesh.all_ranks("cp"):  # the same order on every rank: dist.new_group is collective
            for node in range(self.nodes):
                group = dist.new_group(ranks[node * local:(node + 1) * local])
                if mesh.rank in ranks[node * local:(node + 1) * local]:
                    self.local_group = group
            for i in range(local):
                group = dist.new_group(ranks[i::local])
                if mesh.rank in ranks[i::local]:
                    self.node_group = group
        mine = mesh.ranks("cp")
        self.next_rank = mine[((self.node_index + 1) % self.nodes) * local + self.local_index]
        self.prev_rank = mine[((self.node_index - 1) % self.nodes) * local + self.local_index]

    def exchange(self, send, recv, tag: int = 0):
        """Start sending to the next node's rank and receiving from the previous node's: the two requests."""
        return [dist.isend(send, self.next_rank, group=self.node_group, tag=tag),
                dist.irecv(recv, self.prev_rank, group=self.node_group, tag=tag)]


class NodeRing(torch.autograd.Function):
    """Ring attention across nodes on blocks at arbitrary positions (each node's gathered pieces).

    ``NodeRing.apply(q, k, v, levels, pos, mask, ring)``; `ring`: the learner's ring_attention module (its
    `block_attention` and `merge_partials`). Forward: the K, V block in hand is passed on while this rank
    attends to it; partials merged by their log-sum-exp. Backward: a second trip in which dK, dV travel with
    their block (as ring_attention's backward does) and come home after `nodes` steps."""

    @staticmethod
    def forward(ctx, q, k, v, levels, pos, mask, ring):
        ra, o, me = ring, levels.nodes, levels.node_index
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(o):
            if step < o - 1:
                incoming = torch.empty_like(kv)
                requests = levels.exchange(kv, incoming)
            held = pos[(me - step) % o]
            part = ra.block_attention(q, kv[0], kv[1], *((pos[me], held) if mask else ()))
            out, lse = ra.merge_partials(out, lse, *part)
            if step < o - 1:
                for request in requests:
                    request.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.levels, ctx.pos, ctx.mask = levels, pos, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        levels, pos, o, me = ctx.levels, ctx.pos, ctx.levels.nodes, ctx.levels.node_index
        dout, scale = dout.contiguous(), 1 / math.sqrt(q.shape[-1])
        delta = (dout * out).sum(-1)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq, kv = torch.zeros_like(q), torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)
        for step in range(o):
            if step < o - 1:
                incoming = torch.empty_like(kv)
                requests = levels.exchange(kv, incoming)
            scores = q @ kv[0].transpose(-1, -2) * scale
            if ctx.mask:
                scores = scores.masked_fill(pos[(me - step) % o][None, :] > pos[me][:, None], float("-inf"))
            p = torch.exp(scores - safe[..., None])
            dkv[1] += p.transpose(-1, -2) @ dout
            ds = p * (dout @ kv[1].transpose(-1, -2) - delta[..., None]) * scale
            dq += ds @ kv[0]
            dkv[0] += ds.transpose(-1, -2) @ q
            arrived = torch.empty_like(dkv)
            for request in levels.exchange(dkv, arrived, tag=1):
                request.wait()
            dkv = arrived
            if step < o - 1:
                for request in requests:
                    request.wait()
                kv = incoming
        return dq, dkv[0], dkv[1], None, None, None, None
