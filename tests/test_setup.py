"""Set-up contracts: the pins agree, CI runs the README's command, JupyterLab serves the lab."""
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins_from_pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return dict(dep.split("==") for dep in deps)


def _pins_from_environment_yml():
    text = open(os.path.join(REPO, "environment.yml")).read()
    return dict(re.findall(r"^\s*-\s*([A-Za-z0-9_.\-]+)==([^\s#]+)", text, flags=re.M))


def test_every_dependency_is_pinned():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert all("==" in dep for dep in deps), [d for d in deps if "==" not in d]


def test_environment_yml_has_the_same_pins_as_pyproject():
    assert _pins_from_environment_yml() == _pins_from_pyproject()


def test_torch_is_the_pinned_version():
    import torch

    assert torch.__version__.split("+")[0] == _pins_from_pyproject()["torch"]


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(REPO, "README.md")).read()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "lab"], ["make", "test"]]
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert re.search(r"^make test\b", ci, flags=re.M)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jupyterlab_serves_the_lab_and_lists_the_notebooks(tmp_path):
    # a GPU node's own Python (bench/gpu_check.sh without `make setup`) may have no JupyterLab: skip, do not fail
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed here (`make setup` installs it)")
    port = _free_port()
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_DATA_DIR=str(tmp_path / "data"))
    server = subprocess.Popen(
        [jupyter, "lab", "--no-browser", f"--port={port}", "--ServerApp.port_retries=0",
         "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.root_dir={REPO}", "--ServerApp.disable_check_xsrf=True", "--allow-root"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                lab = urllib.request.urlopen(f"{base}/lab", timeout=5).read().decode()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("JupyterLab did not start within 90 s")
                time.sleep(0.5)
        assert "JupyterLab" in lab
        listing = urllib.request.urlopen(f"{base}/api/contents/notebooks", timeout=10).read().decode()
        on_disk = sorted(f for f in os.listdir(os.path.join(REPO, "notebooks")) if f.endswith(".ipynb"))
        assert on_disk and all(f'"name": "{name}"' in listing or f'"name":"{name}"' in listing
                               for name in on_disk)
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
