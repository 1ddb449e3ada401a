"""Fixtures shared by the test modules (the --impl switch and the grade table live in labkit/grading/plugin.py)."""
import pytest
import torch


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
