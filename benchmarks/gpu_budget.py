"""Every GPU figure in one call that fits its budget: python -m benchmarks gpu --budget SECONDS.

    python -m benchmarks gpu                                  # CUDA, GPU sizes, 420 s
    python -m benchmarks gpu --rows '*fp16*'                  # a second window: fp16
    python -m benchmarks gpu --device cpu --tiny --budget 15  # tiny sizes on the CPU

Rows, each one unit of measurement: the kernel probe (``benchmarks.kernel_probe``), the CUDA
tests (``pytest -m cuda``), runtime rows (``benchmarks.runtime``'s models and variants, one row
per model, dtype, task and mode: eager, or compiled, where each variant compiles once and all
are timed interleaved with ``common.interleaved``) and memory rows (``benchmarks.memory``'s zoo
models, eager, with the CUDA peak column). The planner orders them by tier (probes, then the
open questions, then memory, training and fp16) and, within a tier, cheapest first; it runs a
row only if its estimated cost (``COST_S``, scaled up by how much slower than estimated the
rows so far ran) fits in what is left of the budget, and lists every other row as skipped with
the reason. A row that runs past the budget anyway is stopped there (SIGALRM) and recorded as
stopped. The JSON file (default docs/benchmarks/gpu_<device>.json) is rewritten after every
row, so a call cut off by its machine keeps every row measured before.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import fp8, kernel_probe, memory, runtime
from .common import RESULTS, interleaved, machine, table

__all__ = ["COST_S", "FP8_COST_S", "SLACK_S", "OverBudget", "Row", "main", "measure", "plan_rows"]

ROOT = Path(__file__).resolve().parent.parent

# How far past --budget the command may end: the stop lands within a bytecode of the deadline
# (longer inside one C call), then the JSON is written. Python and torch's import (2-5 s) come
# before the clock starts.
SLACK_S = 3.0

# Estimated seconds per row: (tiny on the CPU, GPU sizes on an H100); the dtype does not enter.
# tiny: each row's seconds in one run of `python -m benchmarks gpu --device cpu --tiny --budget
# 1400 --dtypes bf16` on this 2-core CPU (torch 2.13, 2026-11-26, with another test suite
# running), rounded up by about a fifth; compiled rows by more (cnn 14 s measured, 30 s here),
# since the first compiled row of a call pays inductor's start (the UNet's, run first, took
# 161 s) and a fresh machine has no compile cache (a warm one ran the CNN's in 5 s).
# GPU sizes: runtime rows are the first-call seconds (compiles, mostly) summed over the variants
# in docs/benchmarks/runtime_cpu.json (runtime.py's small sizes, this CPU), times 1.0, plus 20
# rounds at the H100 medians of docs/benchmarks.md (under 5 s). 1.0 because the H100 run of
# 2026-11-24 compiled CNN and LLaMA, both dtypes, in its first ~560 s, and the same compiles sum
# to ~565 s here. Memory rows measure the same zoo models at every size and are mostly
# CPU-side work (capture, verification): their tiny seconds. Probe and tests: CUDA start-up
# plus what they take here.
# fp8 rows (benchmarks/fp8.py: one per task and recipe, four variants, compiled). Tiny: the
# first calls (compiles) of `python -m benchmarks fp8 --tiny` on this CPU with a cold cache sum
# to ~35 s (inference) and ~50 s (train step; torchao rowwise's alone 31 s) per recipe's four
# variants, plus two transforms (~10 s) and the rounds (tensorwise float8 is slow here: ~0.3 s
# a call); with a warm inductor cache each row took 15-17 s. GPU sizes (hidden 4096, 2 x 2048
# tokens) not yet measured anywhere: two transforms with the float8 check (~10 s each), four
# compiles at the ~20 s (inference) and ~30 s (train step: torchao's subclass in the backward)
# a variant of the LLaMA runtime rows below, the rounds and the memory pass (under 10 s).
FP8_COST_S: dict[str, tuple[float, float]] = {"infer": (60, 110), "train": (90, 150)}
COST_S: dict[str, tuple[float, float]] = {"infer": (80, 110), "train": (130, 150)}
COST_S: dict[str, tuple[float, float]] = {
    "kernel_probe": (1, 10),
    "cuda_tests": (4, 25),
    "runtime/cnn/infer/eager": (4, 10),
    "runtime/llama/infer/eager": (4, 12),
    "runtime/unet/infer/eager": (17, 20),
    "runtime/cnn/infer/compiled": (30, 30),
    "runtime/llama/infer/compiled": (40, 105),
    "runtime/unet/infer/compiled": (190, 190),
    "runtime/cnn/train/eager": (7, 12),
    "runtime/llama/train/eager": (5, 15),
    "runtime/unet/train/eager": (17, 20),
    "runtime/cnn/train/compiled": (45, 60),
    "runtime/llama/train/compiled": (70, 115),
    "runtime/unet/train/compiled": (260, 530),
    "memory/llama": (5, 5), "memory/mistral": (5, 5), "memory/mixtral": (6, 6),
    "memory/gpt2": (5, 5), "memory/bert": (6, 6), "memory/t5": (13, 13), "memory/vit": (4, 4),
    "memory/whisper": (14, 14), "memory/unet2d": (28, 28), "memory/unet2d_condition": (52, 52),
    "memory/autoencoder_kl": (34, 34), "memory/resnet": (7, 7),
    **{f"fp8/{task}/{recipe}": cost for task, cost in FP8_COST_S.items()
       for recipe in fp8.RECIPES},
}

RUNTIME_MODELS = ("cnn", "llama", "unet")
REPEATS = {"tiny": (2, 1), "gpu": (20, 5)}  # (runtime, memory) rounds


class OverBudget(BaseException):
    """Raised in the main thread at the deadline; a BaseException so that the benchmarks'
    ``except Exception`` (which records a variant's failure and goes on) lets it through."""


@dataclass(frozen=True)
class Row:
    """One unit of the plan: ``run()`` measures it and returns its result rows."""

    name: str
    tier: int
    estimate_s: float
    run: Callable[[], list[dict]]


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # again, should something swallow this one
        raise OverBudget(f"stopped at the budget ({seconds:.0f} s left when it started)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _write(path: Path, doc: dict) -> None:
    """Replace the file whole, so a call killed mid-write leaves the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, path)


def measure(rows: list[Row], budget_s: float, out: Path, header: dict | None = None, *,
            clock: Callable[[], float] = time.perf_counter,
            deadline: Callable[[float], contextlib.AbstractContextManager] = _deadline) -> dict:
    """Run ``rows`` in order within ``budget_s``; rewrite ``out`` after each; return the doc.

    ``clock`` (seconds) and ``deadline(seconds)`` (a context that raises :class:`OverBudget`
    in the row it surrounds once that many seconds of ``clock`` pass) are wall time and
    SIGALRM; a test gives them a clock of its own, so that the plan does not depend on the
    machine's load."""
    start = clock()
    doc = {**(header or {}), "budget_s": budget_s, "slack_s": SLACK_S,
           "plan": [{"row": r.name, "tier": r.tier, "estimate_s": r.estimate_s} for r in rows],
           "rows": [], "skipped": [], "elapsed_s": 0.0, "finished": False}
    _write(out, doc)  # the plan, before any row: a call killed in its first row still says it
    spent = estimated = 0.0
    stopped = False
    for row in rows:
        left = budget_s - (clock() - start)
        # Estimates only grow: rows running slower than the table say the rest will too.
        scale = max(1.0, spent / estimated) if estimated else 1.0
        need = row.estimate_s * scale
        if stopped or need > left:
            # A row larger than the whole budget says so, whatever ran before it.
            reason = (f"needs ~{need:.0f} s, more than the budget of {budget_s:.0f} s"
                      if need > budget_s else "the budget is spent" if stopped
                      else f"needs ~{need:.0f} s, {max(left, 0):.0f} s left")
            doc["skipped"].append({"row": row.name, "estimate_s": need, "reason": reason})
            print(f"== skip {row.name}: {reason}", flush=True)
            continue
        print(f"== {row.name} (~{need:.0f} s of {left:.0f} s left)", flush=True)
        entry: dict = {"row": row.name, "tier": row.tier, "estimate_s": need}
        t0 = clock()
        try:
            with deadline(left):
                entry["results"] = row.run()
            entry["status"] = "ok"
        except OverBudget as exc:
            entry.update(status="stopped", error=str(exc))
            stopped = True
        except Exception as exc:  # one row's failure is a finding; the rest still run
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
        entry["seconds"] = clock() - t0
        spent += entry["seconds"]
        estimated += row.estimate_s
        doc["rows"].append(entry)
        doc["elapsed_s"] = clock() - start
        _write(out, doc)
        print(f"== {row.name}: {entry['status']}, {entry['seconds']:.1f} s", flush=True)
    doc["elapsed_s"] = clock() - start
    doc["finished"] = True
    _write(out, doc)
    return doc


# Tiny versions of runtime.py's three models: the same structure, sizes a CPU test affords.
def _tiny_cnn(device):
    torch.manual_seed(0)
    return runtime.CNN(c=4).to(device), (torch.randn(2, 3, 16, 16, device=device),)


def _tiny_llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device), (torch.randint(0, 64, (2, 8), device=device),)


def _tiny_unet(device):
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(8, 16), norm_num_groups=4,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    return model.to(device), (torch.randn(2, 3, 8, 8, device=device),
                              torch.tensor([10, 900], device=device))


TINY = {"cnn": _tiny_cnn, "llama": _tiny_llama, "unet": _tiny_unet}


def _dynamo_counts() -> dict[str, object]:
    """dynamo's counters now: graph breaks by reason, graphs compiled, frames traced."""
    from torch._dynamo.utils import counters

    return {"breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"]}


