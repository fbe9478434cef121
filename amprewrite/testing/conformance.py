"""The real-model conformance check: one model of :mod:`amprewrite.testing.zoo`, one dtype.

:func:`conform` builds the model, transforms it with its example inputs, and measures the output
error against the fp32 model next to ``torch.autocast``'s and ``model.to(dtype)``'s on the same
inputs, new non-finite values, ``torch.compile(gm, fullgraph=True)`` and the report. The tests
(tests/models/test_conformance.py) assert on its row; ``python -m benchmarks.conformance`` prints
the rows and writes docs/models.md with :func:`markdown`.
"""

from __future__ import annotations

import copy
import time
import traceback

import torch

import amprewrite

from ..show.numerics import float_leaves, rel_err
from .zoo import AUTOCAST_TWIN, LIBRARY, MODELS, call, cast_inputs

__all__ = ["DRAWS", "DTYPES", "NOISE", "conform", "draws", "fmt", "markdown"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Errors are pooled over DRAWS input batches: the example inputs and more drawn like them. Where
# amprewrite keeps more in fp32 than CPU autocast (BatchNorm outputs and residual adds, GroupNorm)
# the two errors differ by rounding noise: on the ResNet at batch 2 the per-batch ratio has a
# standard deviation of 0.15 (30 draws), at batch 256 it stays within 0.99-1.01. The test allows
# NOISE above autocast's pooled error; the matrix prints the exact ratio.
DRAWS = 16
NOISE = 0.05


def draws(inputs, count: int = DRAWS) -> list:
    """``inputs`` followed by ``count - 1`` more of the same shapes: floats from randn (scaled to
    the example's std and mean), integers uniform over the example's range (token ids, timesteps).
    """
    def one(a):
        if not isinstance(a, torch.Tensor):
            return a
        if a.is_floating_point():
            return torch.randn_like(a) * a.std() + a.mean()
        return torch.randint(int(a.min()), int(a.max()) + 1, a.shape, dtype=a.dtype)

    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(1234)
        more = [({k: one(v) for k, v in inputs.items()} if isinstance(inputs, dict)
                 else tuple(one(a) for a in inputs)) for _ in range(count - 1)]
    return [inputs, *more]


def _leaves(outputs: list) -> list[torch.Tensor]:
    """Each floating-point output, concatenated over the draws (float64)."""
    per_draw = [float_leaves(o) for o in outputs]
    return [torch.cat([d[i].detach().double().flatten() for d in per_draw])
            for i in range(len(per_draw[0]))]


def _error(outs: list, refs: list) -> float:
    """Largest relative L2 error over the floating-point outputs, pooled over the draws."""
    return max(rel_err(o, r) for o, r in zip(_leaves(outs), _leaves(refs)))


def _new_nonfinite(outs: list, refs: list) -> bool:
    return any(bool((~torch.isfinite(o) & torch.isfinite(r)).any())
               for o, r in zip(_leaves(outs), _leaves(refs)))


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def conform(name: str, dtype: torch.dtype, compile: bool = True) -> dict[str, object]:
    """One row of the matrix: build the model, transform it, measure, compile."""
    model, inputs = MODELS[name]()
    before = {k: (v.dtype, v.detach().clone()) for k, v in model.state_dict().items()}
    row: dict[str, object] = {
        "model": name, "library": LIBRARY.get(name, "transformers"), "class": type(model).__name__,
        "dtype": str(dtype).replace("torch.", ""),
        "params": sum(p.numel() for p in model.parameters())}
    batches = draws(inputs)
    with torch.no_grad():
        ref = [call(model, b) for b in batches]
        twin = AUTOCAST_TWIN[name](model) if name in AUTOCAST_TWIN else model
        with torch.autocast("cpu", dtype=dtype):
            row["err_autocast"] = _error([call(twin, b) for b in batches], ref)
            if twin is not model:  # autocast on the model as given, for the record
                row["err_autocast_as_given"] = _error([call(model, b) for b in batches], ref)
        try:
            low_model = copy.deepcopy(model).to(dtype)
            low = [call(low_model, cast_inputs(b, dtype)) for b in batches]
            row["err_to_dtype"] = _error(low, ref)
        except Exception as exc:  # the baseline crashing is a finding, not a failure
            row["err_to_dtype"] = None
            row["to_dtype_error"] = _short(exc)
    start = time.perf_counter()
    try:
        gm = amprewrite.transform(model, dtype=dtype, example_inputs=inputs)
    except Exception as exc:
        row["transform_error"] = _short(exc)
        row["traceback"] = traceback.format_exc()
        return row
    row["transform_s"] = round(time.perf_counter() - start, 2)
    after = model.state_dict()
    row["model_unchanged"] = before.keys() == after.keys() and all(
        after[k].dtype == d and torch.equal(after[k], v) for k, (d, v) in before.items())
    rep = amprewrite.report(gm)
    counts = rep.counts()
    row.update(nodes=len(gm.graph.nodes), casts=len(rep.casts), fp32_nodes=counts.get("fp32", 0),
               low_nodes=counts.get("low", 0), report=bool(str(rep)))
    with torch.no_grad():
        out = [call(gm, b) for b in batches]
    row["err_amprewrite"] = _error(out, ref)
    row["ratio_to_autocast"] = row["err_amprewrite"] / max(row["err_autocast"], 1e-30)
    row["new_nonfinite"] = _new_nonfinite(out, ref)
    row["output_dtypes_match"] = [o.dtype for o in float_leaves(out[0])] == [
        r.dtype for r in float_leaves(ref[0])]
    if compile:
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            fn = torch.compile(gm, fullgraph=True)
            with torch.no_grad():
                compiled = [call(fn, b) for b in batches]
            row["compile"] = "ok"
            row["err_compiled"] = _error(compiled, ref)
            row["compiled_nonfinite"] = _new_nonfinite(compiled, ref)
        except Exception as exc:
            row["compile"] = _short(exc)
        row["compile_s"] = round(time.perf_counter() - start, 1)
        torch._dynamo.reset()
    return row


def fmt(value: object) -> str:
    if value is None:
        return "crash"
    if isinstance(value, float):
        return f"{value:.2e}"
    return str(value)


def markdown(data: dict) -> str:
    """docs/models.md from the saved JSON."""
    m = data["machine"]
    lines = [
        "# Real-model conformance",
        "",
        "<!-- generated by `python -m benchmarks.conformance`; do not edit by hand -->",
        "",
        "Every model is built from a small config with random weights (amprewrite/testing/zoo.py), "
        "transformed with `example_inputs` and compared with the fp32 model on the same inputs. "
        f"Error is the largest relative L2 error over the floating-point outputs, pooled over "
        f"{data.get('draws', DRAWS)} input batches (the example inputs and more drawn like them); "
        "`ratio` is "
        "amprewrite's error over `torch.autocast(\"cpu\")`'s. `to(dtype)` casts the model and its "
        "float inputs. `compile` is `torch.compile(gm, fullgraph=True)` (inductor) and its error.",
        "",
        f"Measured {m['date']}, torch {m['torch']}, {m['cores']} cores"
        f"{', ' + m['cuda'] if m.get('cuda') else ' (CPU)'}.",
        "",
        "| model | library | dtype | nodes | casts | fp32 nodes | amprewrite | autocast | ratio "
        "| to(dtype) | new NaN/inf | compile | compiled error | transform s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in data["rows"]:
        if "transform_error" in r:
            lines.append(f"| {r['model']} | {r['library']} | {r['dtype']} | transform failed: "
                         f"{r['transform_error']} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['model']} | {r['library']} | {r['dtype']} | {r['nodes']} | {r['casts']} "
            f"| {r['fp32_nodes']} | {fmt(r['err_amprewrite'])} | {fmt(r['err_autocast'])} "
            f"| {r['ratio_to_autocast']:.3f} | {fmt(r['err_to_dtype'])} "
            f"| {'yes' if r['new_nonfinite'] else 'no'} | {r.get('compile', 'not run')} "
            f"| {fmt(r.get('err_compiled', '-'))} | {r['transform_s']} |")
    done = [r for r in data["rows"] if "transform_error" not in r]
    if done:
        ratios = sorted(r["ratio_to_autocast"] for r in done)
        lines += ["", f"{len(done)} of {len(data['rows'])} rows transformed; "
                  f"{sum(not r['new_nonfinite'] for r in done)} without new NaN/inf; "
                  f"{sum(r.get('compile') == 'ok' for r in done)} compiled with fullgraph=True. "
                  f"Error ratio to autocast: {ratios[0]:.3f} to {ratios[-1]:.3f} (median "
                  f"{ratios[len(ratios) // 2]:.3f}); the tests allow {1 + NOISE:.2f} (rounding "
                  "noise, see [testing.md](testing.md)). A ratio of exactly 1.000 means the "
                  "same ops ran in low precision as under CPU autocast; below 1, amprewrite "
                  "kept more in fp32 (GroupNorm, which CPU autocast runs in low precision; "
                  "residual adds after a norm)."]
    twins = [r for r in data["rows"] if r.get("err_autocast_as_given") is not None]
    if twins:
        lines += ["", "Autocast is measured where it reaches the same ops as amprewrite "
                  "(amprewrite/testing/zoo.py, `AUTOCAST_TWIN`): "
                  + "; ".join(f"{r['model']} {r['dtype']}: {fmt(r['err_autocast'])} with "
                              f"transformers' eager experts, {fmt(r['err_autocast_as_given'])} "
                              "with the `grouped_mm_fallback` custom op, whose matmuls autocast "
                              "runs in fp32" for r in twins) + "."]
    crashes = [r for r in data["rows"] if r.get("to_dtype_error")]
    if crashes:
        lines += ["", "`model.to(dtype)` crashed on:", ""]
        lines += [f"- {r['model']} {r['dtype']}: `{r['to_dtype_error']}`" for r in crashes]
    return "\n".join(lines) + "\n"
