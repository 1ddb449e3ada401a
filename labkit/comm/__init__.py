"""The one communication layer: every torch.distributed op the lab calls, seen in one place.

- `labkit.comm.ops`: the table of ops, each with its payload S and bus factor (nccl-tests).
- `labkit.comm.intercept`: `with intercept(hook):` runs hooks around every table op.
- `labkit.comm.traffic`: `with count_traffic() as traffic:` counts calls and bytes per op and group.
- `labkit.comm.bypass`: finds ops bound at import (which no interception can see), from the source.
- `labkit.comm.checks`: argument checks and group facts shared by the collectives written from send/recv.
- `labkit.comm.unwaited`: irecv requests never waited for (the grading hint "a received tensor used before its wait()?").

`labkit.links.shaper.SlowLink`, `labkit.grading.diagnose.watch_groups` and the figure recorder of
`labkit.apps.collective_figures` are hooks of `intercept`. The rule that makes this work:
code calls ``dist.<op>(...)`` at call time, never an op bound at import.
"""