def _dynamo_delta(before: dict[str, object]) -> dict[str, object]:
    """What dynamo did since ``before``: graph breaks (count, and the first reason's first
    line), graphs compiled, frames traced: a compiled row's graph-break and recompile log."""
    now = _dynamo_counts()
    breaks = {k: n - before["breaks"].get(k, 0) for k, n in now["breaks"].items()
              if n > before["breaks"].get(k, 0)}
    return {"graph_breaks": sum(breaks.values()),
            "graph_break_reason": next(iter(breaks), "").split("\n")[0][:120],
            "graphs": now["graphs"] - before["graphs"], "frames": now["frames"] - before["frames"]}


def runtime_row(name: str, device: str, dtype: torch.dtype, training: bool, mode: str,
                tiny: bool, repeats: int) -> list[dict]:
    """runtime.run's measurement for one task and one mode: every variant built (compiled
    once), its first call timed, then all timed interleaved; ratios to fp32 and autocast."""
    model, inputs = TINY[name](device) if tiny else runtime.MODELS[name](device, True)
    grad_ctx = contextlib.nullcontext if training else torch.no_grad
    if not training:
        with torch.no_grad():
            ref64 = runtime._out(copy.deepcopy(model).eval().double()(
                *(i.double() if i.is_floating_point() else i for i in inputs))).double()
    model.train(training)
    torch._dynamo.reset()
    variants = runtime._variants(model, inputs, device, dtype, training, modes=(mode,))
    steps, rows = {}, {}
    for (m_mode, variant), (m, ctx, inp) in variants.items():
        if m_mode != mode:
            continue

        def step(m=m, ctx=ctx, inp=inp):
            with ctx():
                out = runtime._out(m(*inp))
            if training:
                out.float().square().mean().backward()
            return out

        row = {"model": name, "device": device, "dtype": str(dtype).replace("torch.", ""),
               "task": "train step" if training else "infer", "mode": mode, "variant": variant}
        try:
            before = _dynamo_counts()
            with grad_ctx():
                t0 = time.perf_counter()
                out = step()
                runtime._sync(device)
                row["first_call_s"] = time.perf_counter() - t0
            if mode == "compiled":  # what the first call compiled (issue 63: the UNet's 1.39x)
                row.update(_dynamo_delta(before))
            if not training:
                row["rel_err_vs_fp64"] = float((out.double() - ref64).norm() / ref64.norm())
            steps[variant] = step
        except Exception as exc:  # model.to(bf16) fails on some models: record why
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
        rows[variant] = row
    before = _dynamo_counts()
    with grad_ctx():
        timings = interleaved(steps, repeats, device, warmup=1)
    if mode == "compiled":  # graphs compiled again during the timed calls (all variants)
        recompiled = _dynamo_delta(before)["graphs"]
        for row in rows.values():
            row["graphs_compiled_while_timed"] = recompiled
    for variant, (ms, iqr) in timings.items():
        rows[variant]["median_ms"], rows[variant]["iqr_ms"] = ms, iqr
    for base in ("fp32", "autocast"):
        if base in timings:
            for variant, (ms, _) in timings.items():
                rows[variant][f"vs_{base}"] = ms / timings[base][0]
    out_rows = list(rows.values())
    print(table(out_rows, [c for c in runtime.COLUMNS if any(c in r for r in out_rows)]),
          flush=True)
    return out_rows


