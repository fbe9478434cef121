"""Transform cost against graph size: capture time and pass time per node.

    python -m benchmarks.transform_cost [--blocks 12 120] [--dynamo]

A synthetic transformer-style stack (linear, layer norm, softmax attention, GELU MLP, residual
adds) sized by its number of blocks; prints a table and writes docs/benchmarks/transform_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import amprewrite

from .common import save, table


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        x = x + self.out(att @ v)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class Stack(nn.Module):
    def __init__(self, blocks: int, d: int = 16):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x)


def measure(blocks: int, dynamo: bool) -> dict:
    model = Stack(blocks).eval()
    x = torch.randn(2, 8, 16)
    gc.collect()
    start = time.perf_counter()
    gm = amprewrite.transform(model, dtype=torch.bfloat16,
                              example_inputs=(x,) if dynamo else None)
    total = time.perf_counter() - start
    rep = amprewrite.report(gm)
    capture = rep.timings["capture"]
    passes = sum(v for k, v in rep.timings.items() if k not in ("capture", "total"))
    captured_nodes = len(gm.graph.nodes) - len(rep.casts)
    assert torch.isfinite(gm(x)).all()
    return {
        "capture": "dynamo" if dynamo else "symbolic_trace",
        "blocks": blocks,
        "nodes": captured_nodes,
        "nodes_after": len(gm.graph.nodes),
        "capture_s": capture,
        "passes_s": passes,
        "total_s": total,
        "capture_us_per_node": capture / captured_nodes * 1e6,
        "passes_us_per_node": passes / captured_nodes * 1e6,
        **{f"pass_{k}_s": v for k, v in rep.timings.items() if k not in ("capture", "total")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[12, 120])
    parser.add_argument("--dynamo", action="store_true", help="also measure dynamo capture")
    args = parser.parse_args()
    amprewrite.transform(Stack(1), dtype=torch.bfloat16)  # warm-up: imports, first trace
    rows = []
    for dynamo in ([False, True] if args.dynamo else [False]):
        for blocks in args.blocks:
            rows.append(measure(blocks, dynamo))
            print(table(rows[-1:], ["capture", "blocks", "nodes", "capture_s", "passes_s"]),
                  flush=True)
    cols = ["capture", "blocks", "nodes", "nodes_after", "capture_s", "passes_s",
            "capture_us_per_node", "passes_us_per_node"]
    print(table(rows, cols))
    path = save("transform_cost", rows, {"command": "python -m benchmarks.transform_cost "
                                         + " ".join(f"--blocks {b}" for b in args.blocks)})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
