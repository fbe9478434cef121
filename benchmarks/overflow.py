"""fp16 on models whose fp32 values pass 65504 (amprewrite.testing.overflow), and what recording
ranges costs.

    python -m benchmarks.overflow                 # every case, writes docs/benchmarks/overflow.*
    python -m benchmarks.overflow --cases t5_ff scores --repeats 3

For each case, in fp16 with example inputs and no selector from the user:

- ``fp32_max``: the largest finite magnitude of any fp32 value; ``by_op_type``: whether the plan
  decided by op type alone (no example inputs, ranges unknown) returns finite outputs;
- ``err``: the output error of the default plan (``overflow="auto"``) against fp32 (relative L2,
  the worst output), ``err_by_hand``: the same graph with the overflowing modules kept fp32 by
  hand (``case.by_hand``), and their ratio; ``flops_low``: the share of matmul FLOPs in fp16;
  ``rescaled``: how many matmuls the default rescaled;
- the same for ``overflow="fp32"`` (``_fp32``) and ``overflow="rescale"`` (``_rescale``);
- ``ranges_ms`` / ``transform_ms``: record_ranges' time and the whole transform's (median of
  ``--repeats`` transforms in one process, verification included), and their ratio; the same
  on zoo models (``--zoo``), saved under ``cost``;
- under ``spread`` (``--spread N``, default 4; the overflow cases and the ``--zoo`` models):
  how far a value's largest magnitude moves between the example inputs and N fresh batches
  drawn like them (floats from a normal of the same mean and spread, integers uniform over the
  same range): per value (nodes whose magnitude is at least 1e-3 of the graph's largest), the
  largest magnitude over the fresh batches over the example's; ``max`` and ``p99`` over the
  values. The headroom of 16 below fp16's maximum (amprewrite.precision.ranges.HEADROOM) is meant to
  cover this.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import warnings

import torch

import amprewrite
from amprewrite.capture.verify import float_leaves, rel_err
from amprewrite.testing import overflow
from amprewrite.testing.zoo import call

from .common import save, table


def _error(gm, case) -> float:
    refs = float_leaves(call(case.model, case.inputs))
    return max(rel_err(o, r) for o, r in zip(float_leaves(call(gm, case.inputs)), refs))


def _finite(gm, case) -> bool:
    return all(bool(torch.isfinite(o).all()) for o in float_leaves(call(gm, case.inputs)))


def _fp32_max(gm) -> float:
    """The largest finite magnitude of any fp32 value, as record_ranges saw it."""
    return max((d.range.absmax for d in amprewrite.report(gm).decisions
                if d.range is not None and d.precision != "param"), default=0.0)


def measure(name: str, repeats: int) -> dict:
    case = overflow.CASES[name]()
    row: dict = {"case": name}
    if name in ("t5_ff", "scores", "residual"):  # traceable without inputs: the op-type plan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row["by_op_type"] = "finite" if _finite(
                amprewrite.transform(case.model, "fp16"), case) else "inf/nan"
    hand = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs,
                                keep_fp32=case.by_hand, verify=False)
    row["err_by_hand"] = _error(hand, case)
    for mode in ("auto", "fp32", "rescale"):
        totals, ranges = [], []
        for _ in range(repeats):
            gc.collect()  # a collection of earlier transforms' garbage is not this one's cost
            gm = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs,
                                      overflow=mode)
            timings = amprewrite.report(gm).timings
            totals.append(timings["total"])
            ranges.append(timings.get("record_ranges", 0.0))
        low, total = overflow.matmul_flops(gm)
        key = "" if mode == "auto" else f"_{mode}"
        row[f"finite{key}"] = _finite(gm, case)
        row[f"err{key}"] = _error(gm, case)
        row[f"vs_hand{key}"] = row[f"err{key}"] / row["err_by_hand"] if row["err_by_hand"] else 1.0
        row[f"flops_low{key}"] = low / total if total else 0.0
        if mode == "auto":
            row["rescaled"] = sum(r.pass_name == "rescale_matmuls"
                                  for r in amprewrite.report(gm).rewrites)
            row["fp32_max"] = _fp32_max(gm)
            row["transform_ms"] = statistics.median(totals) * 1e3
            row["ranges_ms"] = statistics.median(ranges) * 1e3
            row["ranges_share"] = row["ranges_ms"] / row["transform_ms"]
    return row


def cost(name: str, repeats: int) -> dict:
    """record_ranges' share of an fp16 transform with example inputs, on a zoo model."""
    from amprewrite.testing import zoo

    model, inputs = zoo.MODELS[name]()
    totals, ranges = [], []
    for _ in range(repeats):
        gc.collect()
        gm = amprewrite.transform(model, "fp16", example_inputs=inputs)
        timings = amprewrite.report(gm).timings
        totals.append(timings["total"])
        ranges.append(timings["record_ranges"])
    total, rec = statistics.median(totals) * 1e3, statistics.median(ranges) * 1e3
    return {"model": name, "nodes": len(gm.graph.nodes), "ranges_ms": rec,
            "transform_ms": total, "ranges_share": rec / total}