def cuda_tests() -> list[dict]:
    """``pytest -m cuda`` on the test files that carry the marker (skipped without CUDA)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.cuda" in p.read_text())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q",
                           "-p", "no:cacheprovider", *files],
                          cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    print(proc.stdout[-2000:], flush=True)
    return [{"files": files, "returncode": proc.returncode,
             "summary": lines[-1] if lines else proc.stderr[-300:]}]


def fp8_row(task: str, recipe: str, device: str, tiny: bool) -> list[dict]:
    """benchmarks.fp8 for one task and recipe (bf16 amprewrite, autocast, torchao, amprewrite
    fp8; compiled), amprewrite's float8 verdicts on its rows."""
    verdicts: dict = {}
    rows = fp8.run_task(task, "tiny" if tiny else "large", device, [recipe],
                        repeats=REPEATS["tiny" if tiny else "gpu"][0], verdicts=verdicts)
    for row in rows:
        if f"{task}/{row['variant']}" in verdicts:
            row["verdicts"] = verdicts[f"{task}/{row['variant']}"]
    print(table(rows, [c for c in fp8.COLUMNS if any(c in r for r in rows)]), flush=True)
    return rows


def plan_rows(device: str, tiny: bool, dtypes: list[str]) -> list[Row]:
    """Every row, ordered by (tier, estimate): what to measure first when time is short."""
    size = 0 if tiny else 1
    rt_repeats, mem_repeats = REPEATS["tiny" if tiny else "gpu"]
    rows = [Row("kernel_probe", 0, COST_S["kernel_probe"][size],
                lambda: kernel_probe.probe(device)),
            Row("cuda_tests", 0, COST_S["cuda_tests"][size], cuda_tests)]
    for i, dname in enumerate(dtypes):
        dtype = memory.DTYPES[dname]
        for model in RUNTIME_MODELS:
            for task in ("infer", "train"):
                for mode in ("eager", "compiled"):
                    # Tier 1 is what docs/benchmarks.md leaves open (eager overhead, the
                    # compiled UNet at 1.39x): inference; tier 3 training; later dtypes after.
                    open_question = task == "infer" and (mode == "eager" or model == "unet")
                    tier = (1 if open_question else 3) + 3 * i
                    rows.append(Row(
                        f"runtime/{model}/{dname}/{task}/{mode}", tier,
                        COST_S[f"runtime/{model}/{task}/{mode}"][size],
                        lambda m=model, d=dtype, t=task, o=mode: runtime_row(
                            m, device, d, t == "train", o, tiny, rt_repeats)))
        for model in memory.zoo.MODELS:
            rows.append(Row(f"memory/{model}/{dname}", 2 + 3 * i,
                            COST_S[f"memory/{model}"][size],
                            lambda m=model, d=dname: memory.run_model(
                                m, [d], device, mem_repeats, compiled=False)))
    # float8 (issue 38), dtype-free (bf16 against float8): tensorwise, whose train step holds
    # the open goals (docs/benchmarks.md, "float8"), with the open questions in tier 1;
    # rowwise with the bf16 training rows in tier 3.
    for recipe in fp8.RECIPES:
        for task in fp8.TASKS:
            rows.append(Row(f"fp8/{task}/{recipe}", 1 if recipe == "tensorwise" else 3,
                            COST_S[f"fp8/{task}/{recipe}"][size],
                            lambda t=task, r=recipe: fp8_row(t, r, device, tiny)))
    return sorted(rows, key=lambda r: (r.tier, r.estimate_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds the whole call may take (420: a 10-minute call with room "
                             "for the machine's start and the transfers)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models and 2 rounds: the CPU test's sizes")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    parser.add_argument("--rows", nargs="+", default=None, metavar="GLOB",
                        help="only the rows matching one of these (fnmatch: 'runtime/unet/*')")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON file (default docs/benchmarks/gpu_<device>.json)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("python -m benchmarks gpu needs a CUDA device (--device cpu to try it here)",
              file=sys.stderr)
        return 2
    rows = plan_rows(args.device, args.tiny, args.dtypes)
    if args.rows:
        rows = [r for r in rows if any(fnmatch.fnmatch(r.name, g) for g in args.rows)]
    out = args.out or RESULTS / f"gpu_{args.device}.json"
    header = {"machine": machine(),
              "command": " ".join(["python -m benchmarks gpu", *argv]),
              "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": args.device, "sizes": "tiny" if args.tiny else "gpu"}
    doc = measure(rows, args.budget, out, header)
    print(f"{len(doc['rows'])} rows measured, {len(doc['skipped'])} skipped, "
          f"{doc['elapsed_s']:.0f} s of {args.budget:.0f}; saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
