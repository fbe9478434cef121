"""The test suite's CPU time, test by test: a pytest plugin and the table it feeds.

Run the README's test command with the plugin, then print the table::

    python -m pytest -q -n 2 --dist loadfile -p tools.suite_cpu
    python -m tools.suite_cpu            # files by CPU, the costliest tests, where the rest went

A test's CPU is read with ``getrusage`` around it: its process's own (user + system) and that
of the processes it started and waited for (the command line, a ``.pt2`` load, Chromium, the
C++ compiler under inductor). Each pytest process writes its rows to
``$AMPREWRITE_SUITE_CPU`` (default ``.suite_cpu/``) as ``<worker>.json`` when its session ends.
The controller's (``main.json``) children are the workers and everything they started: what the
tests' rows do not hold of it is the workers' start and collection, and processes reaped only
when a worker ends (the gloo ranks' process server, ``tests/training/gloo.py``).

>>> rows = [["tests/a.py::t1", 2.0, 1.0], ["tests/a.py::t2", 0.5, 0.0],
...         ["tests/b.py::t[x]", 1.0, 0.0]]
>>> [(f, round(own + kids, 1), n) for f, own, kids, n in by_file(rows)]
[('tests/a.py', 3.5, 2), ('tests/b.py', 1.0, 1)]
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections import defaultdict
from pathlib import Path

import pytest

_ROWS: list[list] = []


def _folder() -> Path:
    return Path(os.environ.get("AMPREWRITE_SUITE_CPU", ".suite_cpu"))


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, kids = _cpu()
    yield
    own1, kids1 = _cpu()
    _ROWS.append([item.nodeid, round(own1 - own, 3), round(kids1 - kids, 3)])


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    # The gloo ranks' CPU reaches this process's children only after it ends (measured:
    # tests/training's ranks, 57 s, in the controller's children and in no worker's here), so
    # the report counts them outside the tests' rows.
    own, kids = _cpu()
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (folder / f"{name}.json").write_text(json.dumps(
        {"rows": _ROWS, "own": round(own, 3), "children": round(kids, 3)}))


def by_file(rows: list[list]) -> list[tuple[str, float, float, int]]:
    """(file, own CPU, children's CPU, tests) for each test file, costliest first."""
    files: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, own, kids in rows:
        entry = files[nodeid.split("::")[0]]
        entry[0] += own
        entry[1] += kids
        entry[2] += 1
    return sorted(((f, o, k, n) for f, (o, k, n) in files.items()), key=lambda r: -(r[1] + r[2]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = int(argv[0]) if argv else 25
    folder = _folder()
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if not runs:
        print(f"no results in {folder}/: run pytest with -p tools.suite_cpu first",
              file=sys.stderr)
        return 2
    workers = {k: v for k, v in runs.items() if k != "main"}
    rows = [r for v in (workers or runs).values() for r in v["rows"]]
    in_tests = sum(r[1] + r[2] for r in rows)
    print(f"tests: {len(rows)}, {in_tests:.0f} s of CPU in them "
          f"({sum(r[1] for r in rows):.0f} s their own, {sum(r[2] for r in rows):.0f} s in the "
          "processes they started)")
    if "main" in runs and workers:
        main_run = runs["main"]
        outside = main_run["children"] - in_tests
        print(f"the whole command: {main_run['own'] + main_run['children']:.0f} s; outside the "
              f"tests' rows: {outside:.0f} s (workers' start and collection, the gloo ranks)")
    print(f"\n{'CPU s':>7} {'own':>7} {'started':>7} {'tests':>5}  file")
    for f, own, kids, n in by_file(rows)[:top]:
        print(f"{own + kids:7.1f} {own:7.1f} {kids:7.1f} {n:5d}  {f}")
    print(f"\n{'CPU s':>7}  test")
    for nodeid, own, kids in sorted(rows, key=lambda r: -(r[1] + r[2]))[:top]:
        print(f"{own + kids:7.1f}  {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
