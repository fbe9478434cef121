"""Capture time on real models: amprewrite.transform against torch's own exports.

    python -m benchmarks.capture [--models llama swin ...] [--rounds 2] [--compare]
                                 [--llama-layers 12] [--llama-rounds 5]

For every model of ``amprewrite.testing.zoo`` (the conformance models plus Swin, EfficientNet
and Wav2Vec2): the captured graph's node count, the time of a plain static dynamo export
(``torch._dynamo.export(model, assume_static_by_default=True)``, what a user would run) and of a
plain non-strict ``torch.export.export(model, args, strict=False)``, static and with the
dynamic batch amprewrite asks for by default (``dynamic_shapes="batch"``), the time of
``amprewrite.transform(model, bfloat16, example_inputs=...)`` with its split into capture and
passes, for the default ``capture="dynamo"`` and for ``capture="export"``, the ratios, and for
both captures' graphs the number of ops run low and the output error against fp32. Each
is the best of ``--rounds`` rounds, the five timed in a new seeded random order each round so
the machine's drift hits all of them; dynamo's caches are reset before each. ``--compare`` adds
a dynamic export (every dimension symbolic: how amprewrite captured before it captured static
shapes). Writes docs/benchmarks/capture.{json,csv}.

Then, on a LLaMA of ``--llama-layers`` decoder layers (the zoo's small config, deeper; 0 skips
it): the same alternatives plus ``capture="export"`` with ``dynamic_shapes=None``, interleaved
over ``--llama-rounds`` rounds, each ratio against the static non-strict export and the capture
also against the batch-dynamic one. Writes docs/benchmarks/capture_llama.{json,csv}.

Goals: issue 15, transform ≤ 2x the static dynamo export and ≤ 15 s per model on the 2-core CI
machine; issue 24, capture ≤ 1.2x non-strict ``torch.export.export`` on the 12-layer LLaMA.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch
from torch.export import Dim

import amprewrite
from amprewrite.graph.shapes import BATCH, capture_spec
from amprewrite.show.numerics import rel_err
from amprewrite.testing import zoo

from .common import save, table

GOAL_RATIO, GOAL_SECONDS = 2.0, 15.0
GOAL_VS_NONSTRICT = 1.2  # issue 24: capture time against torch.export.export(strict=False)


def _split(inputs) -> tuple[tuple, dict]:
    return ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})


def _timed(fn) -> tuple[float, object]:
    torch._dynamo.reset()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _transform(model, inputs, **options):
    return amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs,
                                verify=False, **options)


def _rounds(fns: dict, rounds: int) -> dict[str, list[tuple[float, object]]]:
    """Each callable once per round, in a new seeded random order each round (see
    ``common.interleaved``): (seconds, result) per round."""
    samples: dict[str, list[tuple[float, object]]] = {k: [] for k in fns}
    items = list(fns.items())
    order = random.Random(0)
    for _ in range(rounds):
        order.shuffle(items)
        for key, fn in items:
            samples[key].append(_timed(fn))
    return samples


def _capture_s(samples: list[tuple[float, object]]) -> list[float]:
    return [amprewrite.report(gm).timings["capture"] for _, gm in samples]


def measure(name: str, rounds: int, compare: bool) -> dict:
    build = {**zoo.MODELS, **zoo.MORE}[name]
    model, inputs = build()
    args, kwargs = _split(inputs)
    batch, _ = capture_spec(model, args, kwargs, BATCH)  # what transform asks torch for
    fns = {
        "export": lambda: torch._dynamo.export(model, assume_static_by_default=True)(
            *args, **kwargs),
        "nonstrict": lambda: torch.export.export(model, args, kwargs, strict=False),
        "nonstrict_batch": lambda: torch.export.export(model, args, kwargs, strict=False,
                                                       dynamic_shapes=batch),
        "transform": lambda: _transform(model, inputs),
        "transform_export": lambda: _transform(model, inputs, capture="export"),
    }
    s = _rounds(fns, rounds)
    best = {k: min(t for t, _ in v) for k, v in s.items()}
    row = {"model": name, "nodes": len(s["export"][0][1].graph_module.graph.nodes),
           "export_static_s": best["export"], "export_nonstrict_s": best["nonstrict"],
           "transform_s": best["transform"], "capture_s": min(_capture_s(s["transform"]))}
    row["passes_s"] = row["transform_s"] - row["capture_s"]
    row["ratio"] = row["transform_s"] / row["export_static_s"]
    row["meets_goal"] = row["ratio"] <= GOAL_RATIO and row["transform_s"] <= GOAL_SECONDS
    row["transform_export_s"] = best["transform_export"]
    row["capture_export_s"] = min(_capture_s(s["transform_export"]))
    row["capture_export_vs_nonstrict"] = row["capture_export_s"] / row["export_nonstrict_s"]
    row["export_nonstrict_batch_s"] = best["nonstrict_batch"]
    row["capture_export_vs_nonstrict_batch"] = (row["capture_export_s"]
                                                / row["export_nonstrict_batch_s"])
    # The two captures' graphs: how many ops run low, and the output error against fp32.
    with torch.no_grad():
        ref = zoo.first_tensor(zoo.call(model, inputs)).float()
        for key, suffix in (("transform", ""), ("transform_export", "_export")):
            gm = s[key][-1][1]
            row[f"low_nodes{suffix}"] = sum(d.precision == "low"
                                            for d in amprewrite.report(gm).decisions)
            out = zoo.first_tensor(zoo.call(gm, inputs)).float()
            row[f"rel_err{suffix}"] = rel_err(out, ref)
    row["err_export_vs_dynamo"] = row["rel_err_export"] / row["rel_err"]
    if compare:
        row["export_dynamic_s"] = _try(lambda: torch._dynamo.export(
            model, assume_static_by_default=False)(*args, **kwargs))
    return row


def measure_llama(layers: int, rounds: int) -> list[dict]:
    """The issue 24 row set: a deep LLaMA, every way in, interleaved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    inputs = (torch.randint(0, 256, (2, 64)),)
    # id -> (what, callable); ids are what docs/benchmarks.md's figures select rows by.
    ways = {
        "export": ("torch.export.export(strict=False)",
                   lambda: torch.export.export(model, inputs, strict=False)),
        "export_batch": ("torch.export.export(strict=False), batch dynamic",
                         lambda: torch.export.export(model, inputs, strict=False,
                                                     dynamic_shapes=({0: Dim.AUTO},))),
        "dynamo_export": ("torch._dynamo.export, static", lambda: torch._dynamo.export(
            model, assume_static_by_default=True)(*inputs)),
        "transform": ("transform, capture='dynamo' (default)", lambda: _transform(model, inputs)),
        "transform_export": ("transform, capture='export'",
                             lambda: _transform(model, inputs, capture="export")),
        "transform_export_static": ("transform, capture='export', dynamic_shapes=None",
                                    lambda: _transform(model, inputs, capture="export",
                                                       dynamic_shapes=None)),
    }
    fns = {key: fn for key, (_, fn) in ways.items()}
    s = _rounds(fns, rounds)
    base = min(t for t, _ in s["export"])
    batch = min(t for t, _ in s["export_batch"])
    # Medians too: on a shared machine one lucky round moves a best-of ratio a lot.
    base_med = statistics.median(t for t, _ in s["export"])
    batch_med = statistics.median(t for t, _ in s["export_batch"])
    rows = []
    for key, (what, _) in ways.items():
        samples = s[key]
        times = [t for t, _ in samples]
        row = {"id": key, "what": what, "layers": layers, "seconds": min(times),
               "median_s": statistics.median(times), "vs_nonstrict": min(times) / base}
        if key.startswith("transform"):
            cap = _capture_s(samples)
            row["capture_s"] = min(cap)
            row["passes_s"] = min(times) - min(cap)
            row["capture_vs_nonstrict"] = min(cap) / base
            row["capture_vs_nonstrict_batch"] = min(cap) / batch
            row["capture_median_s"] = statistics.median(cap)
            row["capture_vs_nonstrict_median"] = statistics.median(cap) / base_med
            row["capture_vs_nonstrict_batch_median"] = statistics.median(cap) / batch_med
            row["nodes"] = len(samples[0][1].graph.nodes)
        rows.append(row)
    return rows


