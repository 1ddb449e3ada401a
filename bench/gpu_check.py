"""The one check an instructor runs on a GPU node: the lab's tests, notebooks and speed there.

    bash bench/gpu_check.sh [--quick] [--only tests,notebooks,single,compile,predict] [--notebooks 00,01]
                            [--suite-seconds N]

Rows, each PASS / FAIL / SKIP with its figures, then one JSON object as the last line:
- tests:     the whole test suite with the GPU visible (quick setting, reference solutions;
             pytest-xdist across the cores where it is installed);
- notebooks: every notebook in the full setting, executed by nbclient (JupyterLab is not needed;
             the browser tests are the suite's and need Chromium);
- single:    `bench/single_device.py` in bf16 and fp32 (TF32 allowed) at three model sizes, with MFU;
- compile:   `torch.compile` of the model in the lab's step, its speed-up over eager (bf16, seed model);
- predict:   the kernel model's tokens/s (`labkit.scale.cost`, efficiency=None, this GPU's kind) against the
             measured eager bf16 step of the tiny and seed models, and what sets the gap: these steps are
             bound by kernel launches, so the row gives the kernels one step launches (torch.profiler)
             against the model's count, and the measured time per kernel against its `eager_op_us`.
On a machine without a GPU every row but `tests` is skipped with a one-line reason, and `tests`
says to run `make test` instead; the script still ends with its JSON line.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
STEPS = ("tests", "notebooks", "single", "compile", "predict")
NOTEBOOKS: list = []  # --notebooks 00,01: only these (default: all)
SUITE_SECONDS: list = []  # --suite-seconds N: the suite's time limit (default 330 s with --quick, else 1800 s)


def _run(cmd, timeout, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        return out.returncode, out.stdout + out.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as error:
        text = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        return 124, text, time.monotonic() - start


def check_tests(gpu: bool, quick: bool) -> dict:
    if not gpu:
        return {"status": "SKIP", "why": "no GPU here: the CPU suite is `make test`"}
    import torch

    # the suite's kernels, scripts and torchrun jobs import labkit from any folder where `make setup` installed it;
    # with the node's own Python (no .venv) it is not installed, so they get this checkout on PYTHONPATH
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from checkout import labkit_path_env

    path_env = labkit_path_env()
    cmd, notes = suite_command(torch.__version__, bool(path_env))
    limit = SUITE_SECONDS[0] if SUITE_SECONDS else 330 if quick else 1800
    code, text, seconds = _run(cmd, limit, {"LABKIT_QUICK": "1", **path_env})
    if os.environ.get("GPU_CHECK_LOG_DIR"):  # the whole pytest output, for a later look
        with open(os.path.join(os.environ["GPU_CHECK_LOG_DIR"], "pytest.txt"), "w") as f:
            f.write(text)
    tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    summary = tail[-1].strip("= ") if tail else f"no summary (exit {code})"
    failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"status": "PASS" if code == 0 else "FAIL", "summary": "; ".join([summary, *notes]),
            "seconds": round(seconds, 1), "failed": failed[:40]}


def suite_command(torch_version: str, labkit_on_path: bool) -> tuple[list, list]:
    """The suite's command on a GPU node, and a line for each way it differs from `make test`: the browser and
    two-host tests left out (they need Chromium and network namespaces), the pin's test left out where the node's
    torch is not the pin, and the checkout on the children's PYTHONPATH where labkit is not installed."""
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "-q", "--impl=solutions", "-p", "no:cacheprovider", "--timeout", "240", "-rfE",
           "tests", "-m", "not slow", "-p", "bench.pytest_failures_log", "--deselect", "tests/test_browser.py", "--deselect", "tests/test_multihost.py"]
    notes = []
    pin = _torch_pin()
    if torch_version.split("+")[0] != pin:  # the node's own torch: the pin's test would only say so
        cmd += ["--deselect", "tests/test_setup.py::test_torch_is_the_pinned_version"]
        notes.append(f"torch {torch_version} is the node's, not the pin {pin}: the pin's test left out")
    if labkit_on_path:
        notes.append("labkit is not installed in this Python: the suite's children get this checkout on PYTHONPATH")
    if importlib.util.find_spec("xdist"):
        cmd += ["-p", "xdist", "-n", str(min(12, os.cpu_count() or 1))]
    return cmd, notes


def _torch_pin() -> str:
    """The torch version pyproject.toml pins ("torch==X"; read as text: tomllib is Python 3.11+)."""
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        return re.search(r'"torch==([^"]+)"', f.read()).group(1)


