"""Transform cost against graph size: capture time, pass time and peak memory per node.

    python -m benchmarks.transform_cost [--blocks 3 10 40 150 560] [--dynamo-blocks 3 40]
                                        [--repeats 3] [--clock cpu|wall]
    python -m benchmarks.transform_cost --compare OTHER_CHECKOUT [--blocks 560] [--repeats 3]
    python -m benchmarks.transform_cost --compare OTHER_CHECKOUT --first-calls [gpt2 llama ...]
                                        [--repeats 5]

A synthetic transformer-style stack (linear, layer norm, softmax attention, GELU MLP, residual
adds, BatchNorm) sized by its number of blocks (3 blocks ~ 100 nodes, 560 ~ 20,000). Each size
is transformed ``--repeats`` times and the run with the least pass + recompile time is kept
(on a shared machine the others are the ones other work slowed down). ``--clock cpu``
(default) times the transform in this process's CPU time, so other processes taking turns on
the cores do not count; ``load_1min`` records the load average. Fits the growth as a power
law (time ~ nodes^k: k = 1 is linear). Peak memory is Python's (tracemalloc), measured in a
further run so it does not slow the timed ones. Writes docs/benchmarks/transform_cost.{json,csv},
with each pass's time per node (``pass_<name>_us_per_node``).

``--compare OTHER_CHECKOUT`` sets two versions of amprewrite side by side on one machine in one
run: one transform of the stack per process (symbolic trace, CPU time), the other checkout's
amprewrite and this one's taking turns ``--repeats`` times, then each step's median per node for
both and their ratio. Figures taken on different machines, or at different loads, are not
comparable; a ratio from one run is. Nothing is saved.

``--first-calls`` (with ``--compare``) times what a user's first transform costs instead: small
Hugging Face models built from configs (no download; ``use_cache=False``, which checkouts
before cache capture need), each transformed once with example inputs in a fresh process (the
other checkout's and this one's taking turns ``--repeats`` times), CPU time: ``import
amprewrite``, the first call (capture, passes, verification, and whatever the package imports
on first use) and their sum. A process pays the sum; where the package imports a module (on
import or on the first call) moves time between the two.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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


@contextlib.contextmanager
def _clock(kind: str):
    """The transform times its steps with ``time.perf_counter``; ``cpu`` makes that clock the
    process's CPU time for the duration of the block."""
    if kind == "wall":
        yield
        return
    wall = time.perf_counter
    time.perf_counter = time.process_time
    try:
        yield
    finally:
        time.perf_counter = wall


def _timed(model: nn.Module, x: torch.Tensor, dynamo: bool, clock: str) -> dict:
    """One transform: the report's timings (seconds) and the graph's sizes."""
    import amprewrite

    gc.collect()
    with _clock(clock):
        start = time.perf_counter()
        gm = amprewrite.transform(model, dtype=torch.bfloat16,
                                  example_inputs=(x,) if dynamo else None, verify=False)
        total = time.perf_counter() - start
    rep = amprewrite.report(gm)
    assert torch.isfinite(gm(x)).all()
    return {"timings": dict(rep.timings), "total": total, "nodes_after": len(gm.graph.nodes),
            "nodes": len(gm.graph.nodes) - len(rep.casts)}


def measure(blocks: int, dynamo: bool, repeats: int = 1, clock: str = "wall") -> dict:
    import amprewrite

    model = Stack(blocks).eval()
    x = torch.randn(2, 8, 16)
    load = os.getloadavg()[0]
    runs = [_timed(model, x, dynamo, clock) for _ in range(repeats)]
    best = min(runs, key=lambda r: sum(v for k, v in r["timings"].items()
                                       if k not in ("capture", "total", "verify")))
    timings = best["timings"]
    capture = timings["capture"]
    recompile = timings.get("recompile", 0.0)  # torch.fx's code generation, once
    per_pass = {k: v for k, v in timings.items()
                if k not in ("capture", "total", "verify", "recompile")}
    passes = sum(per_pass.values())
    captured_nodes = best["nodes"]
    gc.collect()
    tracemalloc.start()
    amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=(x,) if dynamo else None)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "peak_mb": peak / 2**20,
        "load_1min": load,
        "capture": "dynamo" if dynamo else "symbolic_trace",
        "blocks": blocks,
        "nodes": captured_nodes,
        "nodes_after": best["nodes_after"],
        "capture_s": capture,
        "passes_s": passes,
        "recompile_s": recompile,
        "total_s": best["total"],
        "capture_us_per_node": capture / captured_nodes * 1e6,
        "passes_us_per_node": passes / captured_nodes * 1e6,
        "recompile_us_per_node": recompile / captured_nodes * 1e6,
        "passes_recompile_us_per_node": (passes + recompile) / captured_nodes * 1e6,
        **{f"pass_{k}_s": v for k, v in per_pass.items()},
        **{f"pass_{k}_us_per_node": v / captured_nodes * 1e6 for k, v in per_pass.items()},
    }


