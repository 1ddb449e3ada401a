"""What a GPU node refuses, emulated on this CPU: ranks are born clean, and the lab runs on an older torch.

On a GPU node (2026-11-26, one H200, torch 2.11) 142 tests failed because every rank was forked
from a process that had run a backward, 28 because it had initialised CUDA, and 39 because torch
2.11 has no ``all_gather_single`` / ``reduce_scatter_single``. A CPU-only torch shows none of it,
so each is emulated here (`labkit.launching.gpu_refusal`, ``tests/old_torch/sitecustomize.py``).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from checkout import labkit_path_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_TORCH = os.path.join(REPO, "tests", "old_torch")

# Two ranks, each the gradient of half the batch, averaged: data parallelism, against the full
# batch in the caller. float64 and a sum of two halves: the difference is rounding only (<1e-15 here).
TRAIN = """
import os, torch, torch.distributed as dist, labkit
from labkit.launching.gpu_refusal import refuse_like_a_gpu_node

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
torch.nn.functional.mse_loss(net(x), y).backward()   # the caller trains: on a GPU node, autograd's threads start
full = [p.grad.clone() for p in net.parameters()]
net.zero_grad()
refuse_like_a_gpu_node()                             # from now on, a fork of this process refuses as on the node

def data_parallel_grads(rank, world_size):
    half = slice(4 * rank, 4 * rank + 4)
    torch.nn.functional.mse_loss(net(x[half]), y[half]).backward()
    grads = [p.grad for p in net.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= world_size
    return grads
"""


def _python(code: str, env_extra: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, **labkit_path_env())  # unchanged where it can be: the suite's zygote is shared
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_ranks_train_after_the_caller_ran_backward_where_a_fork_of_the_caller_is_refused():
    """The emulation bites a process forked from the caller (today's launcher until 2026-11-26 did
    that, and failed); labkit.launch's ranks, born from the zygote, train and equal the full batch."""
    out = _python(TRAIN + """
import multiprocessing as mp
def forked_child(queue):
    try:
        net(x).sum().backward()
        queue.put("backward ran")
    except RuntimeError as error:
        queue.put(str(error))
    try:
        torch.cuda._lazy_init()
    except Exception as error:
        queue.put(str(error))
ctx = mp.get_context("fork"); queue = ctx.Queue(); child = ctx.Process(target=forked_child, args=(queue,))
child.start(); print("FORKED CHILD:", queue.get(timeout=60)); print("FORKED CUDA:", queue.get(timeout=60)); child.join()
grads = labkit.launch(data_parallel_grads, 2, timeout=120)
for rank_grads in grads:
    for got, want in zip(rank_grads, full):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
print("RANKS EQUAL THE FULL BATCH")
""")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FORKED CHILD: Unable to handle autograd's threading in combination with fork-based" in out.stdout
    assert "FORKED CUDA: Cannot re-initialize CUDA in forked subprocess" in out.stdout
    assert "RANKS EQUAL THE FULL BATCH" in out.stdout


def test_in_a_real_kernel_a_cell_that_trained_is_followed_by_ranks_that_train(tmp_path):
    """A real kernel: backward in a cell, then %%ranks 2 and labkit.launch both train, equal to one process."""
    import nbformat
    from run_notebook import NotebookClient  # nbclient's, polling its sockets every second

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        f"import sys; sys.path.insert(0, {REPO!r})\n" + TRAIN + "\n%load_ext labkit",
        "%%ranks 2 --timeout 120\n"
        "got = data_parallel_grads(rank, world_size)\n"
        "for g, w in zip(got, full):\n"
        "    torch.testing.assert_close(g, w, rtol=0, atol=1e-14)\n"
        "print('magic equal', rank)",
        "for rank_grads in labkit.launch(data_parallel_grads, 2, timeout=120):\n"
        "    for g, w in zip(rank_grads, full):\n"
        "        torch.testing.assert_close(g, w, rtol=0, atol=1e-14)\n"
        "print('launch equal')",
    )]
    client = NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for cell in nb.cells for o in cell.outputs if o.output_type == "error"]
    assert not errors, "\n".join("\n".join(e.traceback) for e in errors)[-4000:]
    text = lambda cell: "".join(o.get("text", "") for o in cell.outputs)  # noqa: E731
    assert "[rank 0] magic equal 0" in text(nb.cells[1]) and "[rank 1] magic equal 1" in text(nb.cells[1])
    assert "launch equal" in text(nb.cells[2])


# --------------------------------------------------------------------------- shipping

def test_closures_notebook_globals_and_a_model_travel(tmp_path):
    """A closure's variables, a __main__ global, a class defined in the script and a model all reach the ranks."""
    out = _python("""
import torch, labkit
class Scale(torch.nn.Module):
    def __init__(self, k):
        super().__init__(); self.k = torch.nn.Parameter(torch.tensor(float(k)))
    def forward(self, x):
        return self.k * x
model = Scale(3)
offset = 10.0
def make(factor):
    def fn(rank, world_size):
        return (model(torch.tensor(float(rank))) * factor + offset).item(), type(model).__name__
    return fn
print("RESULT", labkit.launch(make(2.0), 2, timeout=120))
""")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT [(10.0, 'Scale'), (16.0, 'Scale')]" in out.stdout