def _fresh(inputs, seed: int):
    """A batch drawn like ``inputs``: floats normal with their mean and spread, integers
    uniform over their range, anything else as it is."""
    g = torch.Generator().manual_seed(seed)

    def one(t):
        if not isinstance(t, torch.Tensor) or t.dtype == torch.bool or t.numel() < 2:
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=g) * t.float().std() + t.float().mean()
        lo, hi = int(t.min()), int(t.max())
        return torch.randint(lo, hi + 1, t.shape, generator=g, dtype=t.dtype)

    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return tuple(one(t) for t in inputs)


def _magnitudes(model, inputs) -> dict[str, float]:
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs, verify=False)
    return {d.node: d.range.absmax for d in amprewrite.report(gm).decisions
            if d.range is not None and d.precision != "param"}


def spread(name: str, batches: int, source: str = "overflow") -> dict:
    """How far each value's largest magnitude moves from the example inputs to fresh batches;
    ``source``: ``"overflow"`` (an overflow case) or ``"zoo"`` (a zoo model)."""
    from amprewrite.testing import zoo

    if source == "overflow":
        case = overflow.CASES[name]()
        model, inputs = case.model, case.inputs
    else:
        model, inputs = zoo.MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = _magnitudes(model, inputs)
        others = [_magnitudes(model, _fresh(inputs, seed)) for seed in range(1, batches + 1)]
    floor = 1e-3 * max(base.values())
    ratios = sorted(max(o.get(k, 0.0) for o in others) / v for k, v in base.items()
                    if v >= floor and all(k in o for o in others))
    return {"model": f"{source}:{name}", "values": len(ratios), "max": ratios[-1],
            "p99": ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))], "batches": batches}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(overflow.CASES),
                        choices=list(overflow.CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--zoo", nargs="*", default=["llama", "gpt2", "bert", "resnet", "unet2d"],
                        help="zoo models whose transform time record_ranges is measured against")
    parser.add_argument("--spread", type=int, default=4, metavar="N",
                        help="fresh batches per model for the range spread (0: skip)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.cases:
        rows.append(measure(name, args.repeats))
        print(f"{name}: done", flush=True)
    costs = [cost(name, args.repeats) for name in args.zoo]
    spreads = ([spread(name, args.spread) for name in args.cases]
               + [spread(name, args.spread, "zoo") for name in args.zoo] if args.spread else [])
    save("overflow", rows, {"cost": costs, "spread": spreads})
    if costs:
        print(table(costs, ["model", "nodes", "ranges_ms", "transform_ms", "ranges_share"]))
    if spreads:
        print(table(spreads, ["model", "values", "max", "p99", "batches"]))
    print(table(rows, ["case", "fp32_max", "by_op_type", "finite", "err", "err_by_hand",
                       "vs_hand", "flops_low", "rescaled", "vs_hand_fp32", "flops_low_fp32",
                       "err_rescale", "vs_hand_rescale",
                       "flops_low_rescale", "ranges_ms", "transform_ms", "ranges_share"]))
    return rows


if __name__ == "__main__":
    main()