def check_notebooks(gpu: bool, quick: bool) -> dict:
    if not gpu:
        return {"status": "SKIP", "why": "no GPU here: `make test` runs every notebook in the quick setting"}
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError:
        return {"status": "SKIP", "why": "nbclient/nbformat not installed (pip install nbclient ipykernel)"}
    os.environ["LABKIT_QUICK"] = "0"
    os.environ.setdefault("LABKIT_IMPL", "solutions")
    results = {}
    for path in sorted(glob.glob(os.path.join(REPO, "notebooks", "[0-9][0-9]_*.ipynb"))):
        name = os.path.basename(path)[:2]
        if NOTEBOOKS and name not in NOTEBOOKS:
            continue
        nb = nbformat.read(path, as_version=4)
        start = time.monotonic()
        try:
            NotebookClient(nb, timeout=600, kernel_name="python3",
                           resources={"metadata": {"path": os.path.dirname(path)}}).execute()  # stops at the first error
            results[name] = {"ok": True, "seconds": round(time.monotonic() - start, 1)}
        except Exception as error:  # noqa: BLE001 - the row names the first failing cell
            results[name] = {"ok": False, "seconds": round(time.monotonic() - start, 1), "error": _first_error(nb, error)}
    failed = [k for k, v in results.items() if not v["ok"]]
    return {"status": "PASS" if not failed else "FAIL", "summary": f"{len(results) - len(failed)}/{len(results)} ran to the end",
            "failed": failed, "notebooks": results}


