"""float8 (issue 38): amprewrite's fp8 against bf16 and torchao's own float8 conversion.

    python -m benchmarks fp8                        # CUDA: --size large, compiled, 20 rounds
    python -m benchmarks fp8 --tiny                 # the CPU setting (hidden 64, seq 32)
    python -m benchmarks fp8 --tiny --eager --repeats 2 --out /tmp/fp8   # the test's run

The model is a LLaMA decoder block: transformers' ``LlamaDecoderLayer`` (``--layers`` of them,
one by default) between its rotary embedding and a final ``LlamaRMSNorm``, reading hidden states
(batch, seq, hidden) in fp32, random weights (no download). ``--size large`` is LLaMA-2-7B's
block: hidden 4096, intermediate 11008, 32 heads, on 2 x 2048 tokens (4096 rows per linear);
``--size tiny`` (``--tiny``): hidden 64, intermediate 176, 4 heads, 2 x 32 tokens.

Variants, each for inference (eval, no_grad) and a training step (forward, MSE loss against a
fixed target, backward, ``AdamW.step()``, ``zero_grad``), the model compiled with
``torch.compile(fullgraph=True)`` (``--eager``: not compiled; the optimizer step is eager in
both), every variant on its own deep copy of the same fp32 model (fp32 master weights and fp32
AdamW state everywhere):

- ``bf16 amprewrite``: ``amprewrite.transform(model, torch.bfloat16, example_inputs=...)``;
- ``bf16 autocast``: the fp32 model under ``torch.autocast(device, torch.bfloat16)``;
- ``torchao <recipe>``: ``torchao.float8.convert_to_float8_training(copy, config=
  Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=_auto_filter_for_recipe(recipe,
  filter_fqns=["lm_head"]))`` run under bf16 autocast with its fp32 weights (as amprewrite
  keeps them; torchao's own examples train a bf16 model instead). At ``--size tiny`` that filter
  converts nothing (every linear is under its size thresholds), so there the filter keeps only
  its first rule (K and N divisible by 16) and the row says so;
- ``amprewrite fp8 <recipe>``: ``transform(..., fp8=recipe)``; at ``--size tiny`` with
  ``Float8(recipe, min_speedup=0)``, the cost model off (on tiny sizes nothing pays).

Columns: ``median_ms`` (and ``iqr_ms``) per call or step over interleaved rounds
(``common.interleaved``: every variant once per round in a shuffled order, synchronized on
CUDA), ``speedup`` (bf16 amprewrite's median over this one's), ``peak_mib`` (CUDA only: the
``torch.cuda.max_memory_allocated`` rise during one call or step, measured alone, plus the
variant's own parameters, buffers and optimizer state), ``out_err`` (inference: relative L2
error of the output against the fp32 model on the same inputs), ``loss_err`` and
``loss_after_err`` (training: the relative error of the step's loss, and of the loss after one
AdamW step, against the fp32 model's doing the same from the same weights), ``grad_err``
(training: relative L2 error of all parameter gradients of the first step against fp32's),
``fp8_linears`` / ``linears`` (linears in float8: amprewrite's report verdicts, torchao's
``Float8Linear`` modules) and, for amprewrite, ``fp8_calls`` (the graph's calls of
``amprewrite.precision.float8.graph_linear``, which must equal the report's count) and
``first_call_s`` (the first call: compile). Writes ``fp8_<device>.{json,csv}`` under ``--out``
(default docs/benchmarks/), the json with every amprewrite verdict.

CPU timings say nothing about float8 speed: the CPU emulates float8 matmuls.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import amprewrite
from amprewrite.precision.float8 import Float8

from . import common
from .common import RESULTS, interleaved, table

RECIPES = ("tensorwise", "rowwise")
TASKS = ("infer", "train")
SIZES = {
    "tiny": {"hidden": 64, "intermediate": 176, "heads": 4, "kv_heads": 4, "batch": 2,
             "seq": 32},
    # LLaMA-2-7B's decoder block on 2 x 2048 tokens.
    "large": {"hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32, "batch": 2,
              "seq": 2048},
}
REPEATS = {"tiny": 5, "large": 20}
COLUMNS = ["size", "task", "mode", "variant", "median_ms", "iqr_ms", "speedup", "peak_mib",
           "out_err", "loss_err", "loss_after_err", "grad_err", "fp8_linears", "linears",
           "first_call_s", "error"]
LR = 1e-3


class Decoder(nn.Module):
    """LLaMA decoder layers on hidden states: rotary embedding, ``layers`` blocks, final norm."""

    def __init__(self, cfg, layers: int = 1):
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        super().__init__()
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(x.shape[1], device=x.device)[None]
        pe = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, position_embeddings=pe)
        return self.norm(x)


def build(size: str, device: str, layers: int = 1):
    """(fp32 model, inputs, target) of ``size``, seeded."""
    from transformers import LlamaConfig

    s = SIZES[size]
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=max(s["seq"], 64), use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Decoder(cfg, layers).to(device)
    x = torch.randn(s["batch"], s["seq"], s["hidden"], device=device)
    target = torch.randn(s["batch"], s["seq"], s["hidden"], device=device)
    return model, (x,), target


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _torchao_filter(recipe: str, size: str):
    from torchao.float8 import _auto_filter_for_recipe

    if size != "tiny":
        return _auto_filter_for_recipe(recipe, filter_fqns=["lm_head"]), "auto filter"

    def divisible(mod: nn.Module, fqn: str) -> bool:  # the auto filter's first two rules
        return (isinstance(mod, nn.Linear) and "lm_head" not in fqn
                and mod.weight.shape[0] % 16 == 0 and mod.weight.shape[1] % 16 == 0)

    return divisible, "K, N divisible by 16 (the auto filter converts nothing this small)"


def _amprewrite_counts(gm) -> tuple[int, int, int, dict]:
    """(float8 verdicts in the report, the graph's float8 calls, linears judged, verdicts)."""
    from amprewrite.precision import float8 as f8

    judged = [d for d in amprewrite.report(gm).decisions if getattr(d, "fp8", None)]
    verdicts = {}
    for d in judged:  # by module path; a module called twice: by node too
        key = d.module_path or d.node
        verdicts[key if key not in verdicts else f"{key} ({d.node})"] = d.fp8
    fp8 = sum(d.fp8.startswith("fp8") for d in judged)
    fns = (f8.graph_linear, f8.linear, f8.linear_inference)
    calls = sum(n.op == "call_function" and n.target in fns for n in gm.graph.nodes)
    return fp8, calls, len(judged), verdicts


def variants(model: nn.Module, inputs: tuple, device: str, size: str, training: bool,
             recipes=RECIPES) -> dict[str, dict]:
    """name -> {"module", "ctx", "row" (what to record), "verdicts"}: each on its own copy."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    def auto():
        return torch.autocast(device, dtype=torch.bfloat16)

    def fresh() -> nn.Module:
        return copy.deepcopy(model).train(training)

    none = contextlib.nullcontext
    n_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    out: dict[str, dict] = {}

    def amp(name: str, fp8: object) -> None:
        gm = amprewrite.transform(fresh(), torch.bfloat16, example_inputs=inputs, fp8=fp8)
        row: dict = {}
        if fp8 is not None:
            row["fp8_linears"], row["fp8_calls"], row["linears"], verdicts = (
                _amprewrite_counts(gm))
        else:
            row["fp8_linears"], row["linears"], verdicts = 0, n_linears, {}
        out[name] = {"module": gm, "ctx": none, "row": row, "verdicts": verdicts}

    amp("bf16 amprewrite", None)
    out["bf16 autocast"] = {"module": fresh(), "ctx": auto,
                            "row": {"fp8_linears": 0, "linears": n_linears}}
    for recipe in recipes:
        keep, how = _torchao_filter(recipe, size)
        converted = convert_to_float8_training(
            fresh(), config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
        out[f"torchao {recipe}"] = {
            "module": converted, "ctx": auto,
            "row": {"fp8_linears": sum(isinstance(m, Float8Linear)
                                       for m in converted.modules()),
                    "linears": n_linears, "filter": how}}
        if size == "tiny":
            spec = Float8(recipe, min_speedup=0)
            how = "Float8(min_speedup=0): cost model off"
        else:
            spec, how = recipe, "cost model on (h100)"
        amp(f"amprewrite fp8 {recipe}", spec)
        out[f"amprewrite fp8 {recipe}"]["row"]["filter"] = how
    return out


def _state_bytes(module: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    seen, total = set(), 0
    tensors = [*module.parameters(), *module.buffers()]
    if opt is not None:
        tensors += [v for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def run_task(task: str, size: str = "tiny", device: str = "cpu", recipes=RECIPES,
             repeats: int | None = None, compiled: bool = True, layers: int = 1,
             verdicts: dict | None = None, warmup: int = 1) -> list[dict]:
    """One task's rows: every variant built (and compiled) on the same model and inputs, its
    first call(s) measuring accuracy, then all timed interleaved; ``verdicts`` (if given)
    receives amprewrite's fp8 verdicts per variant."""
    training = task == "train"
    repeats = REPEATS[size] if repeats is None else repeats
    model, inputs, target = build(size, device, layers)
    model.train(training)
    torch._dynamo.reset()
    grad_ctx = contextlib.nullcontext if training else torch.no_grad

    # The fp32 reference, eager: the output, or two steps' losses and the first gradients.
    ref = copy.deepcopy(model)
    if training:
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        losses = []
        for i in range(2):
            loss = F.mse_loss(ref(*inputs).float(), target)
            loss.backward()
            if i == 0:
                ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        ref_losses = losses
    else:
        with torch.no_grad():
            ref_out = ref(*inputs).detach()
    del ref
    _sync(device)

    built = variants(model, inputs, device, size, training, recipes)
    rows, steps = {}, {}
    for name, v in built.items():
        module, ctx = v["module"], v["ctx"]
        row = {"size": size, "task": task, "mode": "compiled" if compiled else "eager",
               "variant": name, **v["row"]}
        if verdicts is not None and v.get("verdicts"):
            verdicts[f"{task}/{name}"] = v["verdicts"]
        fn = torch.compile(module, fullgraph=True) if compiled else module
        opt = torch.optim.AdamW(module.parameters(), lr=LR) if training else None

        def step(fn=fn, ctx=ctx, opt=opt, module=module, keep=None):
            with ctx():
                out = fn(*inputs)
            if not training:
                return out
            loss = F.mse_loss(out.float(), target)
            loss.backward()
            if keep is not None:
                keep.update({n: p.grad.detach().clone() for n, p in module.named_parameters()
                             if p.grad is not None})
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        try:
            with grad_ctx():
                grads: dict = {}
                t0 = time.perf_counter()
                first = step(keep=grads if training else None)
                _sync(device)
                row["first_call_s"] = time.perf_counter() - t0
                if training:
                    second = step()
                    row["loss"] = float(first)
                    row["loss_err"] = abs(float(first) - ref_losses[0]) / abs(ref_losses[0])
                    row["loss_after_err"] = (abs(float(second) - ref_losses[1])
                                             / abs(ref_losses[1]))
                    if set(grads) == set(ref_grads):
                        num = sum(float((grads[n].double() - ref_grads[n].double()).square()
                                        .sum()) for n in grads)
                        den = sum(float(g.double().square().sum()) for g in ref_grads.values())
                        row["grad_err"] = (num / den) ** 0.5
                else:
                    row["out_err"] = _rel(first.float(), ref_out)
            steps[name] = step
            v["opt"] = opt
        except Exception as exc:  # a variant that does not run is a finding: say why
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows[name] = row

    with grad_ctx():
        timings = interleaved(steps, repeats, device, warmup=warmup)
    base = timings.get("bf16 amprewrite", (None,))[0]
    for name, (ms, iqr) in timings.items():
        rows[name]["median_ms"], rows[name]["iqr_ms"] = ms, iqr
        if base:
            rows[name]["speedup"] = base / ms
    if device == "cuda":  # each variant alone: the rise during one call, plus its own state
        for name, step in steps.items():
            with grad_ctx():
                _sync(device)
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                _sync(device)
                rise = torch.cuda.max_memory_allocated() - before
            state = _state_bytes(built[name]["module"], built[name].get("opt"))
            rows[name]["peak_mib"] = (rise + state) / 2**20
    del built, steps
    if device == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def machine(device: str) -> dict:
    import torchao
    import transformers

    return {"date": datetime.date.today().isoformat(),
            "device": (torch.cuda.get_device_name() if device == "cuda"
                       else platform.processor() or platform.machine()),
            "torch": torch.__version__, "torchao": torchao.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "tf32": torch.backends.cuda.matmul.allow_tf32}  # off: the fp32 reference is fp32


def save(out: Path, device: str, rows: list[dict], extra: dict) -> Path:
    return common.save(f"fp8_{device}", rows, extra, out=out, facts=machine(device))


def zoo_rows(names: list[str], recipe: str = "rowwise") -> list[dict]:
    """The chosen set on the zoo models (issue 38: "reported and stable"): each model in eval
    mode on its example inputs, with ``fp8=Float8(recipe, min_speedup=0)`` (the cost model off:
    nothing this small pays) and with ``fp8=recipe`` (the cost model on: an H100), against the
    plain bf16 transform's output error."""
    from amprewrite.capture.verify import float_leaves, rel_err
    from amprewrite.testing import zoo

    builders = {**zoo.MODELS, **zoo.MORE}
    rows = []
    for name in names:
        model, inputs = builders[name]()
        model.eval()
        refs = float_leaves(zoo.call(model, inputs))

        def error(gm, refs=refs, inputs=inputs) -> float:
            return max(rel_err(o, r) for o, r in zip(float_leaves(zoo.call(gm, inputs)), refs))

        row: dict = {"model": name, "recipe": recipe}
        try:
            bf16 = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs)
            off = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs,
                                       fp8=Float8(recipe, min_speedup=0))
            on = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs, fp8=recipe)
        except Exception as exc:  # reported as a row: the table says what failed
            row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            continue
        v = [d.fp8 for d in amprewrite.report(off).decisions if d.fp8]
        kept = sorted({x.split(", ", 2)[-1].split(" (")[0] for x in v if x.startswith("bf16")})
        row.update({
            "candidates": len(v), "fp8": sum(x.startswith("fp8") for x in v),
            "fp8_cost_model_on": sum(d.fp8.startswith("fp8") for d in
                                     amprewrite.report(on).decisions if d.fp8),
            "err_bf16": error(bf16), "err_fp8": error(off), "bf16_reasons": "; ".join(kept)})
        row["err_ratio"] = row["err_fp8"] / row["err_bf16"] if row["err_bf16"] else None
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help="large (default on CUDA) or tiny (default on the CPU)")
    parser.add_argument("--tiny", action="store_true", help="--size tiny")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds (default 20 large, 5 tiny)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls of each variant before the rounds (after the "
                             "first call(s), which compile and measure the errors)")
    parser.add_argument("--eager", action="store_true",
                        help="no torch.compile (the test's setting: compiling takes minutes "
                             "on this CPU)")
    parser.add_argument("--zoo", nargs="*", default=None, metavar="MODEL",
                        help="instead: the chosen set on the zoo models (all without names), "
                             "written to fp8_zoo.{json,csv}")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="directory of fp8_<device>.{json,csv} (default docs/benchmarks)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.device == "cuda" and not cuda:
        parser.error("no CUDA device here: --device cpu (with --tiny) runs the CPU setting")
    warnings.filterwarnings("ignore", message=".*AttentionInterface.*")
    if args.zoo is not None:
        from amprewrite.testing import zoo

        names = args.zoo or [*zoo.MODELS, *zoo.MORE]
        rows = zoo_rows(names, args.recipes[-1] if len(args.recipes) == 1 else "rowwise")
        path = common.save("fp8_zoo", rows, {"command": " ".join(
            ["python -m benchmarks fp8", *argv])}, out=args.out)
        print(table(rows, list(dict.fromkeys(k for r in rows for k in r))))
        print(f"saved {path}")
        return rows
    size = "tiny" if args.tiny else args.size or ("large" if args.device == "cuda" else "tiny")
    rows: list[dict] = []
    verdicts: dict = {}
    for task in args.tasks:
        task_rows = run_task(task, size, args.device, args.recipes, args.repeats,
                             not args.eager, args.layers, verdicts, args.warmup)
        rows += task_rows
        print(table(task_rows, [c for c in COLUMNS if any(c in r for r in task_rows)]),
              flush=True)
    path = save(args.out, args.device, rows, {
        "command": " ".join(["python -m benchmarks fp8", *argv]), "size": size,
        "sizes": SIZES[size], "layers": args.layers, "compiled": not args.eager,
        "repeats": args.repeats or REPEATS[size], "warmup": args.warmup,
        "verdicts": verdicts})
    print(table(rows, [c for c in COLUMNS if any(c in r for r in rows)]))
    print(f"saved {path}")
    return rows


if __name__ == "__main__":
    main()