def _one(blocks: int) -> dict:
    """Each step's time per node (us, CPU time) of one transform, after a warm-up."""
    import amprewrite

    amprewrite.transform(Stack(1), dtype=torch.bfloat16, verify=False)
    run = _timed(Stack(blocks).eval(), torch.randn(2, 8, 16), False, "cpu")
    steps = {k: v / run["nodes"] * 1e6 for k, v in run["timings"].items()
             if k not in ("capture", "total", "verify")}
    return {**steps, "passes + recompile": sum(steps.values())}


def compare(other: Path, blocks: int, repeats: int) -> list[dict]:
    """Interleaved runs of ``other``'s amprewrite and this checkout's: each step's median."""
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as mixed:
        # The other checkout's amprewrite driven by this checkout's benchmark code.
        (Path(mixed) / "amprewrite").symlink_to(other.resolve() / "amprewrite")
        (Path(mixed) / "benchmarks").symlink_to(here / "benchmarks")
        runs: dict[str, list[dict]] = {"other": [], "this": []}
        for _ in range(repeats):
            for name, path in (("other", mixed), ("this", str(here))):
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.transform_cost", "--one", str(blocks)],
                    env={**os.environ, "PYTHONPATH": path}, cwd=path, capture_output=True,
                    text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for step in runs["this"][0]:
        a = statistics.median(r.get(step, 0.0) for r in runs["other"])
        b = statistics.median(r.get(step, 0.0) for r in runs["this"])
        if max(a, b) >= 0.05:
            rows.append({"step": step, "other_us_per_node": a, "this_us_per_node": b,
                         "ratio": b / a if a else float("nan")})
    return rows


# --first-calls: small Hugging Face models, built from configs (no download).
HF_MODELS = ("gpt2", "llama", "bert", "t5", "swin", "vit")


def _hf_model(name: str) -> tuple[nn.Module, object]:
    """A small eval-mode transformers model and its example inputs. ``use_cache=False``: a
    checkout from before amprewrite returned transformers caches cannot capture one."""
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 16))
    small = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4}
    if name == "gpt2":
        model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                               n_positions=128, use_cache=False))
        inputs: object = (ids,)
    elif name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=2,
                                                 vocab_size=1000, use_cache=False,
                                                 max_position_embeddings=128))
        inputs = (ids,)
    elif name == "bert":
        model = T.BertModel(T.BertConfig(**small, vocab_size=1000, max_position_embeddings=128))
        inputs = (ids,)
    elif name == "t5":
        model = T.T5ForConditionalGeneration(T.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
            vocab_size=1000, use_cache=False))
        inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :8], "use_cache": False}
    elif name == "swin":
        model = T.SwinModel(T.SwinConfig(image_size=64, patch_size=4, embed_dim=16,
                                         depths=[1, 1], num_heads=[2, 2], window_size=4))
        inputs = (torch.randn(2, 3, 64, 64),)
    elif name == "vit":
        model = T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, **small))
        inputs = (torch.randn(2, 3, 32, 32),)
    else:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(HF_MODELS)}")
    return model.eval(), inputs


def _first_call(name: str) -> dict:
    """This process's first transform of ``name`` (CPU seconds): ``import amprewrite``, the
    call (with what the package imports on first use), their sum, and the report's steps."""
    model, inputs = _hf_model(name)
    start = time.process_time()
    import amprewrite
    imported = time.process_time() - start
    with _clock("cpu"):
        start = time.perf_counter()
        gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs,
                                  progress=False)
        call = time.perf_counter() - start
    timings = amprewrite.report(gm).timings
    return {"import": imported, "call": call, "import + call": imported + call,
            "capture": timings["capture"], "record_ranges": timings.get("record_ranges", 0.0),
            "verify": timings.get("verify", 0.0)}


