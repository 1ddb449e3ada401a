"""The validation set (labkit/scale/published_runs.json, labkit.scale.validation, bench/scale.py).

Each row's figures are checked against the quote of its source's text that the row carries (the sources
themselves are outside the repository: torchtitan's benchmark files, the papers' tables); a row whose
figure was mistyped is caught (planted below). Each set names its source, a cluster that loads and its
stated choices; the bench prints one line per row and a JSON last line. Arithmetic only: about 3 s.
"""
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from labkit.scale.cluster import load_cluster
from labkit.scale.specs import GPT_MEGATRON, MODELS
from labkit.scale.validation import MODELS_OF_COST, layout_of, load_sets, predict_row, published_tps, summarize

ROOT = Path(__file__).resolve().parent.parent
SETS = load_sets()


def numbers(text: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", text)]


def quote_mismatches(row: dict) -> list[str]:
    """The row's published figures and its setup's numbers that its quote does not contain."""
    quoted = numbers(row["quote"])
    want = [v for v in row["published"].values() if not isinstance(v, str)]
    if row["id"].startswith("meg21-t1"):
        m = GPT_MEGATRON[row["model"]]
        want += [m.d_model, m.n_layers, row["params_billion"], row["tp"] * row["pp"],
                 row["dp"] * row["tp"] * row["pp"], row["global_batch"]]
    if row["id"].startswith("meg21-t2"):  # Table 2 gives no shapes: parameters, model-parallel size, GPUs, batches
        want += [row["params_billion"], row["tp"] * row["pp"], row["dp"] * row["tp"] * row["pp"], row["global_batch"],
                 row["micro_batch"]]
    if row["id"].startswith("llama3"):
        want += [row["dp"] * row["tp"] * row["cp"] * row["pp"], row["tp"], row["cp"], row["pp"]]
    if row["id"].startswith("tt24") and "CP" in row["quote"]:
        want += [row["seq_len"], row["dp"], row["cp"]]
    if row["id"].startswith("tt25-h200"):  # NUM_NODES, 8 H200s each
        want += [row["dp"] // 8]
    return [f"{row['id']}: {v} not in {row['quote']!r}" for v in want
            if not any(abs(q - v) < 1e-9 for q in quoted)]


def test_every_row_matches_its_quoted_source_text():
    assert [m for info in SETS.values() for row in info["rows"] for m in quote_mismatches(row)] == []


def test_a_mistyped_figure_is_caught():
    row = copy.deepcopy(SETS["torchtitan-2024-12"]["rows"][0])
    row["published"]["tps_per_gpu"] = 5726  # 5,762 with two digits swapped
    assert len(quote_mismatches(row)) == 1
    row = copy.deepcopy(SETS["megatron-2021-table1"]["rows"][-1])
    row["pp"] = 32  # 1T's model-parallel size 512 = tp 8 x pp 64
    assert quote_mismatches(row)
    row = copy.deepcopy(SETS["megatron-2021-table2"]["rows"][3])
    row["micro_batch"] = 2  # ZeRO-3's 530B on 640 GPUs ran micro-batches of 4
    assert quote_mismatches(row)


def test_sets_name_source_cluster_and_choices():
    assert set(SETS) == {"torchtitan-2024-12", "torchtitan-asynctp-2025-06", "megatron-2021-table1",
                         "megatron-2021-table2", "megatron-2022-mfu", "llama3-table4", "torchtitan-h200-2025-06",
                         "llm-foundry-2024-01"}
    ids = [row["id"] for info in SETS.values() for row in info["rows"]]
    assert len(ids) == len(set(ids)) == 18 + 12 + 10 + 12 + 4 + 3 + 2 + 18
    for name, info in SETS.items():
        assert info["source"] and info["choices"], name
        load_cluster(info["cluster"])
        for row in info["rows"]:
            assert row["model"] in MODELS and row["source_row"] and row["quote"], row["id"]
            lay = layout_of(row)
            assert lay.world_size == row["dp"] * row["pp"] * row["cp"] * row["tp"]


def test_llm_foundry_rows_are_the_tables_own_columns():
    """llm-foundry's large-scale H100 table (5e85bd62d): each row's quote parses back to its inputs: the GPUs are dp,
    GradAccum 1 (global batch = micro-batch x GPUs), FULL_SHARD -> zero3 and SHARD_GRAD_OP -> zero2 under FSDP1
    ("flat"), Activation Checkpointing True -> full, the T/s/GPU column published; sweep.py's 'triton' for 13B and
    30B tagged. specs.MPT's parameters are the table's NumParams less the learned positions (2,048 x d) and the
    biases, which the spec leaves out: within 0.4%. Planted (checked when written): an untied head (V x d more)
    misses the 1B's count by 7.5%."""
    rows = SETS["llm-foundry-2024-01"]["rows"]
    assert len(rows) == 18
    for row in rows:
        cells = [c.strip() for c in row["quote"].strip().strip("|").split("|")]
        size, seq, gpus, mb, accum, tps_gpu, shard, ckpt, n_params = (cells[0], cells[1], cells[2], cells[7],
                                                                      cells[8], cells[12], cells[16], cells[17],
                                                                      cells[19])
        assert row["model"] == f"mpt-{size}" and row["seq_len"] == int(seq) and row["dp"] == int(gpus), row["id"]
        assert accum == "1" and row["micro_batch"] == int(mb) and row["global_batch"] == int(mb) * int(gpus)
        assert row["zero"] == {"FULL_SHARD": "zero3", "SHARD_GRAD_OP": "zero2"}[shard] and row["zero3_unit"] == "flat"
        assert row["recompute"] == {"True": "full", "False": "none"}[ckpt]
        assert row["published"] == {"tps_per_gpu": int(tps_gpu)}
        assert ("triton attention" in row["outside_model"]) == (size in ("13b", "30b"))
        spec = MODELS[row["model"]]
        assert spec.tied_embedding and spec.positions == "learned" and spec.norm == "layernorm"
        assert 0 < 1 - spec.n_params / int(n_params) < 0.004, row["id"]


def test_each_row_runs_sequence_parallelism_as_its_code_had_it():
    """Megatron-LM 2021 had no sequence parallelism (Korthikanti et al. 2022 introduced it): its rows with tp > 1
    run TP's all-reduces with the LayerNorms and dropouts on the whole sequence; the 2022 rows and torchtitan's
    (its TP plan shards the sequence) keep it on. The row's field must reach the Layout (layout_of)."""
    for name, info in SETS.items():
        for row in info["rows"]:
            if row["tp"] > 1:
                assert layout_of(row).sequence_parallel is (not name.startswith("megatron-2021")), row["id"]
    row = dict(SETS["megatron-2021-table1"]["rows"][-1], sequence_parallel=True)
    assert layout_of(row).sequence_parallel  # the field, not the set's name, decides


def test_torchtitans_pipelined_rows_run_as_many_micro_batches_as_pipeline_ranks():
    """torchtitan 9dec370 (the Dec 2024 file's version): n_microbatches = pipeline_parallel_degree when unset, whatever
    the stages per rank (pipelining_utils.build_pipeline_schedule); pp x stages per rank came after these runs
    (90567fc98, 2025-01-07). So the interleaved 405B row runs 8 micro-batches of 4, as the 1F1B row does. Planted
    mistake: the later rule's 16 of 2 on the interleaved row fails here."""
    rows = [row for row in SETS["torchtitan-2024-12"]["rows"] if row["pp"] > 1]
    assert {row["schedule"] for row in rows} == {"1f1b", "interleaved"}
    for row in rows:
        assert row["global_batch"] // (row["dp"] * row["micro_batch"]) == row["pp"], row["id"]
    planted = dict(next(row for row in rows if row["schedule"] == "interleaved"), micro_batch=2)
    assert planted["global_batch"] // (planted["dp"] * planted["micro_batch"]) != planted["pp"]


# NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (6985e58, 2021-08-18), the authors' script for Table 1, per model:
# --micro-batch-size, --DDP-impl, --num-layers-per-virtual-pipeline-stage (None: not passed), --num-layers
SC21_TABLE_1 = {"1.7b": (16, "torch", None, 24), "3.6b": (16, "torch", None, 30), "7.5b": (16, "torch", None, 36),
                "18b": (8, "torch", None, 40), "39b": (4, "local", None, 48), "76b": (2, "local", 5, 60),
                "145b": (2, "local", 5, 80), "310b": (1, "local", 3, 96), "530b": (1, "local", 1, 105),
                "1t": (1, "local", None, 128)}


def test_megatron_rows_reduce_gradients_as_their_ddp_did():
    """Megatron-LM's --DDP-impl local (its default until 2023) all-reduces once forward_backward_func returns
    (grad_reduce="after"); torch's DDP, which the authors' script runs for Table 1's 1.7B-18B, reduces buckets
    during the backward ("overlap"). Every other Megatron row on plain DP is local; DeepSpeed's ZeRO-3 rows and the
    rest overlap."""
    for name, info in SETS.items():
        for row in info["rows"]:
            if name == "megatron-2021-table1":
                want = "overlap" if SC21_TABLE_1[row["model"]][1] == "torch" else "after"
            else:
                want = "after" if name.startswith("megatron") and row["zero"] == "dp" else "overlap"
            assert layout_of(row).grad_reduce == want, row["id"]


def test_megatron_2021_table_1_runs_as_its_authors_script_set_it():
    """Each Table 1 row's micro-batch and schedule are the authors' script's: interleaved with layers / pp / (layers
    per virtual stage) stages per rank where it passes that flag and that makes more than one, else plain 1F1B (the
    530B's one layer per virtual stage is 3 stages per rank; the 1T passes none)."""
    for row in SETS["megatron-2021-table1"]["rows"]:
        mbs, _, per_virtual, layers = SC21_TABLE_1[row["model"]]
        v = layers // row["pp"] // per_virtual if per_virtual else 1
        lay = layout_of(row)
        assert (lay.micro_batch, lay.schedule, lay.virtual_stages) == (mbs, "interleaved" if v > 1 else "1f1b", v), \
            row["id"]
        assert GPT_MEGATRON[row["model"]].n_layers == layers, row["id"]


def test_trainys_h200_rows_run_as_the_files_command_and_toml_set_them():
    """torchtitan's benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md: NUM_NODES 4 and 8 hosts of 8 H200s, FSDP
    over all (the toml's data_parallel_shard_degree = -1), --training.local_batch_size=2 in one pass, the toml's
    seq_len 8,192 and per-op selective recompute, --training.compile, float8 (tensorwise, torchao's default) with
    --quantize.linear.float8.enable_fsdp_float8_all_gather; the loss compiled with the model (bbb1b61 is in e7c0cae),
    so the set leaves compiled_loss to torch.compile."""
    info = SETS["torchtitan-h200-2025-06"]
    assert info["cluster"] == "h200-sxm" and info["framework"] == "torchtitan-2025" and "compiled_loss" not in info
    for row, nodes in zip(info["rows"], (4, 8)):
        lay = layout_of(row)
        assert (lay.dp, lay.tp, lay.pp, lay.cp, lay.dp_replicate, lay.zero) == (8 * nodes, 1, 1, 1, 1, "zero3")
        assert (lay.micro_batch, row["global_batch"], row["seq_len"], lay.recompute) == (2, 16 * nodes, 8192,
                                                                                         "selective-op")
        assert row["outside_model"] == ["torch.compile", "float8", "float8 all-gather"], row["id"]


def test_published_figures_become_tokens_per_second_by_the_sources_flop_count():
    info = SETS["megatron-2021-table1"]
    row = info["rows"][-1]  # 1T: 163 TFLOP/s per GPU by eq. 3 with recomputation
    m = GPT_MEGATRON["1t"]
    h, l, s, V = 25600, 128, 2048, 51200
    eq3 = 96 * 3072 * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))  # per iteration of 3,072 sequences
    assert published_tps(row, m, info, 312e12) == pytest.approx(163e12 / (eq3 / (3072 * s)), rel=1e-12)
    info = SETS["megatron-2022-mfu"]
    row = info["rows"][0]  # 22B: MFU 41.5% of 312 TFLOP/s, model FLOPs = eq. 3 without recomputation
    m = GPT_MEGATRON["22b"]
    h, l = 6144, 48
    assert published_tps(row, m, info, 312e12) == pytest.approx(
        0.415 * 312e12 / (72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))), rel=1e-12)


