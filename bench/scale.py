"""The cost model against published training runs: the validation set (notebook 15).

    python bench/scale.py [--quick] [--model flat|kernels|both] [--small] [--ranks] [--picks] [--memory]

What it does. From each run's published setup only (model, layout, batch, sequence, recompute, GPU and network)
it predicts the throughput per GPU and the peak memory of every row of labkit/scale/published_runs.json:
torchtitan's two H100 benchmark files (Dec 2024; async TP, June 2025), Megatron-LM 2021 Tables 1 and 2 (Table 2:
PTD against DeepSpeed's ZeRO-3, 175B and 530B on 384-2,240 A100s), Megatron-LM 2022's MFU table and Llama 3's
Table 4. Each set states in the file how every unpublished input was chosen ("choices"), before predicting; the
rows validate, nothing is fitted to them (labkit.scale.validation).

What it prints. One line per row: its throughput and memory error (predicted / published - 1) and whether the model
says it fits; a summary per set; each row outside 25% with its note from the data file (what was checked, and why
the miss stays); as its last line one JSON object: per set and overall, n, rows within 25%, the median and worst
|throughput error|, the worst |memory error|. Under the kernel model, before the JSON: float8's gain over the same
run in bf16, and async TP's over the same run without it, measured and predicted, for each row whose set holds that
twin (labkit.scale.validation.gains: the two rows share their clock, network and framework, which cancel in the
ratio, so it checks the one mechanism alone; in the JSON as "float8_gains" and "async_tp_gains"). No process, no
GPU: arithmetic, a few seconds (without --ranks).

Flags
    --model   the flat model (compute at a fixed fraction of the peak, labkit.scale.cost.predict's default), the
              kernel model (every op by a roofline from kernel-level figures, `predict(..., efficiency=None)`), or
              both, one after the other (the default: issue 34's "before" and "after"), each set's summary in the
              JSON under its model's name.
    --small   also the lab's own models on one H200, measured by bench/single_device.py
              (/work/shared/gpu-2026-11-26/single_bf16.txt) and by bench/gpu_check.sh's predict row (2026-11-27),
              against the kernel model, with what bounds a block and the kernels of one step, modelled and profiled.
    --ranks   also where each published layout ranks in the search over its own space (labkit.scale.ranking: same
              model, cluster, global batch, sequence length and GPU count; 1F1B, interleaved x2, ZB under the
              kernel model, and the row's own schedule; ties within 0.5% go to the least memory), at two levels:
              the exact published configuration (issue 34's criterion as written: top 5, or within 5% of the top)
              and its parallel layout (dp, pp, cp, tp, schedule kind) at its best micro-batch, ZeRO stage,
              recompute, dp_replicate and cp_method (a weaker claim, printed beside the first, never instead of
              it); for each, the rank, the gap to the top and the seconds the row took; for each row that misses
              as a configuration, its class (labkit.scale.misses: a choice inside its layout, "config", or the
              layout itself, "layout"; "-memory" where the row's published memory, against the model's own error
              on it, says the faster configuration would not fit) with the numbers of both steps. Then the same
              ranks in each row's framework's space (labkit.scale.space, labkit/scale/frameworks.json: the options
              its code had, every layout run as that code ran it).
    --picks   the search's pick for issue 34's three questions (Llama 3 8B on 64 H100s, 70B on 256, 405B on
              1,024; a global batch of 512 x 8,192 tokens): labkit.scale.ranking.pick.
    --memory  also a memory table per row: published memory (torchtitan's peak reserved GiB; "ran": every other row
              ran on its GPUs, so it must fit), the predicted reserved memory (footprint's tensors + the cuBLAS
              workspace's allocator segment, labkit.scale.reserve) and its error, the whole reserve (+ CUDA
              context, NCCL's buffers), the peak plus the reserve against the GPU's memory, and whether it fits;
              a summary: rows within 15%, rows that ran but do not fit. Memory does not depend on the cost model
              (flat or kernels): printed once.
    --quick   accepted, and changes nothing, so that every bench takes the same flags.

The kernel model's inputs, each fixed from its source before the rows were predicted again
    hardware  from the cluster files, chosen from the source's own description of its machines, not from the
              rows: torchtitan's hosts run their H100s at 500 W (its 'Hardware' section), so h100-grand-teton
              uses the GPU kind h100-sxm-500w (FBGEMM's GEMM measured on an 'H100 500W', the FlashAttention
              tables scaled by the same clock ratio; its HBM2e at the 2.4 TB/s torchtitan's async TP file gives
              for these hosts, at the 0.92 of it torchao measured for pointwise kernels on them); Llama 3's run
              at 700 W (h100-sxm); every kind's eager cost per kernel is one measured profile (sam2 issue #768).
    async TP  labkit.scale.async_tp's decomposition: each TP collective in tp chunks behind its matmuls, the
              chunks' GEMMs timed like every GEMM (no constant of its own).
    float8    each table's recipe (tensorwise, torchao's default, or rowwise where the table says so), rowwise
              with FBGEMM's measured rowwise GEMM (1125.51 TFLOP/s at 8192^3 on an 'H100 500W'); torchao's
              own count of each recipe's cast bytes and kernels, the rowwise casts at the rate torchao's
              measured rowwise table leaves them (labkit.scale.float8: LayerNorm -> Linear -> Sigmoid on a 6^3
              grid of M, K, N, the model's own GEMMs and neighbours taken out).
    TP        collectives per block by recompute policy (labkit.scale.traffic.tp_collectives): torchtitan's op
              policy saves reduce-scatter outputs and not all-gathers (its save list), so its backward
              all-gathers twice more.

History of the kernel model's validation (rows within 25%, median and worst |error|; each change read in a source
before its effect was computed)
    on the first 47 rows   the op policy's TP all-gathers: 32 -> 33 within 25%, worst 72% -> 66%
    2026-11-27  Table 2's twelve rows (their choices stated in the file first): 10 of 12 (PTD +15% to +17%,
                ZeRO-3 +5% to +49%), flat 6 of 12; all 59 rows: 42, 17%, 66%
                the contention rule (GPU.overlap_slowdown): 43, 16%, 64%
                each collective kind at its own measured bus bandwidth against its size (the cluster's
                busbw_by_kind: on H100 nodes nccl-tests' reduce-scatter curve, 311-362 GB/s, for all-gathers
                and reduce-scatters, where the all-reduce's NVLink-SHARP 460 GB/s had priced them): 47, 15%, 54%
                GEMMs on the 700 W kinds at the sustained, power-saturated rate (GPU.msmf_tflops: 708.5 TFLOP/s
                measured on the H200, the H100's die at the same 700 W, where the burst MAMF is 841.9; the
                attention tables scaled by MSMF / MAMF alike): 49, 15%, 54% (Llama 3's rows +29% -> +11..+17%);
                flat 36 of 59
                the all-reduce's bus bandwidth against its size on A100 and H100/H200 nodes (nccl-tests' sweeps
                from 32 KiB to 16 GiB, stas00/ml-engineering; within a measured curve no latency is added), each
                NIC's measured figure across nodes (NCCL's maintainers: 24 GB/s per 200 Gb/s HDR NIC, 46 per
                400 Gb/s NDR NIC, where the line rate had been used), a group smaller than the node reading the
                node's curve at the size where its ring moves the same chunk per step (S x 8 / n): 49, 12%, 54%
                (Table 2's PTD rows +15..+17% -> +12..+15%); flat 33 of 59
                Megatron-LM's GPT blocks with the kernels its paper says it ran (sec. 4.2: bias + dropout + add
                fused; Apex's fused LayerNorm; learned positions, no rotary; specs.megatron_fusions): 49, 13%,
                54% (its runs without a pipeline -11..-2% -> -4..+8%, its pipelined ones +3..+16% -> +7..+21%)
                torch's ring attention's merges and send buffers (kernels.ring_merges, from torch's
                _context_parallel/_attention.py; the hybrid's ring across nodes pays them for its cp / cp_local
                steps): 50, 13%, 54% (torchtitan's CP rows 2-4 points lower)
                torchtitan's K/V heads repeated before its SDPA call, as its CP rows ran them
                (ModelSpec.kv_repeated): 52, 13%, 54%
                two facts of Megatron-LM 2021's code its rows had left at the lab's defaults: no sequence
                parallelism (Korthikanti et al. 2022 introduced it), and its local DDP's one all-reduce after the
                step's last backward (Layout.grad_reduce="after"; every plain-DP and ZeRO-1/2 reduction hides
                behind the last micro-batch's backward only): 52, 10.4%, 54% (its pipelined rows +7..+21% ->
                -1..+12%, those without a pipeline -4..+8% -> -14..-1%)
                FSDP2's copies around its collectives, read in torch's _fsdp_collectives.py (each all-gather's
                copy-out and each reduce-scatter's copy-in on the compute stream: 4 and 6 bytes per parameter,
                kernels.fsdp_copies), with ZeRO-3's calls counted as the footprint already assumed
                (zero_calls.zero3_calls: twice gathered and once reduced per micro-batch without a pipeline, once
                each a step inside one): 52, 9.9%, 53% (torchtitan's 8B FSDP rows 2-3 points lower)
    2026-11-28  async TP's closing sum of each decomposed reduce-scatter (torch's fused_matmul_reduce_scatter sums
                the stacked partials on the compute stream; async_tp.SCATTERS): 52, 9.9%, 50% (every async-TP
                row 2-4 points lower)
                torchtitan's CP rows as they ran: the ring's K/V by one all-gather that only its first step hides
                (9dec370's --experimental.context_parallel_rotate_method, default 'allgather'; Layout.kv_rotation):
                52, 9.9%, 50% (Table 6's CP 8 row, cp across nodes, +24.0% -> +21.5%; the rest unchanged)
                the rowwise float8 casts at the rate torchao's own rowwise table measured (pytorch/ao fdddb2cf,
                the table torchtitan issue #1207 read to explain these rows; labkit.scale.float8, read before
                computing its effect): 55, 8.9%, 43% (the four rowwise rows +22..+50% -> -9..+1%; no other row moved)
                the interleaved 405B row's micro-batches as torchtitan 9dec370 made them (n_microbatches = the
                pipeline degree when unset: 8 of 4; pp x stages per rank is 90567fc98's rule, January 2025): 56,
                8.9%, 43% (+32% -> +17%; its effect was known from the earlier count, the code decided)
                torchao's float8 TP, which torchtitan runs with tensorwise float8 (its all-gathers move float8,
                its reduce-scatters bf16: labkit.scale.float8.tp_gather_bytes): 56, 8.9%, 43% (the float8
                tensorwise rows on TP 0.5-11 points faster: the 8B async-TP file's +10%, +13% -> +20%, +22%;
                70B's -3%, -3% -> +3%, +1%); the float8 gains then agree on plain TP (8B +16.2% predicted, +16.0%
                measured; 70B +28.7%, +35.6%), and with async TP show its bf16 over-credit (+9.5%, +15.8%)
                DeepSpeed's ZeRO-3 of 2021 as its code runs (v0.3.13 with its defaults, labkit.scale.deepspeed_zero3:
                each weight's uses on the host, GPU and network clocks, a synchronize at every fetch, the weights
                its reuse distance frees between replay and backward gathered a third time, fp16 gradients where
                FSDP2's fp32 had been charged; an estimate from the same rules, made first, said 5 of 6): 57, 8.6%,
                29% (Table 2's ZeRO-3 rows +39, +13, +13, +43, +1, +3% -> +18, +3, -12, +27, -0, -7%); flat 33;
                the contention rule inside those clocks (where a use's kernels meet the network busy): 57, 8.6%,
                29% (+12, +1, -12, +25.4, -0, -7%). These six rows lean on one assumed input, the 10 us a ring
                step across nodes takes (a100-sxm.json): one collective per weight, about 1,500 a step of n - 1
                steps each; at 0, 5 and 20 us they lie at +17..+29%, +2..+27% and -32..+22%
                DeepSpeed's synchronize before each all-gather (v0.3.13's _allgather_param: no gather starts while
                the GPU runs the kernels launched before it): 59, 8.9%, 24% (Table 2's ZeRO-3 rows +12, +1, -12,
                -6, -19, -15%; at 0, 5 and 20 us per ring step -13..+23%, -16..+14%, -32..+7%)
                the backward's two TP reduce-scatters under async TP left to NCCL, as torch's micro-pipeline pass
                leaves a reduce-scatter whose input sums several matmuls' (async_tp.UNFUSED): 58, 8.5%, 25.4%
                (the 8B async-TP rows +29%, +22% -> +24%, +17%; async TP's gain over plain TP, measured against
                predicted, from 2.1-9.6 points off to 0.1-6.1)
                Megatron-LM 2021's Table 1 as its authors ran it, from their own script for that table
                (NVIDIA/Megatron-LM examples/sc21/run_table_1.sh, 6985e58): micro-batches of 16, 16, 16, 8, 4, 2, 2,
                1, 1, 1 where the rows held 1; torch's DDP (buckets during the backward) for 1.7B-18B where they
                held local DDP's reduction after it; interleaved pipelines of 3, 2, 2 and 3 stages per rank for
                76B, 145B, 310B and 530B where they held plain 1F1B. Inputs read in a source, not chosen: 59,
                10.4%, 24% (Table 1 -14..+12% -> +5..+16%, every row over-predicted, as Table 2's PTD rows; the
                median of all rows 8.9% -> 10.4%, over the aim's 10%); flat 34
                torchtitan 9dec370's loss eager beside its compiled blocks ('compiling loss function causes CUDA
                errors', e8977b0; the set's compiled_loss): 59, 10.0% (9.99), 24% (its compiled 8B rows 0.7-0.9
                points slower)
                torchtitan's third benchmark file, Trainy's 8B FSDP on 32 and 64 H200s (June 2025), a run the
                model was not built on, its inputs committed (389d132) before it was run; with torchao's float8
                all-gather under FSDP2 (float8.fsdp_gather_bytes, read before the run): +1.7% and +3.4% (memory
                +38%, +37%); the memory miss sent us to torchtitan's loss, compiled with the model in its code
                (4 bytes a logit, not 12): memory +5.5%, +3.8%, tok/s unchanged: 61, 9.9%, 24%; flat 34 of 61
                (the two rows -43%: float8 is outside it)
                Megatron-LM's vocabulary-parallel cross-entropy as its code runs it (mpu/cross_entropy.py: in place
                on fp32 logits, 38 and 14 bytes a logit, 6 held; kernels.ELEMENTWISE): 61, 9.8%, 24% (Table 1's
                1.7B-7.5B 0.2-0.9 points lower; the 59 earlier rows 10.0%)
                llm-foundry's large-scale H100 table (January 2024, 5e85bd62d: MPT 1B-70B, FSDP1 on 128-512 GPUs),
                18 rows the model was not built on, their inputs committed (884036e) before it was run on them
                (specs.MPT; Layout.zero3_unit "flat", FSDP1's gathers without copy-out): 14 of 18 within 25%,
                median 6% (7B-70B -1..+8%; 1B and 3B, FSDP1's SHARD_GRAD_OP, +21..+43%); all 79: 75, 9%, 43%
                a ring collective across nodes on one NIC per GPU of its group in each node (NCCL's channels, one per
                NIC; 'up to ~396GB/s with the RING protocol', nccl-tests #319; Cluster.link's per_node), never above
                the node's own; all-to-alls and sends on one NIC: 64 of 79, 14%, 104%. The one-NIC rate had hidden a
                compute side that runs ahead on every multi-node FSDP row: torchtitan's 8B on 128 GPUs +1..+4% ->
                +13..+14% (its 8-GPU rows, with no network, +8..+10% before and after), Trainy's H200 rows +2/+3% ->
                +15/+17%, MPT's 7B +28..+38%, DeepSpeed's ZeRO-3 rows (their step built on the one-NIC rate)
                +59..+104%; rows without a data-parallel ring across nodes (TP 8 inside nodes) unchanged. Evidence
                for the rails outside the set: MosaicML's older table runs its 13B (FSDP, micro-batch 2) on 64 GPUs
                as fast as on 8, which one NIC per GPU cannot carry (2.2 s of traffic in a 0.85 s step)
                FSDP1's SHARD_GRAD_OP as its code runs (zero2 with zero3_unit "flat": fp32 reduce-scatters and the
                casts before them; a stated undercount until then) and torch's LayerNorm saving its input and
                statistics: the MPT 1B and 3B rows 0.5-1 point lower (+28..+48%); all 79: 64, 14%, 104%
                a GEMM's time outside its k-loop (a tile's prologue and epilogue, 136 k-steps, and a kernel's fixed
                6.25 us: GPU.gemm_tile_k and gemm_kernel_us, fitted to OpenXLA's measured table of 155 Hopper GEMMs,
                which the model then gives back within 4.3%; waves alone missed it by 29% at the median): MPT's 1B
                and 3B 2.5-3.5 points lower, float8 rows 1-2: 65 of 79, 13.3%, 104%
                llm-foundry's flash path as its code runs (flash_attn_fn at 5e85bd62d: q, k and v unpadded through
                flash_attn's bert_padding, each after torch.nonzero and .max().item(), two host syncs, and the output
                padded back; kernels.unpadded_attention, read after the rows were predicted, nothing set to them): MPT
                1B -10 points, 3B -8, 7B -6, 70B -3 (the triton rows untouched): 69 of 79, 13.1%, 104%
                a ring across nodes at NCCL's own latency model (src/graph/tuning.cc: 8.4 us a collective, NVLink's
                3 us a step inside a node, the network's 14 us (9.6 in NCCL's 2020 tuner, for the A100 rows) at each
                of the nodes' crossings, where an assumed 10 us had been charged for every step), paid once per call
                where FSDP calls block by block (it had been paid once for a step's folded calls): MPT's small models
                now slow with the GPUs, as published (1B -3.4% from 128 to 512 GPUs; published -9.7%); DeepSpeed's
                ZeRO-3 rows, about 1,500 calls a step, +62..+146%: 71 of 79, 12.5%, 146%
    2026-11-29  one model of a collective's time (labkit.scale.collectives prices every call of the traffic; its
                tree all-reduce, which only its own tests used, gone): 71 of 79, 12.5%, 146%, unchanged
                a step at its slowest GPU's pace (pace.slowest_gpu, GPU.busy_node: the sustained GEMM of all 8
                GPUs of an H200 node at once, ml-engineering 082816f9, mean 0.9939 of one GPU alone, a 4.5% range
                over 40 figures; the slowest of the node's 8 as normal draws, 0.9792; taken for the three Hopper
                kinds as their MSMF is, not the A100, which has no such figure; within the node only, the tail
                beyond it not measured). Its size was read from the source after a look at how far a uniform
                slowdown would move the median (3% would have met it), so it is reported with that said: 72 of
                79, 11.1%, 146% (Hopper rows 1.2-2.4 points lower, the A100's unchanged; MPT 7B on 512 GPUs
                +25.4% -> +23.3%). As normal draws out to a run's every GPU, not one node's, it would give 73 and
                10.4%: not adopted, as that tail is beyond what was measured

History of --ranks (configurations, then layouts, meeting the criterion; seconds on 2 CPU cores)
    2026-11-27  the lab's space, kernel model: 2 and 12 of 59 (750 s beside other work; Llama 3's 8K-GPU row
                254 s, most rows under 25 s; 11 layouts before the all-reduce's curve against size, which brings
                torchtitan's interleaved 405B row within 5% and makes TP 8 on A100 nodes dearer: Megatron's rows
                1-5 points further from the top); flat model: 1 and 10 (64 s). With the frameworks' spaces: the
                lab's 2 and 12 (1,219 s), the frameworks' 18 and 29 (42 s)
    2026-11-28  with FSDP's copies, ZeRO-2's and ZeRO-3's calls per micro-batch and async TP's sums: the lab's 2
                and 13 (1,726 s beside a test run), the frameworks' 19 and 28 (39 s); flat: 1 and 11, the
                frameworks' 16 and 29. With one block's backward in the footprint: unchanged, 2 and 13 (1,203 s
                alone on the cores), the frameworks' 19 and 28 (38 s). With torchtitan's K/V rotation (kv_rotation,
                a trait of its space): unchanged, 2 and 13 (1,966 s beside the test suite), 19 and 28 (40 s)
                With torchtitan's rowwise casts at torchao's measured rate, its interleaved row at 8 micro-batches
                of 4 and its space holding torch's ring only (not Llama 3's all-gather method): unchanged, 2 and
                13 (1,191 s alone), 19 and 28 (34 s); the same three picks
                With torchao's float8 TP (all-gathers in float8): unchanged, 2 and 13 (1,490 s beside other work),
                19 and 28 (36 s); the same three picks. DeepSpeed's ZeRO-3 as its code runs came after: it only
                slows the published ZeRO-3 rows' predictions (the lab's space runs FSDP2), so no lab rank can rise;
                their own framework's space still ranks each first: 19 and 28 (36 s)
    2026-11-28  torchtitan's spaces as its code ran (frameworks.json): DDP only alone ('DDP has not supported > 1D
                parallelism'), and before June 2025 no gradient accumulation (without PP one pass of the local
                batch), the async TP file's torchtitan of June 2025 its own entry: the frameworks' 21 and 29 (205
                s; torchtitan's eager 8B FSDP row on 8 GPUs and its CP 4 row of Table 2 now meet); the lab's space
                is unchanged by it. With Megatron 2021's Table 1 as its authors' script ran it (micro-batches,
                torch's DDP, interleaving): the frameworks' 21 and 30 (392 s beside the test suite; 1.7B-76B's
                layouts meet at their best without recompute, the 145B's interleaved layout no longer does); the
                lab's space with all of the above (the model as at 673de9b, Table 1 as its authors ran it): 2 and 14
                (3,483 s beside other work; Llama 3's 8K-GPU row 682 s, Megatron's 1T 567 s), flat 1 and 13 (204 s)
                With Trainy's two H200 rows, the compiled loss, float8 all-gather and Megatron's loss: the
                frameworks' 21 and 32 of 61 (368 s beside the lab's; both H200 rows meet as layouts, FSDP at its
                best without recompute and with HSDP, +20%); the lab's space: 2 and 16 of 61 (3,434 s beside a
                fresh-clone CI run; Llama 3's 8K-GPU row 1,046 s), the two H200 rows 26th (-17.5%) and 1st as
                layouts; the other 59 as before
                With llm-foundry's 18 MPT rows, the network priced by its NICs (Cluster.link's per_node) and FSDP1's
                SHARD_GRAD_OP: the frameworks' 37 and 49 of 79 (299 s): torchtitan's 8B FSDP on 128 GPUs now first
                as published (no longer beaten by HSDP), both H200 rows and all 18 MPT rows first as layouts, 13 MPT
                rows as configurations; Llama 3's 8K-GPU CP 1 row drops out (-8.4% as a layout). The lab's space
                with the rails (the model before FSDP1's SHARD_GRAD_OP reduced fp32, which moves only the MPT 1B
                and 3B rows' own predictions): 11 and 28 of 79 (4,728 s beside CI and test-stress runs; Llama 3's
                16K-GPU row 1,786 s): torchtitan's 8B on 128 GPUs, both H200 rows and 14 MPT rows first or within 5%
                as layouts (the lab's ZeRO-1/2 without recompute the configuration ahead of their FSDP) Picks: 8B dp64 zero2 none
                mb1, 8,759 tok/s/GPU; 70B dp8 pp4 cp8 zero2 none mb1 interleavedx2 cp-ulysses, 1,090; 405B dp2 pp32
                cp8 tp2 zero2 none mb1 cp-allgather, 193 (170 s)
                With the GEMM's time outside its k-loop, llm-foundry's unpadding and NCCL's ring latency paid per
                call: the frameworks' 37 and 49 of 79, as before (284 s); the lab's space 7 and 28 of 79 (1,954 s
                beside other work): fewer MPT configurations within 5% of the top, which is now HSDP for the 1B to
                7B (its shard group's shorter rings, now that each block's call pays NCCL's latency; the published
                layouts still first as layouts), the layouts unchanged in count. Picks: 8B dp64 zero2 none mb1, 8,623 tok/s/GPU; 70B dp16 pp2 cp4 tp2
                zero2 none mb1 cp-ulysses, 1,051; 405B dp2 pp32 cp8 tp2 zero2 none mb1 cp-allgather, 187
    2026-11-29  with one model of a collective and a step paced by its slowest GPU: the frameworks' 37 and 49 of 79,
                as before (276 s). Picks: the same three layouts, each about 2% slower: 8B dp64 zero2 none mb1,
                8,476 tok/s/GPU; 70B dp16 pp2 cp4 tp2 zero2 none mb1 cp-ulysses, 1,033; 405B dp2 pp32 cp8 tp2 zero2
                none mb1 cp-allgather, 183 (184 s). The lab's space: 7 and 28 of 79, as before (4,756 s beside a
                fresh-clone CI run and make test-stress)

History of --memory (rows within 15% of those that publish it: 18, then 20)
    until 2026-11-28  16
    2026-11-28  one block's backward counted (the gradient flowing in and the MLP's gradients at their peak,
                labkit.scale.footprint.mlp_backward_elements, equal to what labkit.measure.activations.LiveBytes
                measures op by op on the lab's own block): 17 (70B at TP 8 -16% -> -12%; 405B at 256K -17% ->
                -15.2%)
                the CP ring's own moment of the backward (footprint.ring_backward_bytes: torch's ring attention
                backward, the all-gathered K and V and its fp32 dK, dV copies, measured op by op around torch's own
                function), less the block's MLP activations freed by then: 18 (405B at 256K -15.2% -> -14.6%; at
                128K -6.6% -> -6.6%; torchtitan's 8B CP rows -1% -> -0..+3%)
                Trainy's two H200 rows, a compiled loss holding 4 bytes a logit (footprint.COMPILED_LOGIT_BYTES):
                20 of 20 (+5.5%, +3.8%)
    2026-11-28  llm-foundry's MPT rows publish no memory: 20 of 20, unchanged (memory does not read the network)
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.scale.validation import (MODELS_OF_COST, format_sets, gains, load_sets, predict_sets,  # noqa: E402
                                    summarize)

# The lab's own models on one H200, bf16 autocast, eager: model, batch, seq, then each measurement's tok/s
# - bench/single_device.py, 2026-11-26 (/work/shared/gpu-2026-11-26/single_bf16.txt): median tok/s over rounds;
# - bench/gpu_check.sh --only predict, 2026-11-27 (torch 2.11.0+cu130): the median synchronized step, and the CUDA
#   kernels one step launched by torch.profiler (memcpy and memset apart).
SMALL_MEASURED = (("tiny", 64, 128, 409.1e3, 498.2e3, 613), ("seed", 64, 256, 523.1e3, 463.3e3, 890))


def small_end() -> list[dict]:
    """The lab's own models on one H200: measured twice, predicted by the kernel model, a block's time by bound,
    and the kernels of one step, counted by the model (layer_ops.step_kernels) and by the profiler."""
    from labkit.scale.validation import lab_model_on_one_gpu

    rows = []
    for name, batch, seq, measured, measured_again, profiled in SMALL_MEASURED:
        p = lab_model_on_one_gpu(name, batch, seq, "h200-sxm")
        rows.append(dict(model=name, measured=measured, measured_again=measured_again,
                         predicted=round(p["tokens_per_s"]),
                         error=round(p["tokens_per_s"] / measured - 1, 4),
                         error_again=round(p["tokens_per_s"] / measured_again - 1, 4),
                         bound={k: round(v, 3) for k, v in p["bound"].items()},
                         kernels_model=p["kernels"], eager_op_us=p["eager_op_us"], kernels_profiled=profiled,
                         us_per_kernel_measured=round(1e6 * batch * seq / measured_again / profiled, 1)))
    return rows


def ranks(model: str, space: str = "lab") -> dict:
    """Each published layout's rank under `model` in `space` ("lab": every option the lab prices; "framework": the
    options the row's code had, labkit.scale.space), at two levels (labkit.scale.ranking): the exact
    configuration, and the parallel layout (dp, pp, cp, tp, schedule kind; each at its best configuration): a
    table, the rows that miss with the model's reasons and their class (labkit.scale.misses), and {id: {...}} for
    the JSON line."""
    import time

    from labkit.scale.misses import classify
    from labkit.scale.ranking import CAP, LAYOUT_CAP, rank_published

    where = ("the lab's whole space (every option it prices)" if space == "lab" else
             "its framework's space (the options its code had: labkit/scale/frameworks.json)")
    print(f"\nwhere each published layout ranks in the search over {where}, {model} model "
          f"(rank {CAP + 1} = beyond {CAP}, {LAYOUT_CAP + 1} for layouts; criterion: top 5 or within 5% of the top)")
    print("  config: the exact published configuration; layout: its dp, pp, cp, tp and schedule kind, each layout at\n"
          "  its best micro-batch, ZeRO stage, recompute, dp_replicate and cp_method (a weaker claim than the first)")
    print(f"  {'row':20s} {'config':>6} {'gap':>7} meets {'layout':>6} {'gap':>7} meets {'s':>5}  the top; the published "
          "layout at its best")
    out, missed, start = {}, [], time.perf_counter()
    for info in load_sets().values():
        for row in info["rows"]:
            took = time.perf_counter()
            got = rank_published(row, info, model, space=space)
            took = time.perf_counter() - took
            lay = got["layout"]

            def shown(rank, gap, cap):
                return ("-" if rank is None else (f">{cap}" if rank > cap else str(rank)),
                        "-" if gap is None else f"{gap:+.1%}")
            rank, gap = shown(got["rank"], got["gap"], CAP)
            lrank, lgap = shown(lay["rank"], lay["gap"], LAYOUT_CAP)
            best = lay["best"].layout.short() if lay["best"] is not None else "-"
            print(f"  {row['id']:20s} {rank:>6} {gap:>7} {'yes' if got['meets'] else 'NO ':5s} {lrank:>6} {lgap:>7} "
                  f"{'yes' if lay['meets'] else 'NO ':5s} {took:5.1f}  {got['top'].layout.short() if got['top'] else '-'}; "
                  f"{best}")
            verdict = classify(got, row, info) if not got["meets"] else None
            out[row["id"]] = dict(space=got["space"], rank=got["rank"], gap=None if got["gap"] is None else round(got["gap"], 4),
                                  meets=got["meets"], top=got["top"].layout.short() if got["top"] else None,
                                  layout=dict(rank=lay["rank"], gap=None if lay["gap"] is None else round(lay["gap"], 4),
                                              meets=lay["meets"], best=best),
                                  miss=None if verdict is None else verdict["class"], seconds=round(took, 2))
            if verdict is not None:
                missed.append(f"  {row['id']} [{verdict['class']}]: {verdict['line']}")
    print(f"rows that miss the criterion at the configuration level ({len(missed)} of {len(out)}), their class "
          "(labkit.scale.misses) and why, in the model's numbers:")
    print("\n".join(missed))
    n_config = sum(r["meets"] for r in out.values())
    n_layout = sum(r["layout"]["meets"] for r in out.values())
    print(f"({time.perf_counter() - start:.0f} s; {n_config} of {len(out)} meet the criterion as configurations, "
          f"{n_layout} of {len(out)} as parallel layouts)")
    return out


def memory_table(results: dict) -> dict:
    """Predicted against published memory per row (a row without a figure ran: it must fit); the summary."""
    print("\nmemory per GPU, GiB: published (torch's peak reserved) against predicted (tensors + cuBLAS workspace "
          "segment); + the rest of the reserve (CUDA context, NCCL buffers) against the GPU")
    print(f"  {'row':44s} {'published':>9} {'pred':>6} {'err':>6} {'reserve':>7} {'peak+res':>8} {'GPU':>6} fits")
    within, errors, unfit = 0, [], []
    for rows in results.values():
        for r in rows:
            pub = f"{r['published_gib']:9.1f}" if r["published_gib"] is not None else f"{'ran':>9}"
            err = f"{r['memory_error']:+6.0%}" if r["memory_error"] is not None else f"{'-':>6}"
            whole = r["prediction"].peak_gib + r["reserve_gib"]
            print(f"  {r['id'][:44]:44s} {pub} {r['predicted_gib']:6.1f} {err} {r['reserve_gib']:7.2f} {whole:8.1f} "
                  f"{r['gpu_gib']:6.1f} {'yes' if r['fits'] else 'NO'}")
            if r["memory_error"] is not None:
                errors.append(abs(r["memory_error"]))
                within += abs(r["memory_error"]) <= 0.15
            if not r["fits"]:
                unfit.append(r["id"])
    print(f"  -> {len(errors)} rows publish memory, {within} within 15% (worst |err| {max(errors):.0%}); "
          f"rows that ran but the model says do not fit: {len(unfit)} {unfit}")
    return dict(published=len(errors), within_15=within, worst_abs_memory_error=round(max(errors), 4), not_fitting=unfit)


def picks(model: str) -> dict:
    """The search's pick for issue 34's three questions (labkit.scale.ranking.QUESTIONS) under `model`."""
    import time

    from labkit.scale.ranking import QUESTIONS, pick
    from labkit.scale.specs import LLAMA3

    print(f"\nthe search's picks, {model} model (h100-sxm, global batch 512 x 8,192 tokens):")
    out = {}
    for question, (name, n) in QUESTIONS.items():
        start = time.perf_counter()
        p = pick(LLAMA3[name], "h100-sxm", 512, 8192, n, model)
        took = time.perf_counter() - start
        print(f"  {question:22s} {p.layout.short():44s} {p.tokens_per_s_per_gpu:7,.0f} tokens/s/GPU  MFU {p.mfu:5.1%}  "
              f"{p.peak_gib:5.1f} GiB  ({took:.1f} s)")
        out[question] = dict(layout=p.layout.short(), tps=round(p.tokens_per_s_per_gpu), gib=round(p.peak_gib, 1),
                             seconds=round(took, 2))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=(*MODELS_OF_COST, "both"), default="both")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--ranks", action="store_true")
    parser.add_argument("--picks", action="store_true")
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    print("labkit.scale's cost model against published runs; err = predicted / published - 1")
    for name, info in load_sets().items():
        print(f"  {name}: {info['source'][:140]}")

    def rounded(s):
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}

    out = dict(bench="scale")
    for model in (MODELS_OF_COST if args.model == "both" else (args.model,)):
        results = predict_sets(model=model)
        print(f"\n=== the {model} model ===")
        print(format_sets(results))
        every = [r for rows in results.values() for r in rows]
        overall = summarize(every)
        print(f"\nall sets, {model} model: {overall['n']} rows, {overall['within_25']} within 25%, median |err| "
              f"{overall['median_abs_tps_error']:.0%}, worst {overall['worst_abs_tps_error']:.0%}; "
              f"runs that ran but the model says do not fit: {sum(not r['fits'] for r in every)}")
        outside = [r for r in every if abs(r["tps_error"]) > 0.25]
        print(f"rows outside 25% under the {model} model, and what the data file says of each:" if outside else
              f"no row outside 25% under the {model} model")
        for r in outside:
            print(f"  {r['id']} ({r['tps_error']:+.0%}): {r['note'] or 'no note'}")
        out[model] = dict(sets={name: rounded(summarize(rows)) for name, rows in results.items()},
                          overall=rounded(overall), not_fitting=[r["id"] for r in every if not r["fits"]])
        if model == "kernels":  # the flat model does not read float8
            for mechanism, twin in (("float8", "the same run in bf16"), ("async TP", "the same run without it")):
                pairs = gains(results, mechanism)
                print(f"\n{mechanism}'s gain over {twin} (tok/s ratio - 1), measured and predicted: what the two rows "
                      f"share\n(clock, network, framework) cancels, so this checks the {mechanism} mechanism alone")
                for g in pairs:
                    print(f"  {g['id']:12s} over {g['base']:12s} {g['recipe']:10s} measured {g['measured']:+6.1%}  "
                          f"predicted {g['predicted']:+6.1%}")
                out[model][mechanism.lower().replace(" ", "_") + "_gains"] = [rounded(g) for g in pairs]
        if args.memory and "memory" not in out:
            out["memory"] = memory_table(results)
        if args.ranks:
            out[model]["ranks"] = ranks(model)
            out[model]["ranks_framework"] = ranks(model, "framework")
        if args.picks:
            out[model]["picks"] = picks(model)
    if args.small:
        out["small"] = small_end()
        print("\nthe lab's own models on one H200 (bf16 autocast, eager), kernel model:")
        for r in out["small"]:
            print(f"  {r['model']}: measured {r['measured']:,.0f} tok/s (2026-11-26) and {r['measured_again']:,.0f} "
                  f"(2026-11-27), predicted {r['predicted']:,.0f} ({r['error']:+.0%}, {r['error_again']:+.0%}); "
                  f"a block's time by bound: {r['bound']}")
            print(f"    kernels a step: {r['kernels_model']} modelled, {r['kernels_profiled']} profiled, at "
                  f"{r['us_per_kernel_measured']} us each measured (the model: {r['eager_op_us']} us)")
        rows = out["small"]
        count = [r["kernels_profiled"] / r["kernels_model"] for r in rows]
        each = [r["us_per_kernel_measured"] / r["eager_op_us"] for r in rows]
        print(f"  the profiled step launches {min(count):.2f}-{max(count):.2f}x the kernels the model counts (the model\n"
              "  counts the ops as torchtitan writes them in bf16; the lab's step runs under autocast with fp32 weights:\n"
              "  each matmul's weight cast, the fp32 gradients, cuBLAS's split-K reductions), and each costs\n"
              f"  {min(each):.2f}-{max(each):.2f}x the cited {rows[0]['eager_op_us']} us: the two "
              "partly cancel, and the error's size moves with the host CPU from run to run")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
