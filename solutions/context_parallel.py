"""Context parallelism: the sequence split over a CP group, and the model run on it (notebook 11_long_sequences).

Each of the c ranks of a context-parallel (CP) group holds some pieces of the sequence. How
the sequence is split decides the work per rank under a causal mask:
    contiguous_split  rank r takes block r of c: rank c-1 attends to everything, rank 0 to one block
    zigzag_split      2c chunks, rank r takes chunks r and 2c-1-r: the same causal work on every rank
A split is a list of (start, stop) pieces per rank; `take` cuts them out of a full tensor,
`pair_kind` says which (query piece, key piece) pairs a causal mask keeps, and
`attention_work` counts the pairs each rank computes, without any process.

`ContextParallel` runs labkit's model with every attention a ring (ring_attention.py, reached through
``impl("ring_attention")``: exercises use exercises.ring_attention) over the mesh's cp axis.
"""
import torch
import torch.distributed as dist

from labkit.grading import impl
from labkit.measure.timeline import Timeline, or_null
from labkit.mesh import Mesh
from labkit.parallel.flat import flatten, write_back
from labkit.renames import renamed_in, renamed_method

NOTEBOOK = "11_long_sequences"


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


def attention_work(s: int, c: int, split: str, mask="causal") -> list[int]:
    """Query x key pairs each rank computes in the ring (dense blocks), without any process."""
    mask, work = check_mask(mask), []
    pieces = [SPLITS[split](s, c, r) for r in range(c)]
    for rank in range(c):
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
    After backward, `sync_gradients()` sums the parameter gradients over the CP group.
    The parameters are the model's own. ValueError when the mesh has no cp axis.
    `timeline`: a labkit Timeline that the ring attention records its spans into.
    """
    allreduce_gradients = renamed_method("ContextParallel.allreduce_gradients")  # an old name, for one release (labkit/renames.py)

    def __init__(self, model, *, mesh: Mesh, split: str = "zigzag", timeline: Timeline | None = None):
        super().__init__()
        if mesh.size("cp") < 2:
            raise ValueError(f"{mesh} has no cp axis of size >= 2: build it with Mesh(world, cp=c)")
        self.model, self.split, self.c, self.mesh = model, split, mesh.size("cp"), mesh
        self.group, self.index = mesh.group("cp"), mesh.coord("cp")
        self.timeline = or_null(timeline)

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
        ring = impl("ring_attention").ring_attention  # yours under exercises; no import between the two modules
        m = self.model
        for layer in m.layers:
            att, h = layer.attention, layer.attention_norm(x)
            B, n, D = h.shape
            heads = lambda t: t.view(B, n, att.n_heads, D // att.n_heads).transpose(1, 2)
            q, k = rotate(heads(att.wq(h)), m.rope, pos), rotate(heads(att.wk(h)), m.rope, pos)
            y = ring(q, k, heads(att.wv(h)), mesh=self.mesh, split=self.split, mask="causal", seq_len=s,
                     timeline=self.timeline)
            x = x + att.wo(y.transpose(1, 2).reshape(B, n, D))
            x = x + layer.feed_forward(layer.ffn_norm(x))
        return x

    def sync_gradients(self) -> None:
        """Sum every parameter's gradient over the CP group, in place (collective over the group).

        ONE all-reduce of the gradients flattened (labkit.parallel.flat): one per parameter would
        pay a collective's latency 57 times for the seed model (measured here: 58 ms against 14)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if params:
            flat = flatten([p.grad for p in params])
            dist.all_reduce(flat, group=self.group)
            write_back(flat, [p.grad for p in params])


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
