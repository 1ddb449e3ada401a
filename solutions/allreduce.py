"""All-reduce by hand: through a master, and around a ring (notebook 03_allreduce).

All-reduce: every rank starts with a tensor of the same size; afterwards every
rank holds the elementwise SUM over the ranks. Both functions here sum in place
and return the tensor, like `dist.all_reduce(tensor)` followed by `return tensor`.

- `naive_allreduce`: everyone sends to group rank 0, which adds and sends the
  result back. Rank 0 receives (N-1) x S bytes and sends (N-1) x S: its link is
  the bottleneck and the time grows with N.
- `ring_allreduce`: the ranks form a ring (r sends to r+1, receives from r-1)
  and the tensor is cut into N chunks. N-1 steps of reduce-scatter, then N-1
  steps of all-gather; at every step each rank sends one chunk (S/N bytes) and
  receives one. Every rank sends 2(N-1)/N x S in total, which hardly grows with
  N: time ~ 2(N-1)/N x S / B for link bandwidth B.

Inputs the ranks disagree on (sizes, dtypes, a device the backend cannot use)
raise ValueError on every rank (`check_tensors`), instead of hanging.
"""
import torch
import torch.distributed as dist

from labkit.comm.checks import check_tensors, group_info

NOTEBOOK = "03_allreduce"


def chunk_bounds(numel: int, world_size: int) -> list:
    """Where the ring cuts a flat tensor: chunk i is [bounds[i], bounds[i+1]).

    Chunk sizes differ by at most one element, the first chunks being the
    larger ones (as torch.tensor_split); when numel < world_size the last
    chunks are empty. Every rank computes the same bounds.
    """
    base, extra = divmod(numel, world_size)
    bounds = [0]
    for i in range(world_size):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def send_recv(send, dst, recv, src, group=None):
    """Send `send` to group rank `dst` while receiving `recv` from group rank `src`.

    Both messages are posted at once (isend + irecv) and both awaited, so the
    outgoing and incoming transfers overlap: a ring step costs one transfer
    time, not two, and nobody waits for its neighbour to finish sending first.
    Empty tensors are skipped (every rank knows the same chunk sizes).
    """
    works = []
    if send.numel():
        works.append(dist.isend(send, group_dst=dst, group=group))
    if recv.numel():
        works.append(dist.irecv(recv, group_src=src, group=group))
    for work in works:
        work.wait()


def naive_allreduce(tensor, group=None):
    """Sum `tensor` over the ranks of `group`, in place, through group rank 0; return it.

    Rank 0 receives every other rank's tensor, adds them, and sends the sum
    back to each. Works for any shape (non-contiguous included), dtype and
    world size.
    """
    info = group_info(group)
    if info is None:
        return tensor
    check_tensors("naive_allreduce", tensor, group)
    ### BEGIN SOLUTION
    if info.size == 1 or tensor.numel() == 0:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    if info.rank == 0:
        incoming = torch.empty_like(work)
        for peer in range(1, info.size):  # one at a time: the root's link carries (N-1) x S in
            dist.recv(incoming, group_src=peer, group=group)
            work += incoming
        sends = [dist.isend(work, group_dst=peer, group=group) for peer in range(1, info.size)]
        for send in sends:  # ... and (N-1) x S out
            send.wait()
    else:
        dist.send(work, group_dst=0, group=group)
        dist.recv(work, group_src=0, group=group)
    if work is not tensor:
        tensor.copy_(work)
    ### END SOLUTION
    return tensor


def ring_allreduce(tensor, group=None):
    """Sum `tensor` over the ranks of `group`, in place, around a ring; return it.

    Rank r sends to r+1 and receives from r-1 (mod N). The flattened tensor is
    cut into N chunks with `chunk_bounds`, then:
    1. reduce-scatter, N-1 steps: at step s rank r sends chunk r-s and adds
       the incoming chunk r-s-1 into its own. Afterwards rank r holds the
       complete sum of chunk r+1.
    2. all-gather, N-1 steps: at step s rank r sends chunk r+1-s (complete)
       and overwrites its chunk r-s with the incoming complete one.
    Each step uses `send_recv` (send and receive overlapped). Works for any
    numel (not a multiple of N, smaller than N, zero), any world size, any
    dtype with +; a non-contiguous tensor is summed in a contiguous copy that
    is then copied back.
    """
    info = group_info(group)
    if info is None:
        return tensor
    check_tensors("ring_allreduce", tensor, group)
    ### BEGIN SOLUTION
    n, r = info.size, info.rank
    if n == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    bounds = chunk_bounds(flat.numel(), n)

    def chunk(i):
        i %= n
        return flat[bounds[i]:bounds[i + 1]]

    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty(bounds[1] - bounds[0], dtype=flat.dtype, device=flat.device)  # chunk 0 is the largest

    # 1. reduce-scatter: each chunk travels around the ring collecting one addend per rank.
    for step in range(n - 1):
        mine = chunk(r - step - 1)
        buffer = incoming[:mine.numel()]
        send_recv(chunk(r - step), right, buffer, left, group)
        mine += buffer
    # 2. all-gather: each complete chunk travels around the ring, overwriting the partial sums.
    for step in range(n - 1):
        send_recv(chunk(r + 1 - step), right, chunk(r - step), left, group)

    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    ### END SOLUTION
    return tensor


