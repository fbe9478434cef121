"""Fixtures of the trainer tests."""

import pytest


@pytest.fixture
def no_inductor(monkeypatch):
    """inductor compiling a graph fails the test: the trainer switches' default inner compiler
    on a CPU is eager (``inner="auto"``, amprewrite/trainers/inner.py), since inductor's compile
    of a training graph takes minutes there (issue 65)."""
    from torch._inductor import compile_fx

    def refused(*args, **kwargs):
        raise AssertionError("inductor compiled a graph on the CPU with the default inner")

    monkeypatch.setattr(compile_fx, "compile_fx", refused)