def test_summary_on_hand_rows():
    rows = [dict(tps_error=e, memory_error=m) for e, m in ((0.1, None), (-0.3, 0.05), (0.25, -0.2))]
    assert summarize(rows) == dict(n=3, within_25=2, median_abs_tps_error=0.25, worst_abs_tps_error=0.3,
                                   worst_abs_memory_error=0.2)


def test_bench_prints_rows_then_json():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--memory"], capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    last = json.loads(out[-1])
    for model in MODELS_OF_COST:  # both models, the flat one's table first
        assert last[model]["overall"]["n"] == 79 and set(last[model]["sets"]) == set(SETS)
        assert sum(s["n"] for s in last[model]["sets"].values()) == 79
        assert last[model]["not_fitting"] == []
        row = predict_row(SETS["torchtitan-2024-12"]["rows"][0], SETS["torchtitan-2024-12"], model)
        section = "\n".join(out).split(f"=== the {model} model ===")[1]
        assert f"{row['tps_error']:+6.0%}" in section.split("===")[0]
    assert any("Table 1, 1T" in line for line in out)
    # --memory: one line per row; the rows with a published figure, their error against predict_row's
    rows = [r for info in SETS.values() for r in (predict_row(row, info) for row in info["rows"])]
    published = [r for r in rows if r["memory_error"] is not None]
    assert last["memory"]["published"] == len(published) == 20 and last["memory"]["not_fitting"] == []
    assert last["memory"]["within_15"] == sum(abs(r["memory_error"]) <= 0.15 for r in published)
    table = "\n".join(out).split("memory per GPU, GiB")[1]
    assert all(f"{r['memory_error']:+6.0%}" in table for r in published)


