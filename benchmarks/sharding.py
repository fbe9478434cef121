"""FSDP2 communication by recipe (issue 46): bytes all-gathered and reduce-scattered per step
and the loss over ``--steps`` steps, gloo on CPU.

    python -m benchmarks sharding                       # 2 and 4 processes, 100 steps
    python -m benchmarks sharding --worlds 2 --steps 10 --out /tmp/sharding   # a smoke run

The model is transformers' ``LlamaForCausalLM`` from a small config (hidden 128, intermediate
352, 4 layers, 4 heads, 2 KV heads, vocabulary 512; random weights, no download), trained with
AdamW (lr 1e-3) on a fresh batch every step: 8 sequences of 64 tokens (split across the ranks)
walked on a fixed random Markov chain in which each token has 4 equally likely successors. The
model learns the chain rather than memorising sequences: the loss falls from ln 512 = 6.24
towards the chain's entropy, ln 4 = 1.39. Every recipe wraps each decoder layer in
``checkpoint_wrapper`` and shards it, then the root (torchtitan's order). Recipes:

- ``fp32``: fp32 training; ``torch.distributed.fsdp.fully_shard`` without a policy.
- ``torchtitan bf16``: ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32))`` on every block and the root (torchtitan's default); blocks eager.
- ``torchtitan bf16 + float8``: the same, after torchao's ``convert_to_float8_training``
  (tensorwise, ``enable_fsdp_float8_all_gather=True``; ``lm_head`` left out, as torchtitan
  leaves out its output layer) and ``precompute_float8_dynamic_scale_for_fsdp`` after each
  optimizer step (torchtitan's float8 recipe). gloo has no float8 dtype: the float8 buffers
  move as bytes (``amprewrite.compile.sharding.count_comm``'s all-gather).
- ``amprewrite, fp32 gathers``: the guide's recipe before ``amprewrite.fully_shard``: each
  block ``torch.compile(backend="amprewrite", options={"inner": "eager"})``, torch's
  ``fully_shard`` without a policy.
- ``amprewrite bf16``: the same blocks, ``amprewrite.fully_shard`` on each block and the root.
- ``amprewrite bf16 + float8``: the blocks compiled with ``fp8={"recipe": "tensorwise",
  "min_speedup": 0}`` (the cost model off, as torchtitan converts every linear but the head;
  each linear still passes the numerics check) and ``amprewrite.fully_shard(..., fp8=...)``:
  the weights the plan runs in float8 gathered in float8 from the second step (the first
  makes the plan). Its bytes are the last step's.

Bytes are counted in FSDP2's own collectives (``amprewrite.compile.sharding.count_comm``):
all-gather outputs (the unsharded, padded parameters) and reduce-scatter inputs (the gradients), per
rank and step, summed over the step's collectives (a group gathering several dtypes, float8 weights
next to bf16 norms, gathers one uint8 buffer). The loss of a step is averaged over ranks.
``loss_rel_fp32``: the relative difference of the mean loss over the last 10 steps from the
fp32 recipe's (the goal's measure); ``loss_rel_fp32_max_step``: the largest relative
difference of any one step's loss. Writes ``sharding.json`` and ``sharding.csv`` under
``--out`` (benchmarks.common.save); ``--update`` keeps the rows of recipes not run again.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .common import RESULTS, save

RECIPES = ("fp32", "torchtitan bf16", "torchtitan bf16 + float8", "amprewrite, fp32 gathers",
           "amprewrite bf16", "amprewrite bf16 + float8")
FP8 = {"recipe": "tensorwise", "min_speedup": 0}
VOCAB, SEQ, BATCH, SUCCESSORS, LR = 512, 64, 8, 4, 1e-3


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=352,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _prepare(model, recipe: str):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import amprewrite

    if recipe == "amprewrite bf16":
        shard = amprewrite.fully_shard
    elif recipe == "amprewrite bf16 + float8":  # the root is eager: no float8 there
        shard = functools.partial(amprewrite.fully_shard, fp8=FP8)
    elif recipe.startswith("torchtitan"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def shard(m):
            return torch_fully_shard(m, mp_policy=policy)
    else:
        shard = torch_fully_shard
    if recipe == "torchtitan bf16 + float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    layers = model.model.layers
    for name, block in list(layers.named_children()):
        block = checkpoint_wrapper(block)
        if recipe.startswith("amprewrite"):
            options = {"inner": "eager"}
            if recipe.endswith("float8"):
                options.update(dtype="bf16", fp8=FP8)
            block = torch.compile(block, backend="amprewrite", options=options)
        shard(block)
        layers.register_module(name, block)
    shard(model)
    return model


def _batch(step: int) -> torch.Tensor:
    """A fresh batch for ``step``, the same on every rank: walks on the fixed Markov chain."""
    succ = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    pick = torch.randint(0, SUCCESSORS, (BATCH, SEQ), generator=g)
    for t in range(1, SEQ):
        ids[:, t] = succ[ids[:, t - 1], pick[:, t]]
    return ids


def _worker(rank: int, world: int, init: str, out: str, recipe: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        from amprewrite.compile.sharding import count_comm, float8_gathers

        model = _prepare(_model(), recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        if recipe == "torchtitan bf16 + float8":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        losses, per_step = [], []
        start = time.perf_counter()
        for step in range(steps):
            ids = _batch(step)[rank::world]
            with count_comm(model) as comm:
                opt.zero_grad()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                if recipe == "torchtitan bf16 + float8":
                    precompute_float8_dynamic_scale_for_fsdp(model)
            loss = loss.detach()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
            per_step.append(comm)
        seconds = time.perf_counter() - start
        last = per_step[-1]
        if rank == 0:
            with open(out, "w") as f:
                json.dump({
                    "recipe": recipe, "world": world, "steps": steps,
                    "all_gather_bytes": last.total("all_gather"),
                    "all_gather_by_dtype": {str(k).replace("torch.", ""): v
                                            for k, v in last.all_gather.items()},
                    "reduce_scatter_bytes": last.total("reduce_scatter"),
                    "reduce_scatter_by_dtype": {str(k).replace("torch.", ""): v
                                                for k, v in last.reduce_scatter.items()},
                    "first_step_all_gather_bytes": per_step[0].total("all_gather"),
                    "float8_gathered_weights": len(float8_gathers(model)),
                    "same_bytes_every_step": all(
                        (c.all_gather, c.reduce_scatter) == (last.all_gather,
                                                             last.reduce_scatter)
                        for c in per_step[1:]),
                    "losses": losses, "seconds": round(seconds, 1),
                }, f)
    finally:
        dist.destroy_process_group()


def run(recipe: str, world: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), out, recipe, steps),
                 nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sharding", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--float8-steps", type=int, default=2,
                        help="steps of the float8 recipes (CPU float8 matmuls take seconds each: "
                             "their bytes, the same every step from the second, not their loss)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--update", action="store_true",
                        help="keep the rows of <out>/sharding.json for the recipes and worlds "
                             "not run now (each row records the command that made it)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = "python -m benchmarks sharding " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for world in args.worlds:
        for recipe in args.recipes:
            steps = args.float8_steps if recipe.endswith("float8") else args.steps
            row = run(recipe, world, steps)
            row["command"] = command.strip()
            print(f"world {world} {recipe}: {steps} steps in {row['seconds']} s", flush=True)
            rows.append(row)
    old = args.out / "sharding.json"
    if args.update and old.exists():
        ran = {(r["recipe"], r["world"]) for r in rows}
        kept = [r for r in json.loads(old.read_text())["rows"]
                if (r["recipe"], r["world"]) not in ran]
        for r in kept:
            r.setdefault("command", json.loads(old.read_text()).get("command", ""))
        rows = sorted(kept + rows, key=lambda r: (r["world"], RECIPES.index(r["recipe"])))
    _compare(rows)
    save("sharding", rows, out=args.out)
    return rows


def _compare(rows: list[dict]) -> None:
    """Each row against the fp32 recipe and torchtitan's bf16 recipe of its world; printed."""
    for world in sorted({r["world"] for r in rows}):
        by_recipe = {r["recipe"]: r for r in rows if r["world"] == world}
        ref, titan = by_recipe.get("fp32"), by_recipe.get("torchtitan bf16")
        for row in by_recipe.values():
            if ref is not None:
                row["all_gather_vs_fp32"] = round(row["all_gather_bytes"]
                                                  / ref["all_gather_bytes"], 4)
            if ref is not None and row["steps"] == ref["steps"]:
                last, ref_last = (sum(r["losses"][-10:]) / len(r["losses"][-10:])
                                  for r in (row, ref))
                row["loss_last10"] = last
                row["loss_rel_fp32"] = abs(last - ref_last) / ref_last
                row["loss_rel_fp32_max_step"] = max(
                    abs(a - b) / abs(b)
                    for a, b in zip(row["losses"], ref["losses"], strict=True))
            if titan is not None:
                row["all_gather_vs_torchtitan"] = round(row["all_gather_bytes"]
                                                        / titan["all_gather_bytes"], 4)
            print(f"world {world} {row['recipe']:>26} ({row['steps']} steps): all-gather "
                  f"{row['all_gather_bytes']:>9} B"
                  f" ({row.get('all_gather_vs_torchtitan', float('nan')):.4f}x torchtitan), "
                  f"reduce-scatter {row['reduce_scatter_bytes']:>9} B, loss "
                  f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f} "
                  f"(last 10 rel. to fp32 {row.get('loss_rel_fp32', float('nan')):.2e}, max step "
                  f"{row.get('loss_rel_fp32_max_step', float('nan')):.2e}), "
                  f"{row['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
