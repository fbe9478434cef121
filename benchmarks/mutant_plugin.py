"""A pytest plugin that flips one op family's precision class before the tests run.

    AMPREWRITE_MUTANT=softmax=promote python -m pytest -p benchmarks.mutant_plugin tests/...

``AMPREWRITE_MUTANT`` is ``family=class`` (classes: ``low``, ``fp32``, ``promote``,
``neutral``; several mutations separated by commas). The plugin replaces the family in
``amprewrite.precision.ops`` with :func:`amprewrite.precision.ops.register_family` when pytest
loads it, before any test module is imported; passes look families up when they run, so every
transform in the session sees the flipped class. Production code reads no environment variable:
without this plugin, or without the variable, nothing changes. ``python -m benchmarks mutants`` runs
the test selection once per family with this plugin.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from amprewrite.precision.ops import FAMILIES, Precision, register_family

ENV = "AMPREWRITE_MUTANT"


def parse(spec: str) -> list[tuple[str, Precision]]:
    """``"softmax=promote,conv=fp32"`` -> [("softmax", PROMOTE), ("conv", FP32)]."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, cls = item.partition("=")
        if not sep or name not in FAMILIES:
            raise pytest.UsageError(f"{ENV}={spec!r}: '{item}' is not family=class with a family "
                                    "of amprewrite.precision.ops.FAMILIES")
        try:
            out.append((name, Precision(cls.strip().lower())))
        except ValueError:
            raise pytest.UsageError(f"{ENV}={spec!r}: '{cls}' is not one of "
                                    f"{[p.value for p in Precision]}") from None
    return out


def apply(spec: str) -> list[str]:
    """Flip the families ``spec`` names; returns one 'family: old -> new' line each."""
    done = []
    for name, cls in parse(spec):
        old = FAMILIES[name]
        register_family(dataclasses.replace(old, precision=cls))
        done.append(f"{name}: {old.precision.value} -> {cls.value}")
    return done


_APPLIED = apply(os.environ.get(ENV, ""))


def pytest_report_header(config: pytest.Config) -> str:
    return f"amprewrite mutant: {'; '.join(_APPLIED) if _APPLIED else 'none'}"


def pytest_sessionstart(session: pytest.Session) -> None:
    # The flip must still be in place when the tests start (nothing re-registered the family).
    for name, cls in parse(os.environ.get(ENV, "")):
        if FAMILIES[name].precision != cls:
            raise pytest.UsageError(f"{ENV}: family '{name}' is "
                                    f"{FAMILIES[name].precision.value} at session start, not "
                                    f"{cls.value}")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    # Tests that name a flipped family run first (stable order otherwise): with -x a caught
    # flip stops sooner. The selection itself is unchanged.
    names = [name for name, _ in parse(os.environ.get(ENV, ""))]
    if names:
        items.sort(key=lambda item: not any(f"[{n}" in item.nodeid or f"-{n}" in item.nodeid
                                            for n in names))
