"""Applications: the layer above labkit's core and the solutions.

Modules here run the lab's exercises (through the `labkit.grading.impl` switch) to train or to
draw: ``python -m labkit.apps.train`` (the training entry point) and
``python -m labkit.apps.collective_figures`` (the figures in imgs/). labkit's core (launch, mesh,
schedules, timeline, viz, model, data, ...) never imports this package, the solutions or the
exercises; `tests/test_layers.py` checks that with `ast`.
"""