def test_float8_gains_pair_each_float8_row_with_the_same_run_in_bf16():
    """validation.gains(results, "float8"): a float8 row is set beside the bf16 row of its set that differs only in
    float8 (model, layout and every other item of outside_model alike); the gains are the published and the predicted ratios.
    Edge cases: Table 2's rows are all float8 (no bf16 twin: left out), and an async-TP float8 row pairs with the
    async-TP bf16 row, never with the plain one (a planted key without outside_model would pair atp-8b-10 with
    atp-8b-7)."""
    from labkit.scale.validation import gains as mechanism_gains, predict_sets

    results = predict_sets(model="kernels")
    gains = {g["id"]: g for g in mechanism_gains(results, "float8")}
    assert {i: (g["base"], g["recipe"]) for i, g in gains.items()} == {
        "tt24-t1-3": ("tt24-t1-2", "tensorwise"), "tt24-t3-10": ("tt24-t3-9", "tensorwise"),
        "atp-70b-3": ("atp-70b-1", "tensorwise"), "atp-70b-4": ("atp-70b-2", "tensorwise"),
        "atp-70b-5": ("atp-70b-1", "rowwise"), "atp-70b-6": ("atp-70b-2", "rowwise"),
        "atp-8b-9": ("atp-8b-7", "tensorwise"), "atp-8b-10": ("atp-8b-8", "tensorwise"),
        "atp-8b-11": ("atp-8b-7", "rowwise"), "atp-8b-12": ("atp-8b-8", "rowwise")}
    rows = {r["id"]: r for rs in results.values() for r in rs}
    g = gains["atp-8b-10"]
    assert g["measured"] == rows["atp-8b-10"]["published_tps"] / rows["atp-8b-8"]["published_tps"] - 1
    assert g["predicted"] == rows["atp-8b-10"]["predicted_tps"] / rows["atp-8b-8"]["predicted_tps"] - 1


