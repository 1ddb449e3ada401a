"""Past one machine by simulation: a layout's memory, traffic and time at 8 to 1,024 GPUs (notebook 15).

    from labkit.scale.cluster import load_cluster
    from labkit.scale.specs import LLAMA3
    from labkit.scale.layout import Layout
    from labkit.scale.cost import predict
    p = predict(LLAMA3["8b"], Layout(dp=8, zero="zero3", recompute="selective-op"),
                load_cluster("h100-sxm"), global_batch=16, seq_len=8192)
    p.tokens_per_s_per_gpu, p.mfu, p.peak_bytes

Modules, one job each:
    cluster    the described GPUs and links (clusters/*.json, units checked)
    specs      Llama-3 and Megatron GPT model shapes, parameter counts, FLOPs per token, recompute policies
    layout     a layout (dp, pp, ep, cp, tp, ZeRO stage, recompute, micro-batches; HSDP's replicas,
               the CP method, EP's overlap), its checks, which link level each axis's group uses
    footprint  peak memory per GPU (labkit.measure.memory's ZeRO formulas + activations)
    reserve    what a GPU holds beyond those tensors (allocator.json, sourced): the cuBLAS workspace in its
               allocator segment, the CUDA context, NCCL's buffers; a layout fits with it
    traffic    bytes per axis per step, closed forms, and their alpha-beta time
    zero_calls how many gathers and reduce-scatters each ZeRO stage runs per step (per micro-batch or once)
    cost       step time = compute + exposed traffic + bubble -> tokens/s/GPU, MFU; efficiency=None:
               built up from kernels (gpu, kernels, pace, layer_ops, collectives, pipeline, cost_kernels:
               every op by a roofline with cited figures, one overlap rule per mechanism, pipelines
               through labkit.parallel.schedules' simulator)
    published  torchtitan's published Llama 3.1 H100 runs, and our predictions of them
    figures    notebook 15's figures, each from the model's own numbers (validation, a step by part, the search's landscape)
    validation the validation set (published_runs.json: torchtitan, Megatron-LM, Llama 3) and its errors
    ranking    where each published layout ranks in the search over its own space, and why (pruned by
               bounds: lower bounds on a group of layouts' step), as a configuration and as a parallel layout at
               its best; cost.ranked: the search's order, ties by memory
    misses     why a published layout misses the criterion: a choice inside its layout, or the layout itself
    simulate   one rank of a large world on fake tensors and the fake process group: the
               place where a composed parallel step plugs in (`measure_step`)
"""
