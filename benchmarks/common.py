"""Shared benchmark helpers: machine facts and result files under docs/benchmarks/."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import random
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def machine() -> dict[str, object]:
    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def save(name: str, rows: list[dict], extra: dict | None = None, out: Path = RESULTS,
         facts: dict | None = None) -> Path:
    """Write ``rows`` as <out>/<name>.json (with machine facts: ``facts``, or this machine's)
    and <name>.csv; ``out`` defaults to docs/benchmarks/."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": facts if facts is not None else machine(),
                                **(extra or {}), "rows": rows}, indent=2))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def interleaved(fns: dict, repeats: int, device: str = "cpu", warmup: int = 2
                ) -> dict[object, tuple[float, float]]:
    """Median and interquartile range (ms) of each callable, timed round-robin.

    Every callable runs once per round, in a new random order each round, so the machine's drift
    (large on shared machines) and each callable's after-effects on the next affect all of
    them alike; only ratios from one such run are compared.
    """
    import statistics
    import time

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[object, list[float]] = {k: [] for k in fns}
    items = list(fns.items())
    order = random.Random(0)
    for _ in range(repeats):
        # A new order each round (seeded): a callable that slows the next one (the Python
        # loop of the loops benchmark leaves the allocator and caches cold: the op right after
        # it measured 15-30% slower) slows each of the others equally often on average. (A
        # rotated order does not: in a stream of rounds A B C | B C A | C A B, B follows A
        # twice as often as C does.)
        order.shuffle(items)
        for key, fn in items:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples[key].append(time.perf_counter() - start)
    out = {}
    for key, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0], s[0], s[0]]
        out[key] = (statistics.median(s) * 1e3, (q[2] - q[0]) * 1e3)
    return out


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``."""
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
