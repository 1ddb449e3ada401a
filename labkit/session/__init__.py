"""A session of persistent ranks: ``%ranks start N`` keeps N engines (ipyparallel) alive across cells.

- `labkit.session.engines`: the ipyparallel cluster (controller and engines; local engines forked by the zygote), started,
  waited for with a deadline, stopped, killed;
- `labkit.session.engine_side`: what runs inside each engine: joining the process group, running a
  cell in the engine's own namespace, the reload rule before each cell;
- `labkit.session.watch`: waiting for a cell on the ranks, and never silently: a hang, a dead
  engine, an interrupt;
- `labkit.session.lifeline`: one connection from each engine to the kernel, how an engine on another
  machine is watched (its stack, its death) and ends with the session;
- `labkit.session.report`: what the ranks printed, grouped by rank, and a failed cell told at the
  learner's line;
- `labkit.session.session`: the `Session` (start, run, stop, restart) and the ``%ranks`` line magic.
"""
