"""Compiled runtime and error: fp32, autocast(bf16), model.to(bf16), the amprewrite backend.

    python -m benchmarks.runtime [--repeats 10] [--models cnn llama]

For a BatchNorm + nearest-upsample CNN and a LLaMA-class decoder (transformers, small config):
inference (eval, no_grad) and a training step (forward + backward), each torch.compile'd with
inductor. All variants are compiled first and then timed interleaved, round-robin, so that the
machine's drift affects them alike; medians over repeats with the interquartile range; relative
output error against the fp32 eager model. Writes docs/benchmarks/runtime_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
from torch import nn

from .common import save, table


class CNN(nn.Module):
    def __init__(self, c: int = 32):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.Upsample(scale_factor=2), nn.Conv2d(2 * c, c, 3, padding=1), nn.BatchNorm2d(c),
            nn.ReLU(), nn.Conv2d(c, 3, 1))

    def forward(self, x):
        return self.body(x)


def _cnn(device):
    torch.manual_seed(0)
    return CNN().to(device), (torch.randn(8, 3, 64, 64, device=device),)


def _llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=512, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device), (torch.randint(0, 1024, (4, 128), device=device),)


MODELS = {"cnn": _cnn, "llama": _llama}


def _out(o):
    return o.logits if hasattr(o, "logits") else o


def _variants(model, device):
    def low_inputs(inputs):
        return tuple(i.bfloat16() if i.is_floating_point() else i for i in inputs)

    autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
    return {
        "fp32": (model, contextlib.nullcontext, lambda i: i),
        "autocast_bf16": (model, autocast, lambda i: i),
        "to_bf16": (copy.deepcopy(model).to(torch.bfloat16), contextlib.nullcontext, low_inputs),
        "amprewrite": (model, contextlib.nullcontext, lambda i: i),
    }


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run(name, device, repeats):
    """Compile every variant, then time them interleaved (round-robin), so machine drift
    affects all variants alike; medians and interquartile ranges per variant."""
    model, inputs = MODELS[name](device)
    rows = []
    for training in (False, True):
        model.train(training)
        ref = None
        if not training:
            with torch.no_grad():
                ref = _out(model(*inputs)).float()
        grad_ctx = contextlib.nullcontext if training else torch.no_grad
        steps, results = {}, {}
        for variant, (m, ctx, prep) in _variants(model, device).items():
            m.train(training)
            torch._dynamo.reset()
            compiled = torch.compile(m, backend="amprewrite" if variant == "amprewrite"
                                     else "inductor")

            args = prep(inputs)

            def step(compiled=compiled, ctx=ctx, args=args, training=training):
                with ctx():
                    out = _out(compiled(*args))
                if training:
                    out.float().square().mean().backward()
                return out

            row = {"model": name, "device": device,
                   "task": "train step" if training else "infer", "variant": variant}
            try:
                with grad_ctx():
                    start = time.perf_counter()
                    out = step()
                    _sync(device)
                    row["first_call_s"] = time.perf_counter() - start
                    for _ in range(2):
                        step()
                if ref is not None:
                    row["rel_err_vs_fp32"] = float((out.float() - ref).norm() / ref.norm())
                steps[variant] = step
            except Exception as exc:  # model.to(bf16) fails on some models: record it
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            results[variant] = row
        samples = {v: [] for v in steps}
        with grad_ctx():
            for _ in range(repeats):
                for variant, step in steps.items():
                    _sync(device)
                    start = time.perf_counter()
                    step()
                    _sync(device)
                    samples[variant].append(time.perf_counter() - start)
        for variant, row in results.items():
            if variant in samples:
                q = statistics.quantiles(samples[variant], n=4)
                row["median_ms"] = statistics.median(samples[variant]) * 1e3
                row["iqr_ms"] = (q[2] - q[0]) * 1e3
            rows.append(row)
            print(table([row], list(row)), flush=True)
    base = {r["task"]: r.get("median_ms") for r in rows if r["variant"] == "fp32"}
    for r in rows:
        if r.get("median_ms") and base.get(r["task"]):
            r["vs_fp32"] = r["median_ms"] / base[r["task"]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = [r for name in args.models for r in run(name, args.device, args.repeats)]
    cols = ["model", "task", "variant", "median_ms", "iqr_ms", "vs_fp32", "rel_err_vs_fp32",
            "first_call_s", "error"]
    print(table(rows, cols))
    path = save(f"runtime_{args.device}", rows, {
        "command": f"python -m benchmarks.runtime --repeats {args.repeats} --device {args.device}"
                   f" --models {' '.join(args.models)}"})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
