"""labkit: the helper package of the distributed-training lab.

- `launch`: run a function on N ranks (fork, or torchrun/Slurm/mpiexec), never hang silently.
- `%load_ext labkit` then `%%ranks N`: run a notebook cell on N ranks.
- `labkit.grading.impl(topic)`: your exercise module or the reference one.
- `labkit.Mesh` (`labkit.mesh.Mesh`): the one topology, an N-D device mesh (dp, pp, ep, cp, tp).
- `labkit.needs_exercise()`: a cell that needs an unwritten exercise prints one line and the notebook goes on.

The package is grouped by job: `launching/`, `comm/`, `links/`, `model/`, `data/`, `training/`,
`measure/`, `parallel/` (the core), and above it `grading/` and `apps/`. CONTRIBUTING.md maps every module.
"""
from labkit.comm import compat as _compat

_compat.install()  # torch.distributed ops an older torch lacks (torch 2.11 on a GPU node)

from labkit.launching.launcher import LaunchError, StubNotImplemented, launch, rank_device
from labkit.launching.magic import load_ipython_extension
from labkit.launching.notebook import install_cell_refresh, install_ipython_display, needs_exercise, not_yet
from labkit.mesh import Mesh
from labkit.renames import install as install_renames, package_getattr as __getattr__  # noqa: F401 - old names
from labkit.settings import quick

__all__ = ["launch", "LaunchError", "StubNotImplemented", "rank_device", "Mesh", "quick",
           "load_ipython_extension", "needs_exercise", "not_yet"]

install_ipython_display()  # in a notebook: launch errors read as their report, not labkit's frames
install_cell_refresh()  # in a notebook: every cell runs the exercise files as they are on disk


def _start_zygote_in_a_notebook() -> None:
    """In a notebook kernel, start the clean process ranks are born from now, while the learner reads.

    Not in the engines of a `%ranks` session (labkit/session/), which run an IPython shell too: they are
    ranks themselves and never launch, and each zygote costs seconds of CPU while the session starts.
    """
    import os
    import sys

    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    engine = os.environ.get("IPP_CONNECTION_INFO") or type(getattr(shell, "kernel", None)).__module__.startswith("ipyparallel")
    if shell is not None and not engine:
        from labkit.launching import zygote

        zygote.start_soon()


install_renames()  # for one release: `import labkit.train_loop` names labkit.training.loop (labkit/renames.py)
_start_zygote_in_a_notebook()
