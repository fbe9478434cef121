"""Per-sample loops: the Python loop, amprewrite's re-rolled graph, and hand-vectorized code.

    python -m benchmarks.loops [--repeats 50] [--batches 64 512]

EffectivePyTorch's batch_gather (``torch.stack([t[i][idx[i]] for i in range(B)])``) on
t (B, 128, 64), idx (B, 32). Eager medians over repeats with the interquartile range, the three
variants timed interleaved (round-robin) so drift affects them alike; then the
first-call (compile) time at the largest B through ``torch.compile(backend="amprewrite")`` and
through plain inductor, with inductor's FX-graph cache off so both really compile, after one
unrelated warm-up compile so neither pays the process's one-time start-up.
Writes docs/benchmarks/loops_<device>.json.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import amprewrite

from .common import interleaved, save, table


class Loop(nn.Module):
    def forward(self, t, idx):
        out = []
        for i in range(t.size(0)):
            out += [t[i][idx[i]]]
        return torch.stack(out)


class Vectorized(nn.Module):
    def forward(self, t, idx):
        return t[torch.arange(t.size(0), device=t.device)[:, None], idx]


def _inputs(b: int, device: str):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(b, 128, 64, generator=g).to(device)
    return t, torch.randint(0, 128, (b, 32), generator=g).to(device)


def _first_call(model, inputs, backend) -> float:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    compiled(*inputs)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    rows = []
    for b in args.batches:
        inputs = _inputs(b, args.device)
        gm = amprewrite.transform(Loop(), dtype=torch.bfloat16, example_inputs=inputs)
        ref = Loop()(*inputs)
        assert torch.equal(gm(*inputs), ref) and torch.equal(Vectorized()(*inputs), ref)
        row = {"device": args.device, "B": b}
        fns = {name: (lambda fn=fn, inputs=inputs: fn(*inputs)) for name, fn in (
            ("loop", Loop()), ("amprewrite", gm), ("hand_vectorized", Vectorized()))}
        for name, (median, iqr) in interleaved(fns, args.repeats, args.device, 3).items():
            row[f"{name}_ms"], row[f"{name}_iqr_ms"] = median, iqr
        row["amprewrite/hand"] = row["amprewrite_ms"] / row["hand_vectorized_ms"]
        row["loop/amprewrite"] = row["loop_ms"] / row["amprewrite_ms"]
        rows.append(row)
        print(table([row], list(row)), flush=True)
    big = max(args.batches)
    inputs = _inputs(big, args.device)
    torch._inductor.config.fx_graph_cache = False
    # Pay dynamo's and inductor's one-time start-up before timing either variant.
    _first_call(Vectorized(), _inputs(4, args.device), "inductor")
    compile_rows = [{"device": args.device, "B": big, "compile": name,
                     "first_call_s": _first_call(Loop(), inputs, backend)}
                    for name, backend in (("amprewrite backend", "amprewrite"),
                                          ("plain inductor", "inductor"))]
    ratio = compile_rows[1]["first_call_s"] / compile_rows[0]["first_call_s"]
    print(table(rows, list(rows[0])))
    print(table(compile_rows, list(compile_rows[0])))
    print(f"plain inductor / amprewrite backend first call: {ratio:.1f}x")
    path = save(f"loops_{args.device}", rows, {
        "compile": compile_rows, "compile_ratio": ratio,
        "command": f"python -m benchmarks.loops --repeats {args.repeats} --batches "
                   f"{' '.join(map(str, args.batches))} --device {args.device}"})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
