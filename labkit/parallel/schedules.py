"""Pipeline schedules as data: parse, lower, check and simulate them without any process.

A schedule is a list of action lists, one per rank, in PyTorch's notation:
``"{stage}F{mb}"`` runs the forward of micro-batch ``mb`` on ``stage``, ``"{stage}B{mb}"``
its backward and, in zero-bubble schedules, ``"{stage}W{mb}"`` its weight gradient (then
B computes only the input gradient). With 4 stages and 4 micro-batches, rank 1's 1F1B
list is ``["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1B2", "1B3"]``.

`lower` is the ONE place where the communication model lives. As in
``torch.distributed.pipelining`` (``_add_send_recv``) it turns that compute schedule into
what each rank runs: the compute actions with explicit messages around them,

    F on stage s:  s RECV_F mb  (from the rank of s-1, unless s = 0)   s F mb   s SEND_F mb (to s+1's rank, unless last)
    B on stage s:  s RECV_B mb  (from the rank of s+1, unless last)    s B mb   s SEND_B mb (to s-1's rank, unless s = 0)
    W on stage s:  s W mb       (no message)

Every consumer reads that same `Lowered` list: `simulate` (unit-time model, deadlock
check, peak in-flight activations), `validate`, the drawing (`labkit.measure.viz.plot_schedule`)
and the executor (``impl("pipeline").run_schedule``). So what is checked and drawn is
what runs. (torch places each receive by simulating its peer; here a receive sits just
before the compute that needs it, the simplest order that is still deadlock-free with
non-blocking sends for every valid schedule.)

Messages are matched by (kind, sender's stage, micro-batch) (`Action.message`, and its
integer `Action.tag` on real ranks), not by arrival order. ``blocking_send=False`` (isend):
a send never waits. ``blocking_send=True`` (plain gloo ``send``, a rendezvous even for one
element): a send waits until the receiver posts the matching receive.

Errors: `check_schedule` raises `ScheduleError` (a ValueError) naming the rank and the
first wrong action (its ``rank`` / ``index`` attributes locate it); `simulate` raises
`DeadlockError` naming what every stuck rank waits on, or, with ``strict=False``, returns
what ran up to the first error so that a wrong schedule can still be drawn.

Where the parts live (every name below is importable from here too): the actions, their checks and
the lowering in `labkit.parallel.schedule_actions`; the simulation and the bubble's closed forms in
`labkit.parallel.schedule_sim`; interleaved 1F1B and the zero-bubble example in
`labkit.parallel.schedule_variants`.
"""
from labkit.parallel.schedule_actions import (COMPUTE, RECVS, SENDS, Action, DeadlockError,  # noqa: F401 - public here
                                              Lowered, ScheduleError, check_schedule, first_difference,
                                              format_schedule, is_v_placement, lower, parse_action, parse_schedule,
                                              stage_ranks)
from labkit.parallel.schedule_sim import (SimResult, ideal_bubble, peak_inflight, simulate,  # noqa: F401 - public here
                                          theoretical_bubble, validate)
from labkit.parallel.schedule_variants import interleaved_schedule, zero_bubble_schedule  # noqa: F401 - public here
