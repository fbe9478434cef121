"""Capture time on real models: amprewrite.transform against a static ``torch._dynamo.export``.

    python -m benchmarks.capture [--models llama swin ...] [--rounds 2] [--compare]

For every model of ``amprewrite.testing.zoo`` (the conformance models plus Swin, EfficientNet
and Wav2Vec2): the captured graph's node count, the time of a plain static dynamo export
(``torch._dynamo.export(model, assume_static_by_default=True)``, what a user would run), the time
of ``amprewrite.transform(model, bfloat16, example_inputs=...)`` with its split into capture and
passes, and the ratio. Each is the best of ``--rounds`` rounds, the two timed alternately so the
machine's drift hits both; dynamo's caches are reset before each. ``--compare`` adds a dynamic
export (every dimension symbolic: how amprewrite captured before it captured static shapes) and
non-strict ``torch.export.export``. Writes docs/benchmarks/capture.{json,csv}.

Goals (issue 15): transform ≤ 2x the static export, ≤ 15 s per model on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import amprewrite
from amprewrite.testing import zoo

from .common import save, table

GOAL_RATIO, GOAL_SECONDS = 2.0, 15.0


def _split(inputs) -> tuple[tuple, dict]:
    return ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})


def _timed(fn) -> tuple[float, object]:
    torch._dynamo.reset()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(name: str, rounds: int, compare: bool) -> dict:
    build = {**zoo.MODELS, **zoo.MORE}[name]
    model, inputs = build()
    args, kwargs = _split(inputs)
    export_s, transform_s, capture_s = [], [], []
    nodes = 0
    for r in range(rounds):
        def export():
            return torch._dynamo.export(model, assume_static_by_default=True)(*args, **kwargs)

        def transform():
            return amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs,
                                        verify=False)

        order = [("export", export), ("transform", transform)]
        for what, fn in order if r % 2 == 0 else order[::-1]:
            seconds, out = _timed(fn)
            if what == "export":
                export_s.append(seconds)
                nodes = len(out.graph_module.graph.nodes)
            else:
                transform_s.append(seconds)
                capture_s.append(amprewrite.report(out).timings["capture"])
    row = {"model": name, "nodes": nodes, "export_static_s": min(export_s),
           "transform_s": min(transform_s), "capture_s": min(capture_s),
           "passes_s": min(transform_s) - min(capture_s)}
    row["ratio"] = row["transform_s"] / row["export_static_s"]
    row["meets_goal"] = row["ratio"] <= GOAL_RATIO and row["transform_s"] <= GOAL_SECONDS
    if compare:
        row["export_dynamic_s"] = _try(lambda: torch._dynamo.export(
            model, assume_static_by_default=False)(*args, **kwargs))
        row["export_nonstrict_s"] = _try(lambda: torch.export.export(
            model, args, kwargs, strict=False))
    return row


def _try(fn) -> float | str:
    try:
        return _timed(fn)[0]
    except Exception as exc:  # a comparison column only: say it failed, and why
        return f"failed ({type(exc).__name__})"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capture", description=__doc__)
    parser.add_argument("--models", nargs="+", default=[*zoo.MODELS, *zoo.MORE])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    # dynamo's first export in a process pays one-off imports and set-up: not either's cost.
    torch._dynamo.export(torch.nn.Linear(2, 2))(torch.randn(1, 2))
    rows = []
    for name in args.models:
        row = measure(name, args.rounds, args.compare)
        rows.append(row)
        print(f"{name}: {row['nodes']} nodes, export {row['export_static_s']:.2f} s, "
              f"transform {row['transform_s']:.2f} s ({row['ratio']:.2f}x)", flush=True)
    columns = ["model", "nodes", "export_static_s", "transform_s", "capture_s", "passes_s",
               "ratio", "meets_goal"]
    if args.compare:
        columns += ["export_dynamic_s", "export_nonstrict_s"]
    print(table(rows, columns))
    save("capture", rows, {"goal": {"ratio": GOAL_RATIO, "seconds": GOAL_SECONDS},
                           "rounds": args.rounds})
    return rows


if __name__ == "__main__":
    main()