@pytest.mark.parametrize("what, made, named", [
    ("a lock", "import threading; thing = threading.Lock()", "cannot pickle '_thread.lock' object"),
    ("a file open for writing", "import os; thing = open(os.devnull, 'w')", "Cannot pickle files that are not opened for reading"),
    ("a generator", "thing = (i for i in range(3))", "cannot pickle 'generator' object"),
])
def test_an_object_that_cannot_travel_is_named_before_any_rank_starts(what, made, named):
    from labkit.launching.shipping import ShippingError

    scope = {}
    exec(made, scope)

    def uses_it(rank, world_size, thing):
        return thing

    import labkit

    with pytest.raises(ShippingError) as err:
        labkit.launch(uses_it, 2, scope["thing"], timeout=30)
    message = str(err.value)
    assert message.startswith(f"argument 1 after (rank, world_size) of uses_it cannot be sent to the ranks: {named}")
    assert "Create this object inside the function" in message
    if hasattr(scope["thing"], "close"):
        scope["thing"].close()


def test_a_default_value_that_cannot_travel_is_named():
    import threading

    from labkit.launching.shipping import ShippingError, pack

    def worker(rank, world_size, guard=threading.Lock()):
        return rank

    with pytest.raises(ShippingError, match=r"the default value of `guard` \(in worker\) cannot be sent"):
        pack(worker, (), {})


def test_a_global_that_cannot_travel_is_named_with_the_function_that_uses_it():
    from labkit.launching.shipping import ShippingError, pack

    namespace = {}
    exec("import threading\nlock = threading.Lock()\ndef cell_fn(rank, world_size):\n    with lock: return rank\n",
         namespace)
    namespace["cell_fn"].__module__ = "__main__"  # as a notebook cell's function: travels by value
    with pytest.raises(ShippingError, match=r"the global `lock` \(used by cell_fn\) cannot be sent to the ranks"):
        pack(namespace["cell_fn"], (), {})


def test_a_gpu_tensor_made_in_the_caller_is_named_with_what_to_do():
    from labkit.launching.shipping import ShippingError, pack

    class OnGpu(torch.Tensor):  # a CPU-only torch cannot make a CUDA tensor: one that says it is
        @property
        def device(self):
            return torch.device("cuda", 0)

    weights = torch.zeros(3).as_subclass(OnGpu)
    with pytest.raises(ShippingError, match=r"keyword argument `weights` .* CUDA tensor \(shape \(3,\)\)"):
        pack(len, (), {"weights": weights})


def test_a_function_reaching_a_torch_config_module_travels_by_name():
    """torch's config modules subclass ModuleType, which cloudpickle alone cannot pickle (notebook 12 hit it)."""
    import pickle

    import torch._dynamo.config

    from labkit.launching.shipping import dumps

    assert pickle.loads(dumps(torch._dynamo.config)) is torch._dynamo.config


def test_the_ranks_magic_ships_only_the_names_its_cell_uses():
    from labkit.launching.magic import names_used

    code = compile("def f(a):\n    return [b for b in a] + helper(c)\nprint(f(data))", "<cell>", "exec")
    assert {"data", "helper", "c", "print", "f"} <= names_used(code)
    assert "unrelated" not in names_used(code)


# --------------------------------------------------------------------------- the torch on the node

def test_nccl_ranks_get_gloo_for_cpu_tensors_and_their_own_device(monkeypatch):
    """On a GPU node a rank joins with 'cpu:gloo,cuda:nccl' and device_id (a CPU-tensor case runs beside nccl)."""
    import torch.distributed as dist

    from labkit.launching import rank_main

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    rank_main.init_process_group("nccl", 3, 4, 1, 60.0)
    rank_main.init_process_group("gloo", 3, 4, 1, 60.0)
    assert calls[0] == ("set_device", torch.device("cuda", 1))
    assert calls[1][0] == "cpu:gloo,cuda:nccl" and calls[1][1]["device_id"] == torch.device("cuda", 1)
    assert calls[2][0] == "gloo" and "device_id" not in calls[2][1]


