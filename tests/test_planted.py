"""labkit.grading.planted: each catalogued mistake plants, in its own exercise's solution blocks only (no process)."""
import pytest

from labkit.grading.planted import MISTAKES, REPO, plant

SOURCE = '''def a(x, group=None):
    """group=group in a docstring stays."""
    ### BEGIN SOLUTION
    dist.all_reduce(x, group=group)
    ### END SOLUTION


def b(x, group=None):
    ### BEGIN SOLUTION
    dist.all_reduce(x, group=group)
    ### END SOLUTION
'''


def test_plant_replaces_inside_the_named_exercises_blocks_only():
    text, count = plant(SOURCE, "b", "group=group", "group=None")
    assert count == 1
    assert text == SOURCE.replace("dist.all_reduce(x, group=group)\n    ### END SOLUTION\n",
                                  "dist.all_reduce(x, group=None)\n    ### END SOLUTION\n").replace(
        "group=None)\n    ### END SOLUTION\n\n\ndef b", "group=group)\n    ### END SOLUTION\n\n\ndef b")
    with pytest.raises(ValueError, match="not in the solution blocks of a"):
        plant(SOURCE, "a", "info.rank", "dist.get_rank()")


@pytest.mark.parametrize("topic,exercise,cls,old,new", MISTAKES, ids=[f"{t}.{e}:{c}:{o}" for t, e, c, o, _ in MISTAKES])
def test_every_catalogued_mistake_still_plants_in_the_reference(topic, exercise, cls, old, new):
    text, count = plant((REPO / "solutions" / f"{topic}.py").read_text(), exercise, old, new)
    assert count >= 1 and new in text