def compare_first_calls(other: Path, models: list[str], repeats: int) -> list[dict]:
    """Interleaved fresh processes of ``other``'s amprewrite and this checkout's, per model:
    medians (CPU seconds), the ratio of the sums and how many rounds this one was slower."""
    here = Path(__file__).resolve().parent.parent
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as mixed:
        (Path(mixed) / "amprewrite").symlink_to(other.resolve() / "amprewrite")
        (Path(mixed) / "benchmarks").symlink_to(here / "benchmarks")
        for _ in range(repeats):
            for model in models:
                for name, path in (("other", mixed), ("this", str(here))):
                    out = subprocess.run(
                        [sys.executable, "-m", "benchmarks.transform_cost", "--first-call",
                         model], env={**os.environ, "PYTHONPATH": path}, cwd=path,
                        capture_output=True, text=True, check=True)
                    runs.setdefault((model, name), []).append(
                        json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for model in models:
        a, b = runs[(model, "other")], runs[(model, "this")]
        row: dict[str, object] = {"model": model}
        for step in ("import", "call", "import + call", "capture", "record_ranges"):
            row[f"other {step}"] = statistics.median(r[step] for r in a)
            row[f"this {step}"] = statistics.median(r[step] for r in b)
        row["ratio (sum)"] = row["this import + call"] / row["other import + call"]
        for step in ("import + call", "call"):
            slower = sum(y[step] > x[step] for x, y in zip(a, b))
            row[f"this slower ({step})"] = f"{slower}/{len(a)}"
        rows.append(row)
    return rows


def growth(rows: list[dict], key: str) -> float:
    """Least-squares slope of log(time) against log(nodes): 1.0 is linear growth."""
    pts = [(math.log(r["nodes"]), math.log(r[key])) for r in rows if r[key] > 0]
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[3, 10, 40, 150, 560])
    parser.add_argument("--dynamo-blocks", type=int, nargs="*", default=[3, 40],
                        help="sizes also captured with dynamo (slow: ~6 ms per node)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="transforms per size; the fastest (passes + recompile) is kept")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="time in this process's CPU time (default) or wall-clock time")
    parser.add_argument("--compare", type=Path, metavar="OTHER_CHECKOUT",
                        help="time another checkout's amprewrite against this one, interleaved")
    parser.add_argument("--first-calls", nargs="*", metavar="MODEL",
                        help="with --compare: each process's first transform of small HF "
                        f"models ({', '.join(HF_MODELS)}; default all), import timed apart")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one run, for --compare
    parser.add_argument("--first-call", help=argparse.SUPPRESS)  # one, for --first-calls
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_one(args.one)))
        return
    if args.first_call is not None:
        print(json.dumps(_first_call(args.first_call)))
        return
    if args.compare is not None and args.first_calls is not None:
        models = args.first_calls or list(HF_MODELS)
        repeats = args.repeats if args.repeats != parser.get_default("repeats") else 5
        print(f"{args.compare} (other) against {Path(__file__).resolve().parent.parent} "
              f"(this), first transform per fresh process, {repeats} rounds, CPU s, medians:")
        rows = compare_first_calls(args.compare, models, repeats)
        print(table(rows, list(rows[0])))
        return
    if args.compare is not None:
        blocks = args.blocks[-1] if args.blocks != parser.get_default("blocks") else 560
        print(f"{args.compare} (other) against {Path(__file__).resolve().parent.parent} "
              f"(this), {blocks} blocks, {args.repeats} rounds, CPU time, medians:")
        print(table(compare(args.compare, blocks, args.repeats),
                    ["step", "other_us_per_node", "this_us_per_node", "ratio"]))
        return
    import amprewrite

    amprewrite.transform(Stack(1), dtype=torch.bfloat16)  # warm-up: imports, first trace
    amprewrite.transform(Stack(1), dtype=torch.bfloat16, example_inputs=(torch.randn(2, 8, 16),))
    rows = []
    for dynamo, sizes in ((False, args.blocks), (True, args.dynamo_blocks)):
        for blocks in sizes:
            rows.append(measure(blocks, dynamo, args.repeats, args.clock))
            print(table(rows[-1:], ["capture", "blocks", "nodes", "capture_s", "passes_s",
                                    "peak_mb"]), flush=True)
    fits = {}
    for method in ("symbolic_trace", "dynamo"):
        series = [r for r in rows if r["capture"] == method]
        if len(series) >= 2:
            fits[method] = {"capture_exponent": growth(series, "capture_s"),
                            "passes_exponent": growth(series, "passes_s"),
                            "peak_mb_exponent": growth(series, "peak_mb")}
    cols = ["capture", "blocks", "nodes", "nodes_after", "capture_s", "passes_s", "recompile_s",
            "capture_us_per_node", "passes_us_per_node", "recompile_us_per_node", "peak_mb"]
    print(table(rows, cols))
    for method, fit in fits.items():
        print(f"{method}: time ~ nodes^k with k = {fit['capture_exponent']:.2f} (capture), "
              f"{fit['passes_exponent']:.2f} (passes); peak memory k = "
              f"{fit['peak_mb_exponent']:.2f}")
    path = save("transform_cost", rows, {
        "fits": fits, "clock": args.clock,
        "command": "python -m benchmarks.transform_cost --blocks "
        + " ".join(map(str, args.blocks)) + " --dynamo-blocks "
        + " ".join(map(str, args.dynamo_blocks))
        + f" --repeats {args.repeats} --clock {args.clock}"})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
