"""One plan at scale (DESIGN.md): what the plan per block costs, and fp16 training whose values
outgrow their ranges mid-run.

    python -m benchmarks.one_plan                  # writes docs/benchmarks/one_plan.*
    python -m benchmarks.one_plan --steps 40       # a shorter training run

Rows:

- ``blocks``: amprewrite.testing.scale's four pre-norm MLP blocks (block 2 past fp16's range),
  each compiled with the backend (inner "eager"), fp16, input 4x16x64. The first call (each
  block recorded once; plans made for the blocks that need one) against the same recipe with
  the per-block check off (the plan of the call dynamo compiled on, for every block: what the
  backend did before), each one's output error against fp32 (the unchecked one is not
  finite; ``whole_model_error``: the same model transformed at once); a later call's time
  and what the per-call check (ids of the parameters, a set and a dict lookup) costs of it.
- ``train:<recipe>``: the MLP whose inputs grow 30000x at step 10, Adam, ``--steps`` steps:
  fp32; fp16 autocast with ``torch.amp.GradScaler``; the backend with ``torch.amp.GradScaler``;
  the backend with ``amprewrite.GradScaler``. Mean loss over the run (finite steps), against
  fp32's; non-finite steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import amprewrite
from amprewrite.capture.verify import rel_err
from amprewrite.compile import block_plans as plans
from amprewrite.testing.scale import (
    blocks_model,
    compile_blocks,
    growing_batches,
    growing_mlp,
    train,
)

from .common import save, table

FP16 = {"dtype": "fp16", "inner": "eager"}


def _blocks(watch: bool) -> tuple[torch.nn.Module, float]:
    """A freshly compiled per-block model and its first call's time (s)."""
    torch._dynamo.reset()
    model = compile_blocks(blocks_model(), options=FP16)
    original = plans.GraphPlan.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.watch = self.watch and watch

    plans.GraphPlan.__init__ = init
    try:
        start = time.perf_counter()
        model(_x())
        first = time.perf_counter() - start
    finally:
        plans.GraphPlan.__init__ = original
    return model, first


def _x() -> torch.Tensor:
    return torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(3))


def _check_us(plan: plans.GraphPlan, repeats: int = 20000) -> float:
    """What the per-call check of a watched plan costs (us): the parameters' ids, the seen-set
    test, the plan lookup, the same operations as GraphPlan.__call__ before the compiled call."""
    args = plan.example_inputs
    start = time.perf_counter()
    for _ in range(repeats):
        key = plan._key(args)
        if key in plan.seen:
            plan.assigned.get(key)
    return (time.perf_counter() - start) / repeats * 1e6


def blocks_rows(repeats: int) -> list[dict]:
    x = _x()
    ref = blocks_model()(x)
    rows = []
    for watch in (False, True):  # the watched one last: its plans are the live ones
        firsts = []
        for _ in range(3):
            model, first = _blocks(watch)
            firsts.append(first)
        rows.append({"case": "blocks", "recipe": "per-block plans" if watch else "unchecked",
                     "first_call_s": statistics.median(firsts),
                     "error": rel_err(model(x), ref)})
    later = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        later.append(time.perf_counter() - start)
    row = rows[1]
    row["later_call_ms"] = statistics.median(later) * 1e3
    live = plans.plans_of(model)
    # Four block calls per model call, each through one plan's check.
    row["check_us_per_block"] = statistics.median(_check_us(p) for p in live)
    row["check_share"] = 4 * row["check_us_per_block"] / (row["later_call_ms"] * 1e3)
    whole = blocks_model()
    row["whole_model_error"] = rel_err(
        amprewrite.transform(whole, "fp16", example_inputs=(x,))(x), ref)
    rep = amprewrite.report(model)
    row["plans"] = sum(len(g.plans) for g in rep.graphs)
    row["replans"] = len(rep.replans)
    return rows


def train_rows(steps: int) -> list[dict]:
    batches = growing_batches(steps, shift_at=10)
    rows = []
    for recipe in ("fp32", "autocast", "scaler", "amprewrite"):
        torch._dynamo.reset()
        model = growing_mlp()
        if recipe in ("scaler", "amprewrite"):
            model = torch.compile(model, backend="amprewrite", options=FP16)
        run = train(model, batches, recipe)
        rows.append({"case": f"train:{recipe}", "steps": steps, "nonfinite": run.nonfinite,
                     "mean_loss": run.mean_loss(), "last_loss": run.losses[-1],
                     "seconds": run.seconds})
    fp32 = rows[0]["mean_loss"]
    for row in rows:
        row["mean_vs_fp32"] = row["mean_loss"] / fp32
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--repeats", type=int, default=50,
                        help="timed later calls of each recipe (default 50)")
    args = parser.parse_args(argv)
    rows = blocks_rows(args.repeats)
    print(table(rows, ["case", "recipe", "first_call_s", "later_call_ms",
                       "check_us_per_block", "check_share", "plans", "replans", "error",
                       "whole_model_error"]))
    train = train_rows(args.steps)
    print(table(train, ["case", "steps", "nonfinite", "mean_loss", "mean_vs_fp32",
                        "last_loss", "seconds"]))
    save("one_plan", rows + train)
    return rows + train


if __name__ == "__main__":
    main()