def _try(fn) -> float | str:
    try:
        return _timed(fn)[0]
    except Exception as exc:  # a comparison column only: say it failed, and why
        return f"failed ({type(exc).__name__})"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capture", description=__doc__)
    parser.add_argument("--models", nargs="*", default=[*zoo.MODELS, *zoo.MORE],
                        help="zoo models (none: only the LLaMA rows)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--llama-layers", type=int, default=12)
    parser.add_argument("--llama-rounds", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    # dynamo's first export in a process pays one-off imports and set-up: not either's cost.
    torch._dynamo.export(torch.nn.Linear(2, 2))(torch.randn(1, 2))
    torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),), strict=False)
    rows = []
    for name in args.models:
        row = measure(name, args.rounds, args.compare)
        rows.append(row)
        print(f"{name}: {row['nodes']} nodes, export {row['export_static_s']:.2f} s, "
              f"transform {row['transform_s']:.2f} s ({row['ratio']:.2f}x), capture='export' "
              f"{row['transform_export_s']:.2f} s", flush=True)
    if rows:
        columns = ["model", "nodes", "export_static_s", "transform_s", "capture_s", "passes_s",
                   "ratio", "meets_goal", "export_nonstrict_s", "transform_export_s",
                   "capture_export_s", "capture_export_vs_nonstrict", "export_nonstrict_batch_s",
                   "capture_export_vs_nonstrict_batch", "low_nodes", "low_nodes_export",
                   "rel_err", "rel_err_export", "err_export_vs_dynamo"]
        if args.compare:
            columns += ["export_dynamic_s"]
        print(table(rows, columns))
        save("capture", rows, {"goal": {"ratio": GOAL_RATIO, "seconds": GOAL_SECONDS},
                               "rounds": args.rounds})
    if args.llama_layers:
        llama = measure_llama(args.llama_layers, args.llama_rounds)
        print(table(llama, ["what", "seconds", "median_s", "vs_nonstrict", "capture_s",
                            "capture_median_s", "passes_s", "capture_vs_nonstrict",
                            "capture_vs_nonstrict_median", "capture_vs_nonstrict_batch",
                            "capture_vs_nonstrict_batch_median"]))
        save("capture_llama", llama, {"goal": {"capture_vs_nonstrict": GOAL_VS_NONSTRICT},
                                      "rounds": args.llama_rounds,
                                      "model": f"LlamaForCausalLM, {args.llama_layers} layers, "
                                               "hidden 64, inputs (2, 64)"})
    return rows


if __name__ == "__main__":
    main()
