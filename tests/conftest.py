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
