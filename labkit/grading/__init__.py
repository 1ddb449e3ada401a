"""Grading support, above labkit's core: the switch between the learner's code and the reference.

    from labkit.grading import impl
    allreduce = impl("allreduce")          # exercises.allreduce or solutions.allreduce

- `switch`: `impl(topic)`, `current_impl()` (LABKIT_IMPL=exercises|solutions), edits reloaded;
- `registry`: the exercises, read from the `### BEGIN SOLUTION` blocks of solutions/;
- `cases`: many grading cases in one launch, one wrong exercise costs only its own cases;
- `diagnose`: the first wrong place (rank tags, first differing parameter, wrong groups);
- `stubgen`: `python -m labkit.grading.stubgen` writes exercises/ from solutions/;
- `plugin`: the pytest plugin (`--impl`, `--grade`).
"""
from labkit.grading.switch import REPO_ROOT, current_impl, impl, refresh_changed
from labkit.launching import zygote as _zygote

# Ranks of a caller that grades import these: the zygote imports them once instead (the core names no grading module).
_zygote.PRELOAD_IF_CALLER_HAS += ("labkit.grading", "labkit.grading.cases", "labkit.grading.diagnose")

__all__ = ["REPO_ROOT", "current_impl", "impl", "refresh_changed"]
