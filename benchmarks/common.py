"""Shared benchmark helpers: machine facts and result files under docs/benchmarks/."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
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


def save(name: str, rows: list[dict], extra: dict | None = None) -> Path:
    """Write ``rows`` as docs/benchmarks/<name>.json (with machine facts) and <name>.csv."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **(extra or {}), "rows": rows}, indent=2))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns``."""
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