# --- Going further (optional exercises): same contract, other schedules.

def pipelined_ring_allreduce(tensor, group=None, segment_bytes=1 << 20):
    """`ring_allreduce`, with each chunk cut into segments of about `segment_bytes`.

    At every reduce-scatter step all segments are posted at once, and segment k
    is added as soon as it arrives, while segments k+1... are still on the wire:
    the additions hide behind the transfers (what gloo and NCCL do). Same
    results and edge cases as `ring_allreduce`.
    """
    info = group_info(group)
    if info is None:
        return tensor
    check_tensors("pipelined_ring_allreduce", tensor, group)
    ### BEGIN SOLUTION
    n, r = info.size, info.rank
    if n == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    step = max(1, segment_bytes // flat.element_size())

    def segments(t):
        return [t[i:i + step] for i in range(0, t.numel(), step)]

    def chunk(i):
        i %= n
        return flat[bounds[i]:bounds[i + 1]]

    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty(bounds[1] - bounds[0], dtype=flat.dtype, device=flat.device)
    for s in range(n - 1):  # reduce-scatter
        mine = chunk(r - s - 1)
        sends = [dist.isend(seg, group_dst=right, group=group) for seg in segments(chunk(r - s))]
        buffers = segments(incoming[:mine.numel()])
        recvs = [dist.irecv(buf, group_src=left, group=group) for buf in buffers]
        for work, buf, target in zip(recvs, buffers, segments(mine)):
            work.wait()
            target += buf  # while the next segments are still arriving
        for work in sends:
            work.wait()
    for s in range(n - 1):  # all-gather: nothing to add, plain overlapped copies
        works = [dist.isend(seg, group_dst=right, group=group) for seg in segments(chunk(r + 1 - s))]
        works += [dist.irecv(seg, group_src=left, group=group) for seg in segments(chunk(r - s))]
        for work in works:
            work.wait()
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    ### END SOLUTION
    return tensor


def tree_allreduce(tensor, group=None):
    """Sum `tensor` over the ranks of `group`, in place, along a binomial tree; return it.

    Reduce up the tree in ceil(log2 N) rounds (in round k, rank r with bit k set
    sends its partial sum to r - 2^k and drops out), then broadcast the total
    back down the same tree. 2 log2 N messages of the whole tensor instead of
    the ring's 2(N-1) of S/N: fewer latencies, more bytes. The schedule for
    small tensors. Any world size.
    """
    info = group_info(group)
    if info is None:
        return tensor
    check_tensors("tree_allreduce", tensor, group)
    ### BEGIN SOLUTION
    n, r = info.size, info.rank
    if n == 1 or tensor.numel() == 0:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    incoming = torch.empty_like(work)
    distance = 1
    while distance < n:  # reduce: partial sums flow towards rank 0
        if r % (2 * distance) == distance:
            dist.send(work, group_dst=r - distance, group=group)
            break
        if r % (2 * distance) == 0 and r + distance < n:
            dist.recv(incoming, group_src=r + distance, group=group)
            work += incoming
        distance *= 2
    distance = 1 << (n - 1).bit_length()
    while distance > 1:  # broadcast: the same tree, in reverse
        distance //= 2
        if r % (2 * distance) == 0 and r + distance < n:
            dist.send(work, group_dst=r + distance, group=group)
        elif r % (2 * distance) == distance:
            dist.recv(work, group_src=r - distance, group=group)
    if work is not tensor:
        tensor.copy_(work)
    ### END SOLUTION
    return tensor
