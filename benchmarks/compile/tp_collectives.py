"""Tensor-parallel collectives of a training step (issue 63): bytes each rank sends, by dtype.

    python -m benchmarks tp                     # 2 gloo ranks, bf16 and fp16
    python -m benchmarks tp --out /tmp/tp       # somewhere else than docs/benchmarks/

The model is the zoo's ``llama_lm()`` (transformers ``LlamaForCausalLM``, hidden 64, 2 layers,
4 heads, 2 KV heads; random weights), every layer tensor parallel over 2 ranks with torch's
LLaMA plan: q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``; a batch of 2 x 64
tokens, the same on both ranks. Variants: ``fp32``; ``autocast`` (eager, under
``torch.autocast("cpu", dtype)``); ``backend`` (each layer ``torch.compile(layer,
backend="amprewrite", options={"dtype": ..., "inner": "eager"})``). Bytes are the inputs
handed to the functional collectives DTensor's redistributions call
(:func:`amprewrite.compile.sharding.count_collectives`), forward and backward, on rank 0, of
the second step (the first one plans: the backend records the fp32 graph's ranges). Writes
``tp_collectives.json`` / ``.csv`` under ``--out`` (benchmarks.common.save).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..common import RESULTS, save

VARIANTS = ("fp32", "autocast", "backend")
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _measure(mesh, variant: str, dtype: str) -> dict:
    import amprewrite  # noqa: F401  (registers the backend)
    from amprewrite.compile.sharding import count_collectives
    from amprewrite.testing import zoo

    torch._dynamo.reset()
    model = zoo.llama_tp(mesh, {"dtype": dtype, "inner": "eager"} if variant == "backend"
                         else None)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.zero_grad()
        with count_collectives() as sent:
            with torch.autocast("cpu", LOW[dtype], enabled=variant == "autocast"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    row = {"dtype": dtype, "variant": variant, "bytes": sum(sent.values()),
           "loss": float(loss.detach())}
    for (kind, dt), n in sorted(sent.items(), key=str):
        row[f"{kind} {str(dt).replace('torch.', '')}"] = n
    return row


def _worker(rank: int, world: int, init: str, out: str, dtypes: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = [_measure(mesh, v, d) for d in dtypes for v in VARIANTS]
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(LOW))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.pt")
        mp.start_processes(_worker, args=(2, f"file://{tmp}/init", result, args.dtypes),
                           nprocs=2, start_method="spawn")
        rows = torch.load(result)
    for d in args.dtypes:
        fp32 = next(r["bytes"] for r in rows if r["variant"] == "fp32" and r["dtype"] == d)
        autocast = next(r["bytes"] for r in rows if r["variant"] == "autocast"
                        and r["dtype"] == d)
        for r in rows:
            if r["dtype"] == d:
                r["x_fp32"], r["x_autocast"] = r["bytes"] / fp32, r["bytes"] / autocast
    print(f"{'dtype':6} {'variant':9} {'bytes':>9} {'x fp32':>7} {'x autocast':>10} "
          f"{'loss':>8}  by collective and dtype")
    for r in rows:
        kinds = {k: v for k, v in r.items() if " " in k and k[0].isalpha() and k != "x fp32"}
        print(f"{r['dtype']:6} {r['variant']:9} {r['bytes']:9,} {r['x_fp32']:7.3f} "
              f"{r['x_autocast']:10.3f} {r['loss']:8.5f}  {kinds}")
    save("tp_collectives", rows, {"command": "python -m benchmarks tp"}, args.out)
    return rows


if __name__ == "__main__":
    main()
