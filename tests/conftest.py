"""Suite-wide settings."""

import os

import pytest
import torch

from amprewrite.graph import codegen

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # `pytest -n N` (the README's command): the workers share the threads torch would use
    # alone instead of each running that many, and so do the processes a test starts.
    _threads = str(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True, scope="session")
def _codegen_checked_against_fx():
    """Every graph amprewrite recompiles in the suite is written both by amprewrite.graph.codegen
    and by torch.fx, and a difference fails the test that made it."""
    codegen.check(True)
    yield
    codegen.check(False)