def test_async_tp_gains_pair_each_async_row_with_the_same_run_without_it():
    """validation.gains(results, "async TP"): each async-TP row beside its set's row of the same run and precision
    without async TP; the recipe is the pair's precision. Edge case: Table 4's "2D + AsyncTP" (float8) pairs with
    "2D" (float8), and a rowwise async row pairs with the rowwise plain one, never with bf16."""
    from labkit.scale.validation import gains as mechanism_gains, predict_sets

    results = predict_sets(model="kernels")
    rows = {r["id"]: r for rs in results.values() for r in rs}
    gains = {g["id"]: g for g in mechanism_gains(results, "async TP")}
    pairs = {i: (g["base"], g["recipe"]) for i, g in gains.items()}
    assert {i: p for i, p in pairs.items() if i.startswith("atp-")} == {
        "atp-70b-2": ("atp-70b-1", "bf16"), "atp-70b-4": ("atp-70b-3", "tensorwise"),
        "atp-70b-6": ("atp-70b-5", "rowwise"), "atp-8b-8": ("atp-8b-7", "bf16"),
        "atp-8b-10": ("atp-8b-9", "tensorwise"), "atp-8b-12": ("atp-8b-11", "rowwise")}
    t4 = [r["id"] for r in results["torchtitan-2024-12"] if "AsyncTP" in r["source_row"]]
    assert len(t4) == 1 and gains[t4[0]]["set"] == "torchtitan-2024-12" and gains[t4[0]]["recipe"] == "tensorwise"
    assert rows[gains[t4[0]]["base"]]["source_row"] == "Table 4: 2D"
    for i, g in gains.items():
        assert g["predicted"] == rows[i]["predicted_tps"] / rows[g["base"]]["predicted_tps"] - 1