def _first_error(nb, error) -> str:
    """'code cell N (first line): Ename: value' for the first cell that failed, else the exception's last line."""
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for index, cell in enumerate(code_cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                first = (cell.source.strip().splitlines() or [""])[0][:80]
                return f"code cell {index} ({first}): {output.get('ename')}: {output.get('evalue', '')[:300]}"
    text = str(error).strip()
    return text.splitlines()[-1][:300] if text else type(error).__name__


def check_single(gpu: bool, quick: bool) -> dict:
    if not gpu:
        return {"status": "SKIP", "why": "no GPU here: `python bench/single_device.py` measures the CPU"}
    rows = {}
    for dtype in ("bf16", "fp32"):
        code, text, _ = _run([sys.executable, "bench/single_device.py", "--dtype", dtype] + (["--quick"] if quick else []), 600)
        if code != 0:
            return {"status": "FAIL", "summary": f"single_device.py --dtype {dtype} exited {code}", "tail": text[-2000:]}
        rows[dtype] = json.loads(text.strip().splitlines()[-1])
    ratios = [row[c]["ratio"] for row in rows.values() for c in ("tiny", "seed", "wide") if c in row]
    return {"status": "PASS" if min(ratios) >= 0.95 else "FAIL",
            "summary": "lab/plain " + ", ".join(f"{d} {c} {rows[d][c]['ratio']:.3f} (MFU {100 * (rows[d][c]['mfu'] or 0):.1f}%)"
                                                for d in rows for c in ("tiny", "seed", "wide") if c in rows[d]),
            "runs": rows}


def _step_seconds(model, opt, batches, train_step, sync):
    for x, y in batches[:2]:
        train_step(model, opt, x, y)
    sync()
    times = []
    for x, y in batches[2:]:
        start = time.perf_counter()
        train_step(model, opt, x, y)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_compile(gpu: bool, quick: bool) -> dict:
    if not gpu:
        return {"status": "SKIP", "why": "no GPU here"}
    import torch

    from labkit.data import get_batch, load_tokens
    from labkit.model import build_model
    from labkit.training.loop import TrainConfig, make_optimizer, train_step

    tokens, device = load_tokens("tinystories"), torch.device("cuda")
    batches = [get_batch(tokens, 64, 256, i, seed=0, device=device) for i in range(12 if quick else 30)]
    cfg = TrainConfig(steps=100, batch_size=64, seq_len=256)
    timings = {}
    for mode in ("eager", "compiled"):
        model = build_model("seed", seed=0, device=device)
        opt = make_optimizer(model, cfg)
        runner = torch.compile(model) if mode == "compiled" else model
        with torch.autocast("cuda", dtype=torch.bfloat16):
            timings[mode] = _step_seconds(runner, opt, batches, train_step, torch.cuda.synchronize)
    speedup = timings["eager"] / timings["compiled"]
    return {"status": "PASS", "summary": f"seed bf16 step eager {1e3 * timings['eager']:.2f} ms, compiled "
                                         f"{1e3 * timings['compiled']:.2f} ms: x{speedup:.2f}",
            "eager_s": timings["eager"], "compiled_s": timings["compiled"], "speedup": speedup}


def profile_kernels(model, opt, batch, train_step) -> dict:
    """One eager step under torch.profiler: the CUDA kernels it launched (memcpy and memset apart), and the
    ten kernel names launched most often (where an eager step's extra kernels come from: autocast's casts, say)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(model, opt, *batch)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [n for n in names if n.startswith(("Memcpy", "Memset"))]
    counts = collections.Counter(n[:90] for n in names if n not in copies)
    return {"kernels": sum(counts.values()), "memcpy_memset": len(copies), "top": counts.most_common(10)}


def check_predict(gpu: bool, quick: bool) -> dict:
    """The kernel model (labkit.scale.cost, efficiency=None) against the measured eager bf16 step of the lab's
    tiny and seed models, with what explains the gap: the kernels a step launches (the profiler's count against
    the model's) and the CPU time per kernel (the measured step / the measured kernels, these steps being
    launch-bound, against the model's eager_op_us)."""
    if not gpu:
        return {"status": "SKIP", "why": "no GPU here"}
    import torch

    from labkit.data import get_batch, load_tokens
    from labkit.model import build_model
    from labkit.scale.validation import lab_model_on_one_gpu
    from labkit.training.loop import TrainConfig, make_optimizer, train_step

    name = torch.cuda.get_device_name(0)
    kind = "h200-sxm" if "H200" in name else "h100-sxm" if "H100" in name else None
    tokens, device = load_tokens("tinystories"), torch.device("cuda")
    rows = {}
    for model_name, b, t in (("tiny", 64, 128), ("seed", 64, 256)):
        model = build_model(model_name, seed=0, device=device)
        opt = make_optimizer(model, TrainConfig(steps=100, batch_size=b, seq_len=t))
        batches = [get_batch(tokens, b, t, i, seed=0, device=device) for i in range(12)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            measured = _step_seconds(model, opt, batches, train_step, torch.cuda.synchronize)
            prof = profile_kernels(model, opt, batches[0], train_step)
        row = {"measured_s": measured, "measured_tokens_per_s": b * t / measured, "profile": prof,
               "measured_us_per_kernel": 1e6 * measured / max(1, prof["kernels"])}
        if kind:
            p = lab_model_on_one_gpu(model_name, b, t, kind)
            row.update(kind=kind, predicted_tokens_per_s=p["tokens_per_s"],
                       error=p["tokens_per_s"] * measured / (b * t) - 1, model=p)
        rows[model_name] = row
    summary = "; ".join(
        f"{k}: measured {v['measured_tokens_per_s'] / 1e3:.0f}k tok/s, {v['profile']['kernels']} kernels, "
        f"{v['measured_us_per_kernel']:.1f} us each"
        + (f"; kernel model {v['predicted_tokens_per_s'] / 1e3:.0f}k ({100 * v['error']:+.0f}%), "
           f"{v['model']['kernels']} kernels at {v['model']['eager_op_us']} us" if "model" in v else "")
        for k, v in rows.items())
    return {"status": "PASS", "summary": summary, "rows": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter benches; the suite's time limit 330 s")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--notebooks", default="", help="comma-separated notebook numbers, e.g. 00,01 (default: all)")
    parser.add_argument("--suite-seconds", type=int, default=0,
                        help="the test suite's time limit (default 330 s with --quick, else 1800 s; a lease's length, say)")
    options = parser.parse_args(argv)
    SUITE_SECONDS[:] = [options.suite_seconds] if options.suite_seconds > 0 else []
    NOTEBOOKS[:] = [n.strip().zfill(2) for n in options.notebooks.split(",") if n.strip()]
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if gpu else "no GPU"
    print(f"gpu_check: {name}, torch {torch.__version__}, Python {sys.version.split()[0]}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    checks = {"tests": check_tests, "notebooks": check_notebooks, "single": check_single,
              "compile": check_compile, "predict": check_predict}
    results = {}
    for step in [s for s in options.only.split(",") if s]:
        if step not in checks:
            raise SystemExit(f"unknown step {step!r}: choose from {', '.join(STEPS)}")
        try:
            results[step] = checks[step](gpu, options.quick)
        except Exception as error:  # noqa: BLE001 - one broken row does not hide the others
            results[step] = {"status": "FAIL", "summary": f"{type(error).__name__}: {error}"[:400]}
        row = results[step]
        print(f"{step:<10} {row['status']:<5} {row.get('summary') or row.get('why', '')}", flush=True)
        for line in row.get("failed", [])[:40]:
            print(f"           {line}")
    print(json.dumps({"bench": "gpu_check", "device": name, "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d"), **results}, default=str))


if __name__ == "__main__":
    main()
