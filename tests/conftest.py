"""Suite-wide settings."""

import gc
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


@pytest.fixture
def loaded_here_only(monkeypatch):
    """The pt2 check's load in a new process that imports only torch (``loads_alone``: 2-5 s of
    CPU, most of it torch's import) taken as passed, for tests that assert something else;
    tests/deploy/test_deploy.py's test_pt2_saves_loads_and_runs_at_another_batch_size and
    tests/benchmarks/test_hf_defaults.py run it, and the latter makes it fail; the latter's
    load test runs its own, at another batch size."""
    from amprewrite.deploy import export as deploy

    monkeypatch.setattr(deploy, "loads_alone", lambda path: None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config, items):
    """Mark the tests tests/extended.py lists ``extended``: out of the README's test command,
    run by ``-m "extended and not slow"`` (CI runs both)."""
    from tests import extended

    for item in extended.extended_items(items):
        item.add_marker(pytest.mark.extended)
    if not any("::" in str(arg) for arg in config.args):
        stale = extended.stale_entries(items)
        if stale:
            raise pytest.UsageError(
                f"tests/extended.py names tests that do not exist: {stale}. A test was "
                "renamed or removed: update its entry there (EXTENDED or SAMPLED).")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Leave what the suite made to the process's exit. After the last test pytest collects
    garbage several times to find unraisable exceptions; over the heap a worker has built by
    then (dynamo's caches, graphs, torch) that took more than 5 s on a loaded 2-core machine,
    and pytest-xdist's execnet, waiting 5 s for a worker to end, sends it SIGINT: the
    KeyboardInterrupt landed in a garbage-collection callback or a ``__del__``
    (``StorageWeakRef.__del__``) and pytest printed it as an unraisable exception at the end of
    a green run. Frozen objects are not examined by those collections.

    The gloo tests' process server (tests/training/gloo.py) is stopped and waited for, so
    that the CPU time of the processes it forked counts in this process's children's, as a
    spawned process's does (``/usr/bin/time`` of the test command)."""
    gc.freeze()
    import multiprocessing.forkserver

    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # Python 3.9+
    if stop is not None:
        stop()
