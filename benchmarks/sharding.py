"""FSDP2 communication by recipe (issue 46): bytes all-gathered and reduce-scattered per step
and the loss over ``--steps`` steps, gloo on CPU.

    python -m benchmarks sharding                       # 2 and 4 processes, 100 steps
    python -m benchmarks sharding --worlds 2 --steps 10 --out /tmp/sharding   # a smoke run

The model is transformers' ``LlamaForCausalLM`` from a small config (hidden 128, intermediate
352, 4 layers, 4 heads, 2 KV heads, vocabulary 512; random weights, no download), trained on
8 sequences of 64 tokens per step (split across the ranks) drawn from a fixed pool of 32
random sequences (learnable: the loss falls as the model memorises them), with AdamW
(lr 3e-3). Every recipe wraps each decoder layer in ``checkpoint_wrapper`` and shards it, then
the root (torchtitan's order). Recipes:

- ``fp32``: fp32 training; ``torch.distributed.fsdp.fully_shard`` without a policy.
- ``torchtitan bf16``: ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32))`` on every block and the root (torchtitan's default); blocks eager.
- ``amprewrite, fp32 gathers``: the guide's recipe before ``amprewrite.fully_shard``: each
  block ``torch.compile(backend="amprewrite", options={"inner": "eager"})``, torch's
  ``fully_shard`` without a policy.
- ``amprewrite bf16``: the same blocks, ``amprewrite.fully_shard`` on each block and the root.

Bytes are counted in FSDP2's own collectives (``amprewrite.sharding.count_comm``): all-gather
outputs (the unsharded, padded parameters) and reduce-scatter inputs (the gradients), per rank
and step, summed over the step's collectives. ``loss_rel_fp32``: the largest relative
difference of the per-step loss (averaged over ranks) from the fp32 recipe's over all steps.
Writes ``sharding.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
RECIPES = ("fp32", "torchtitan bf16", "amprewrite, fp32 gathers", "amprewrite bf16")
VOCAB, SEQ, BATCH = 512, 64, 8


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
    elif recipe == "torchtitan bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def shard(m):
            return torch_fully_shard(m, mp_policy=policy)
    else:
        shard = torch_fully_shard
    layers = model.model.layers
    for name, block in list(layers.named_children()):
        block = checkpoint_wrapper(block)
        if recipe.startswith("amprewrite"):
            block = torch.compile(block, backend="amprewrite", options={"inner": "eager"})
        shard(block)
        layers.register_module(name, block)
    shard(model)
    return model


def _worker(rank: int, world: int, init: str, out: str, recipe: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        from amprewrite.sharding import count_comm

        model = _prepare(_model(), recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(1)
        pool = torch.randint(0, VOCAB, (32, SEQ), generator=g)
        losses, per_step = [], []
        start = time.perf_counter()
        for _ in range(steps):
            ids = pool[torch.randperm(len(pool), generator=g)[:BATCH]][rank::world]
            with count_comm(model) as comm:
                opt.zero_grad()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
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
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows = []
    for world in args.worlds:
        by_recipe = {}
        for recipe in args.recipes:
            row = run(recipe, world, args.steps)
            by_recipe[recipe] = row
            rows.append(row)
        ref, titan = by_recipe.get("fp32"), by_recipe.get("torchtitan bf16")
        for row in by_recipe.values():
            if ref is not None:
                row["all_gather_vs_fp32"] = round(row["all_gather_bytes"]
                                                  / ref["all_gather_bytes"], 4)
                row["loss_rel_fp32"] = max(abs(a - b) / abs(b) for a, b in
                                           zip(row["losses"], ref["losses"], strict=True))
            if titan is not None:
                row["all_gather_vs_torchtitan"] = round(row["all_gather_bytes"]
                                                        / titan["all_gather_bytes"], 4)
            print(f"world {world} {row['recipe']:>26}: all-gather {row['all_gather_bytes']:>9} B"
                  f" ({row.get('all_gather_vs_torchtitan', float('nan')):.4f}x torchtitan), "
                  f"reduce-scatter {row['reduce_scatter_bytes']:>9} B, loss "
                  f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f} "
                  f"(max rel. to fp32 {row.get('loss_rel_fp32', float('nan')):.2e}), "
                  f"{row['seconds']} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharding.json").write_text(json.dumps(
        {"command": "python -m benchmarks sharding " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
         "torch": torch.__version__, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
