"""Every parallelism in one training run (notebook 14): dp, pp, ep, cp and tp on one `labkit.mesh.Mesh`.

Above the core, like `labkit.grading` and `labkit.apps`: the composed model runs the learner's own
pieces through ``impl()`` (the TP layers, Megatron-SP, ring attention, the EP all-to-all, the 1F1B
executor, ZeRO-1, HSDP's hsdp_sync), so the solutions or the exercises do the work.

    dims      ParallelDims: the layout (sizes, ZeRO stage, micro-batches, ep folded over dp / dp x cp /
              dp x cp x tp, HSDP's replicas x shards), every bad input refused before any process work,
              and the Mesh it builds; labkit's own placement rule (summed_axes)
    model     parallelize(model, mesh=, dims=): this rank's pipeline stage, TP+SP, CP, EP applied
    step      ComposedOptimizer (gradient groups from the learner's placement table, plain AdamW
              or ZeRO-1/2/3 per group, HSDP across replicas by the learner's hsdp_sync) and train_step (one 1F1B step, the global loss on every rank)
    state     the proof's tools: every parameter gathered back to its unsharded shape
    divergence  where a composed step first parts from one process: activation, gradient or weight,
              its module and mesh axis, by how much
    dcp       resharding checkpoints with torch.distributed.checkpoint
    matrix    the proof matrix: every layout tests/test_compose.py proves, counted by notebook 14
"""