def test_without_the_single_ops_labkit_supplies_them_and_ranks_use_them():
    """torch 2.11 lacks all_gather_single / reduce_scatter_single: labkit calls the *_tensor ops instead."""
    out = _python("""
import torch, torch.distributed as dist
assert not hasattr(dist, "all_gather_single")      # the sitecustomize removed them
import labkit
from labkit.comm.traffic import count_traffic
from labkit.grading.diagnose import watch_groups

def gather_and_scatter(rank, world_size):
    group = dist.new_group([0, 1])  # rank 2 stays out: the default group would be the wrong one
    if rank == 2:
        return None
    with count_traffic() as traffic, watch_groups(group, "the stand-ins"):
        out = torch.zeros(4)
        dist.all_gather_single(out, torch.full((2,), float(rank)), group=group)
        part = torch.zeros(2)
        dist.reduce_scatter_single(part, torch.arange(4.0), group=group)
    return (out.tolist(), part.tolist(), dist.all_gather_single.labkit_fallback_for, traffic.by_op(),
            traffic.payload(op="all_gather_single"), traffic.payload(op="reduce_scatter_single"))
print("RESULT", labkit.launch(gather_and_scatter, 3, timeout=120))
""", {"PYTHONPATH": os.pathsep.join([OLD_TORCH, REPO])})
    assert out.returncode == 0, out.stderr[-3000:]
    result = eval(out.stdout.split("RESULT ", 1)[1])
    assert result[2] is None
    for rank, (gathered, scattered, fallback, ops, gather_bytes, scatter_bytes) in enumerate(result[:2]):
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert scattered == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert fallback == "all_gather_into_tensor"
        assert ops == {"all_gather_single": 1, "reduce_scatter_single": 1}  # seen once, by the name called
        # the payloads read through the real signature (torch 2.11 showed 0 bytes and "the default
        # group" while the stand-in took *args): the gathered output and the scattered input, 4 floats
        assert (gather_bytes, scatter_bytes) == (16, 16)


@pytest.mark.slow
def test_the_sharded_steps_pass_their_tests_without_the_single_ops():
    """ZeRO-2, FSDP and sequence parallelism (the heaviest users of the *_single ops) under 'torch 2.11'."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([OLD_TORCH, REPO]), LABKIT_QUICK="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "--impl=solutions", "-p", "no:cacheprovider",
                          "tests/grading/test_zero2.py", "tests/grading/test_sequence_parallel.py",
                          "tests/grading/test_fsdp.py"],
                         capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:]
    assert " passed" in out.stdout.splitlines()[-1]


# --------------------------------------------------------------------------- GPU figures

def test_mfu_counts_against_the_peak_of_the_arithmetic_that_runs():
    """bf16 against the bf16 peak; fp32 against TF32's where either switch allows it, else fp32's."""
    from labkit.measure.metrics import TFLOPS, lookup_peak, math_mode

    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert (math_mode(torch.bfloat16), math_mode(torch.float32)) == ("bf16", "fp32")
        torch.set_float32_matmul_precision("high")  # the newer switch alone
        assert math_mode(torch.float32) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])
    # dense SXM peaks from NVIDIA's H100/H200 data sheets (sparsity figures halved)
    assert lookup_peak("NVIDIA H200", "bf16") == 989 * TFLOPS and lookup_peak("NVIDIA H200", "tf32") == 495 * TFLOPS
    assert lookup_peak("NVIDIA H100 80GB HBM3", "fp32") == 67 * TFLOPS
    assert lookup_peak("NVIDIA H100 PCIe", "bf16") == 756 * TFLOPS


def _gpu_check():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import gpu_check

    return gpu_check


@pytest.mark.parametrize("node_torch, left_out", [("2.11.0+cu130", True), (None, False)])
def test_gpu_check_leaves_out_the_pin_test_only_where_the_nodes_torch_is_not_the_pin(node_torch, left_out):
    """A GPU node's own torch (2.11 on 2026-11-27) failed test_torch_is_the_pinned_version, which says nothing about
    the node: bench/gpu_check.py leaves it out there, with a line saying why, and keeps it where torch is the pin."""
    gc = _gpu_check()
    version = node_torch or gc._torch_pin() + "+cu130"
    cmd, notes = gc.suite_command(version, labkit_on_path=False)
    pin_test = "tests/test_setup.py::test_torch_is_the_pinned_version"
    assert (pin_test in cmd) == left_out
    assert any("not the pin" in n for n in notes) == left_out
    assert cmd[cmd.index("-m", 3) + 1] == "not slow" and "tests/test_browser.py" in cmd


def test_a_python_without_labkit_installed_gives_the_suites_children_this_checkout():
    """On 2026-11-27, 41 tests failed on a GPU node whose own Python had no `make setup`: their kernels, scripts and
    torchrun jobs could not import labkit. tests/checkout.labkit_path_env (which bench/gpu_check.py gives the suite)
    asks a child of that Python, started in another folder: the venv's base interpreter has no labkit installed,
    so it gets this checkout on PYTHONPATH; this venv's has it, so it gets nothing."""
    base = os.path.join(sys.base_prefix, "bin", "python3")
    probe = ("import sys; sys.path.insert(0, 'tests'); from checkout import labkit_path_env; "
             "print(labkit_path_env().get('PYTHONPATH', ''))")
    if sys.prefix == sys.base_prefix or not os.path.exists(base):
        pytest.skip("not in a virtual environment: no base interpreter without this one's packages")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    without = subprocess.run([base, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    if "labkit" in subprocess.run([base, "-c", "import importlib.util as u; print(u.find_spec('labkit'))"],
                                  capture_output=True, text=True, timeout=60, cwd="/", env=env).stdout:
        pytest.skip("labkit is installed in the base interpreter too")
    assert without.stdout.strip().split(os.pathsep)[0] == REPO, without.stderr
    with_it = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert with_it.stdout.strip() == "", with_it.stderr
