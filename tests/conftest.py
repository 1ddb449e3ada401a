"""Fixtures shared by the test modules (the --impl switch and the grade table live in labkit/grading/plugin.py)."""
import pytest
import torch

import background


@pytest.fixture
def one_thread():
    """Ops this small gain nothing from threads, and spinning threads are slow on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_shared_zygote = None


def pytest_configure(config):
    """One zygote for every process of this run (labkit/launching/zygote_sharing.py): each notebook
    kernel, script and inner pytest would otherwise start and warm up its own, about 4 s of CPU each.
    Started before collection, so that it warms up meanwhile; `LABKIT_SHARED_ZYGOTE=0` turns it off."""
    global _shared_zygote
    from labkit.launching import zygote
    from labkit.launching.zygote_sharing import SharedZygote

    _shared_zygote = SharedZygote(zygote.PRELOAD_IF_CALLER_HAS)


def pytest_unconfigure(config):
    if _shared_zygote is not None:
        _shared_zygote.close()


def pytest_collection_modifyitems(config, items):
    """Tests that read a background job's result run last, so that the jobs run beside the others."""
    items.sort(key=lambda item: item.get_closest_marker("reads_background") is not None)  # stable


def pytest_collection_finish(session):
    """Start every background job that the selected tests will read (tests/background.py)."""
    if session.config.option.collectonly:
        return
    by_module = {}
    for item in session.items:
        if item.get_closest_marker("reads_background"):
            by_module.setdefault(item.module, []).append(item)
    runner = background.Background(cwd=session.config.rootpath)
    background.install(runner)
    jobs = [job for module, items in by_module.items() for job in module.background_jobs(items)]
    runner.start(jobs)
    session.config.add_cleanup(runner.close)
