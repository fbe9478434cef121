"""Deploying zoo models: transform, export with a dynamic batch, save, load back, run at the
example's batch and two others, and compile with AOTInductor (issue 24).

    python -m benchmarks.deploy [--models llama gpt2 ...] [--dtypes bf16 fp16] [--to pt2 aoti]
    python -m benchmarks deploy [same options]

For each (model, dtype, format) one :func:`amprewrite.deploy.export.export` call with
``other_batches=2``; inductor's on-disk FX-graph cache is off, so every AOTInductor package
really compiles. A row records the batch sizes the artefact ran at, its largest relative
difference from the GraphModule's output (goal: at most 1e-6), its error against fp32 next to
``torch.autocast``'s on the same inputs and their ratio (goal: at most 1.1; the worst batch),
the wall time of each step of the export, and the first problem when the check or a step fails
(a failure is a row, not a crash). Defaults: llama, gpt2, bert, vit, resnet and unet2d of
``amprewrite.testing.zoo``, bf16 and fp16, pt2 and aoti: 24 rows, 5 to 9 minutes on the 2-core
CPU machine, most of it AOTInductor compiles and the checks' eager runs. Writes
docs/benchmarks/deploy_cpu.{json,csv}.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import warnings
from pathlib import Path

import torch

from amprewrite.deploy import export as deploy
from amprewrite.testing import zoo

from .common import save, table

MODELS = ["llama", "gpt2", "bert", "vit", "resnet", "unet2d"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ["pt2", "aoti"]
GOAL_RATIO = 1.1  # issue 24: the artefact's error against fp32 at most 1.1x autocast's
OTHER_BATCHES = 2
COLUMNS = ["model", "dtype", "to", "batch_range", "batches", "graph_diff", "error",
           "autocast_error", "ratio", "meets_goal", "transform_s", "export_s", "write_s",
           "check_s", "total_s", "mb", "failure"]


def measure(name: str, dtype: str, to: str, out: Path) -> dict:
    """One :func:`amprewrite.deploy.export.export` of zoo model ``name``, as a row."""
    row: dict[str, object] = {"model": name, "dtype": dtype, "to": to}
    model, inputs = zoo.MODELS[name]()
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        result = deploy.export(model, inputs, path=out / f"{name}-{dtype}-{to}.pt2", to=to,
                               dtype=DTYPES[dtype], other_batches=OTHER_BATCHES)
    except Exception as exc:  # a row, not a crash: the cause in one line
        text = str(exc).strip()
        row.update(total_s=time.perf_counter() - start, meets_goal=False,
                   failure=f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")
        return row
    row["total_s"] = time.perf_counter() - start
    row.update({f"{step}_s": s for step, s in result.timings.items()})
    row["mb"] = sum(f.stat().st_size for f in result.files) / 1e6
    if result.batch_range is not None:
        lo, hi = result.batch_range
        row["batch_range"] = f"[{lo}, {'inf' if math.isinf(hi) else int(hi)}]"
    row["per_batch"] = [{"batch": r.batch, "graph_diff": r.graph_error, "error": r.error,
                         "autocast_error": r.autocast_error} for r in result.rows]
    row["batches"] = " ".join(str(r.batch) for r in result.rows)
    if result.rows:
        worst = max(result.rows, key=lambda r: _ratio(r.error, r.autocast_error))
        row.update(graph_diff=max(r.graph_error for r in result.rows), error=worst.error,
                   autocast_error=worst.autocast_error,
                   ratio=_ratio(worst.error, worst.autocast_error))
    ran_all = len(result.rows) == 1 + OTHER_BATCHES
    if not ran_all and not result.problems:
        result.problems.append(f"ran at {len(result.rows)} batch sizes, not "
                               f"{1 + OTHER_BATCHES}: {'; '.join(result.notes)}")
    row["meets_goal"] = (result.passed and ran_all
                         and row["graph_diff"] <= deploy.SAME_AS_GRAPH
                         and row["ratio"] <= GOAL_RATIO)
    more = len(result.problems) - 1
    row["failure"] = (result.problems[0] + (f" (and {more} more)" if more > 0 else "")
                      if result.problems else "")
    row["problems"] = result.problems
    return row


def _ratio(error: float, autocast: float) -> float:
    if autocast == 0:
        return 1.0 if error == 0 else math.inf
    return error / autocast


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=list(zoo.MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--to", nargs="+", default=FORMATS, choices=FORMATS)
    parser.add_argument("--name", default="deploy_cpu",
                        help="results file under docs/benchmarks/ (default deploy_cpu)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = []
    start = time.perf_counter()
    # The FX-graph cache off: a package compiled in an earlier run would make the compile
    # time a cache lookup.
    with tempfile.TemporaryDirectory() as tmp, torch._inductor.config.patch(
            fx_graph_cache=False):
        for name in args.models:
            for dtype in args.dtypes:
                for to in args.to:
                    rows.append(measure(name, dtype, to, Path(tmp)))
                    row = rows[-1]
                    print(f"{name} {dtype} {to}: " + ", ".join(
                        f"{k}={row[k]:.3g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
                        for k in COLUMNS[3:] if k in row), flush=True)
    total = time.perf_counter() - start
    print(table(rows, COLUMNS))
    print(f"{len(rows)} rows in {total:.0f} s; goal met in "
          f"{sum(bool(r['meets_goal']) for r in rows)}")
    save(args.name, rows, {"goal": {"graph_diff": deploy.SAME_AS_GRAPH, "ratio": GOAL_RATIO},
                           "other_batches": OTHER_BATCHES, "total_s": total})
    return rows


if __name__ == "__main__":
    main()
