"""Memory of a training step: fp32, autocast and amprewrite on the zoo models.

    python -m benchmarks memory [--models resnet gpt2] [--dtypes bf16 fp16] [--repeats 5]
                                [--device cpu] [--no-compiled] [--name memory_before_cpu]

For every model of ``amprewrite.testing.zoo.MODELS`` (train mode, the zoo's inputs) and each low
dtype, three variants: fp32 (the plain model), autocast (``torch.autocast`` around it) and
amprewrite (``amprewrite.transform(model.train(), dtype, example_inputs=inputs)``, which captures
the train-mode graph and verifies it). Measured per variant:

* saved: the bytes autograd keeps for backward during one training forward, seen by
  ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, leaving out the model's
  parameters and buffers. A low copy of a weight made in the forward is counted (it is memory
  autograd keeps); ``*_wcopy_mb`` says how much of the total such copies are (storages written by
  a dtype conversion whose source is a parameter's or buffer's storage).
* cast: the bytes written by dtype conversions (``aten._to_copy``, ``aten.copy_`` between dtypes,
  ...) in one ``torch.no_grad()`` forward, counted by a ``TorchDispatchMode`` (which sits below
  the autocast key, so it sees autocast's casts too).
* compiled: the bytes the min-cut partitioner (inductor's default) saves for backward after
  ``torch.compile``: the backward graph's non-tangent inputs, summed over the graphs of one
  training step (fw/bw compilers run the graphs as they are; only the partition matters).
* step: an eager training step (forward, ``first_tensor(out).float().pow(2).mean()``, backward),
  autocast and amprewrite timed interleaved (``common.interleaved``): median ms.
* peak (``--device cuda`` only): ``torch.cuda.max_memory_allocated`` over one training step.

MB are 1e6 bytes. fp32 figures do not depend on the dtype: they are measured once per model.
Every model is in train mode throughout (Dropout on, BatchNorm batch statistics), the no-grad
cast count included. Writes docs/benchmarks/<name>.{json,csv} (default memory_<device>).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from itertools import chain

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from amprewrite.testing import zoo

from .common import interleaved, save, table

MB = 1e6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = ("fp32", "autocast", "amprewrite")
CONV_NETS = ("resnet", "unet2d", "unet2d_condition", "autoencoder_kl")
CAST_GOAL_MODELS = ("resnet", "unet2d", "autoencoder_kl")
_aten = torch.ops.aten
_CAST_OPS = {_aten._to_copy, _aten.to, _aten.copy_, _aten.copy,
             _aten._autocast_to_reduced_precision, _aten._autocast_to_full_precision}


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _param_ptrs(*modules) -> set[int]:
    return {t.untyped_storage().data_ptr()
            for m in modules for t in chain(m.parameters(), m.buffers())}


class CastCounter(TorchDispatchMode):
    """Counts the bytes written by dtype conversions; remembers the storages of weight copies.

    A weight copy is the output of a conversion whose source lives in ``param_ptrs`` (a
    parameter's or buffer's storage, or a view of one) or in an earlier weight copy. The copies
    are kept alive while the mode is, so a freed address cannot be mistaken for one.
    """

    def __init__(self, param_ptrs: set[int] = frozenset()):
        super().__init__()
        self.param_ptrs = param_ptrs
        self.bytes = 0
        self.count = 0
        self.ops: dict[str, int] = {}
        self.weight_copies: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in _CAST_OPS and isinstance(out, torch.Tensor) and args:
            if func.overloadpacket in (_aten.copy_, _aten.copy):
                src = args[1]
            else:
                src = args[0]
            if isinstance(src, torch.Tensor) and src.dtype != out.dtype:
                self.bytes += out.numel() * out.element_size()
                self.count += 1
                name = str(func.overloadpacket).replace("aten.", "")
                self.ops[name] = self.ops.get(name, 0) + 1
                ptr = src.untyped_storage().data_ptr()
                if ptr in self.param_ptrs or ptr in self.weight_copies:
                    self.weight_copies[out.untyped_storage().data_ptr()] = out
        return out


def _loss(out: object) -> torch.Tensor:
    return zoo.first_tensor(out).float().pow(2).mean()


def _train_step(model, m, ctx, inputs):
    """One training step of ``m`` (the model, autocast or amprewrite's graph) under ``ctx``."""
    def step():
        _clear_grads(model)
        with ctx():
            out = zoo.call(m, inputs)
        _loss(out).backward()
    return step


def _clear_grads(*modules) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def saved_bytes(module, ctx, inputs, param_ptrs: set[int]) -> tuple[int, int]:
    """(bytes autograd saves in one training forward, of which weight copies)."""
    seen: dict[tuple[int, int], torch.Tensor] = {}

    def pack(t):
        key = _storage_key(t)
        if key[0] not in param_ptrs:
            seen.setdefault(key, t)
        return t

    counter = CastCounter(param_ptrs)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with counter, ctx():
            out = zoo.call(module, inputs)
    del out  # frees the autograd graph and, with it, the saved tensors
    total = sum(k[1] for k in seen)
    copies = sum(k[1] for k in seen if k[0] in counter.weight_copies)
    seen.clear()
    return total, copies


def cast_bytes(module, ctx, inputs) -> tuple[int, dict[str, int]]:
    counter = CastCounter()
    with torch.no_grad(), counter, ctx():
        zoo.call(module, inputs)
    return counter.bytes, counter.ops


def compiled_saved_bytes(module, ctx, inputs) -> dict:
    """What min_cut_rematerialization_partition saves for backward, over one training step."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: list[tuple[int, int]] = []

    def partition(joint, joint_inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        total = primals = 0
        for node in bw.graph.nodes:
            if node.op != "placeholder" or node.name.startswith("tangents"):
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                nbytes = int(val.numel()) * val.element_size()
                total += nbytes
                primals += nbytes if node.name.startswith("primals") else 0
        graphs.append((total, primals))
        return fw, bw

    def compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition)
    compiled = torch.compile(module, backend=backend, dynamic=False)
    start = time.perf_counter()
    with ctx():
        out = zoo.call(compiled, inputs)
    _loss(out).backward()
    seconds = time.perf_counter() - start
    torch._dynamo.reset()
    return {"bytes": sum(g[0] for g in graphs), "primal_bytes": sum(g[1] for g in graphs),
            "graphs": len(graphs), "seconds": seconds}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(step, device: str) -> int:
    _sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    _sync(device)
    return torch.cuda.max_memory_allocated()


def _error(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"error: {type(exc).__name__}: {first[:80]}"


def _to(inputs, device: str):
    def one(a):
        return a.to(device) if isinstance(a, torch.Tensor) else a

    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return tuple(one(a) for a in inputs)


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def run_model(name: str, dtypes: list[str], device: str, repeats: int, compiled: bool
              ) -> list[dict]:
    model, inputs = zoo.MODELS[name]()
    model = model.to(device).train()
    inputs = _to(inputs, device)
    none = contextlib.nullcontext
    fp32: dict[str, object] = {}
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        row: dict[str, object] = {"model": name, "dtype": dname}
        start = time.perf_counter()

        def auto(dtype=dtype):
            return torch.autocast(device, dtype=dtype)

        variants: dict[str, tuple] = {"fp32": (model, none), "autocast": (model, auto)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                gm = amprewrite.transform(model.train(), dtype=dtype, example_inputs=inputs)
                variants["amprewrite"] = (gm, none)
            except Exception as exc:
                row["transform_error"] = _error(exc)
        row["transform_s"] = time.perf_counter() - start
        if caught:
            row["warnings"] = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}"
                                      for w in caught})
        ptrs = _param_ptrs(model, *(m for m, _ in variants.values()))

        for variant, (m, ctx) in variants.items():
            if variant == "fp32" and "saved" in fp32:
                continue
            try:
                total, copies = saved_bytes(m, ctx, inputs, ptrs)
                out = (total / MB, copies / MB)
            except Exception as exc:
                out = (_error(exc), None)
            _clear_grads(model)
            if variant == "fp32":
                fp32["saved"] = out
            else:
                row[f"saved_{variant}_mb"], row[f"wcopy_{variant}_mb"] = out
        row["saved_fp32_mb"] = fp32["saved"][0]
        for variant in ("autocast", "amprewrite"):
            if variant in variants:
                m, ctx = variants[variant]
                try:
                    nbytes, ops = cast_bytes(m, ctx, inputs)
                    row[f"cast_{variant}_mb"] = nbytes / MB
                    row[f"cast_{variant}_ops"] = ops
                except Exception as exc:
                    row[f"cast_{variant}_mb"] = _error(exc)

        if compiled:
            for variant, (m, ctx) in variants.items():
                if variant == "fp32" and "compiled" in fp32:
                    continue
                try:
                    res = compiled_saved_bytes(m, ctx, inputs)
                    cell = res["bytes"] / MB
                    row[f"compiled_{variant}_s"] = res["seconds"]
                    row[f"compiled_{variant}_graphs"] = res["graphs"]
                    row[f"compiled_{variant}_primals_mb"] = res["primal_bytes"] / MB
                except Exception as exc:
                    cell = _error(exc)
                    torch._dynamo.reset()
                _clear_grads(model)
                if variant == "fp32":
                    fp32["compiled"] = cell
                else:
                    row[f"compiled_{variant}_mb"] = cell
            row["compiled_fp32_mb"] = fp32["compiled"]

        steps = {}
        for variant in ("autocast", "amprewrite"):
            if variant not in variants:
                continue
            step = _train_step(model, *variants[variant], inputs)
            try:
                step()
                steps[variant] = step
            except Exception as exc:
                row[f"step_{variant}_ms"] = _error(exc)
        for variant, (ms, iqr) in interleaved(steps, repeats, device, warmup=1).items():
            row[f"step_{variant}_ms"], row[f"step_{variant}_iqr_ms"] = ms, iqr
        if device == "cuda":
            for variant, (m, ctx) in variants.items():
                try:
                    row[f"peak_{variant}_mb"] = peak_bytes(_train_step(model, m, ctx, inputs),
                                                           device) / MB
                except Exception as exc:
                    row[f"peak_{variant}_mb"] = _error(exc)
        _clear_grads(model)

        for kind in ("saved", "cast", "compiled", "step", "peak"):
            unit = "ms" if kind == "step" else "mb"
            amp, aut = row.get(f"{kind}_amprewrite_{unit}"), row.get(f"{kind}_autocast_{unit}")
            if (r := _ratio(amp, aut)) is not None:
                row[f"{kind}_vs_autocast"] = r
        if (r := _ratio(row.get("saved_amprewrite_mb"), row["saved_fp32_mb"])) is not None:
            row["saved_vs_fp32"] = r
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(table([row], [c for c in columns(device, compiled) if c in row]), flush=True)
    return rows


def columns(device: str, compiled: bool) -> list[str]:
    cols = ["model", "dtype", "saved_fp32_mb", "saved_autocast_mb", "saved_amprewrite_mb",
            "saved_vs_autocast", "saved_vs_fp32", "wcopy_autocast_mb", "wcopy_amprewrite_mb",
            "cast_autocast_mb", "cast_amprewrite_mb", "cast_vs_autocast"]
    if compiled:
        cols += ["compiled_autocast_mb", "compiled_amprewrite_mb", "compiled_vs_autocast"]
    cols += ["step_autocast_ms", "step_amprewrite_ms", "step_vs_autocast"]
    if device == "cuda":
        cols += ["peak_fp32_mb", "peak_autocast_mb", "peak_amprewrite_mb", "peak_vs_autocast"]
    return [*cols, "transform_error"]


def _goal(rows, keys, limit, models=None) -> str:
    worst, missing = None, []
    for r in rows:
        if models is not None and r["model"] not in models:
            continue
        for key in keys:
            v = r.get(key)
            if not isinstance(v, float):
                missing.append(f"{r['model']} {r['dtype']}")
                continue
            if worst is None or v > worst[0]:
                worst = (v, r["model"], r["dtype"], key)
    if worst is None:
        return "n/a (nothing measured)"
    verdict = "met" if worst[0] <= limit else "missed"
    text = f"{verdict} (worst: {worst[1]} {worst[2]} {worst[0]:.2f}x, {worst[3]})"
    if missing:
        text += f"; not measured: {', '.join(sorted(set(missing)))}"
    return text


def goals(rows: list[dict], compiled: bool) -> dict[str, str]:
    saved_keys = ["saved_vs_autocast"] + (["compiled_vs_autocast"] if compiled else [])
    return {
        "saved <= 1.0x autocast, every model and dtype (eager"
        + (" and compiled)" if compiled else ")"): _goal(rows, saved_keys, 1.0),
        "resnet saved <= 0.6x fp32": _goal(rows, ["saved_vs_fp32"], 0.6, ("resnet",)),
        f"eager cast bytes <= 1.0x autocast on {'/'.join(CAST_GOAL_MODELS)}":
            _goal(rows, ["cast_vs_autocast"], 1.0, CAST_GOAL_MODELS),
        f"eager step <= 1.0x autocast on conv nets ({'/'.join(CONV_NETS)})":
            _goal(rows, ["step_vs_autocast"], 1.0, CONV_NETS),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks memory",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(zoo.MODELS), choices=list(zoo.MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compiled", dest="compiled", action="store_false",
                        help="skip the compiled (min-cut partition) column, the slow part")
    parser.add_argument("--compiled-models", nargs="+", default=None, choices=list(zoo.MODELS),
                        help="measure the compiled column on these models only")
    parser.add_argument("--name", default=None, help="result files' name (memory_<device>)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for name in args.models:
        compiled = args.compiled and (args.compiled_models is None
                                      or name in args.compiled_models)
        rows += run_model(name, args.dtypes, args.device, args.repeats, compiled)
    rows.sort(key=lambda r: (args.dtypes.index(r["dtype"]), args.models.index(r["model"])))
    cols = [c for c in columns(args.device, args.compiled) if any(c in r for r in rows)]
    print(table(rows, cols))
    summary = goals(rows, args.compiled)
    for goal, verdict in summary.items():
        print(f"{goal}: {verdict}")
    seconds = time.perf_counter() - start
    print(f"{seconds:.0f} s")
    name = args.name or f"memory_{args.device}"
    command = (f"python -m benchmarks memory --models {' '.join(args.models)} --dtypes "
               f"{' '.join(args.dtypes)} --repeats {args.repeats} --device {args.device}"
               + ("" if args.compiled else " --no-compiled")
               + (f" --compiled-models {' '.join(args.compiled_models)}"
                  if args.compiled and args.compiled_models else "")
               + (f" --name {args.name}" if args.name else ""))
    path = save(name, rows, {"command": command, "goals": summary, "seconds": seconds})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
