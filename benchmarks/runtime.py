"""Runtime and error: fp32, autocast(bf16), model.to(bf16), amprewrite transform and backend.

    python -m benchmarks.runtime [--repeats 20] [--models cnn llama unet] [--device cpu]

Three models — a BatchNorm + nearest-upsample CNN, a LLaMA-class decoder (transformers) and a
diffusers UNet2DModel, small configs — for inference (eval, no_grad) and a training step
(forward + backward), eager and torch.compile'd (inductor). Variants: fp32, autocast(bf16),
``model.to(bf16)`` (where it runs), ``amprewrite.transform`` (eager; then torch.compile of the
GraphModule) and ``torch.compile(backend="amprewrite")``. Within one (model, task), every variant
is built first and all are timed interleaved, round-robin, so the machine's drift affects them
alike: medians over repeats with the interquartile range. Inference error is measured against an
fp64 copy of the model. Writes docs/benchmarks/runtime_<device>.{json,csv}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
from torch import nn

import amprewrite

from .common import interleaved, save, table


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


def _cnn(device, big):
    torch.manual_seed(0)
    n, s = (32, 128) if big else (8, 64)
    return CNN().to(device), (torch.randn(n, 3, s, s, device=device),)


def _llama(device, big):
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, seq = (1024, 8, 512) if big else (256, 4, 128)
    cfg = LlamaConfig(vocab_size=1024 if not big else 32000, hidden_size=h,
                      intermediate_size=h * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=2048, use_cache=False)
    torch.manual_seed(0)
    return (LlamaForCausalLM(cfg).to(device),
            (torch.randint(0, cfg.vocab_size, (4, seq), device=device),))


def _unet(device, big):
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    s, ch = (64, (64, 128, 256)) if big else (32, (32, 64))
    blocks = len(ch)
    model = UNet2DModel(sample_size=s, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=ch, norm_num_groups=8,
                        down_block_types=("DownBlock2D",) * (blocks - 1) + ("AttnDownBlock2D",),
                        up_block_types=("AttnUpBlock2D",) + ("UpBlock2D",) * (blocks - 1))
    return model.to(device), (torch.randn(4, 3, s, s, device=device),
                              torch.tensor([10, 200, 400, 900], device=device))


MODELS = {"cnn": _cnn, "llama": _llama, "unet": _unet}


def _out(o):
    for attr in ("logits", "sample"):
        if hasattr(o, attr):
            return getattr(o, attr)
    return o


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _variants(model, inputs, device, dtype, training, modes=("eager", "compiled")):
    """name -> (callable module, context factory, inputs); built lazily by the caller."""
    def low(inp):
        return tuple(i.to(dtype) if i.is_floating_point() else i for i in inp)

    def auto():
        return torch.autocast(device, dtype=dtype)

    none = contextlib.nullcontext
    low_model = copy.deepcopy(model).to(dtype).train(training)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=inputs)
    if training:
        gm = amprewrite.transform(model.train(), dtype=dtype, example_inputs=inputs)
    built = {
        ("eager", "fp32"): (model, none, inputs),
        ("eager", "autocast"): (model, auto, inputs),
        ("eager", "to_low"): (low_model, none, low(inputs)),
        ("eager", "amprewrite transform"): (gm, none, inputs),
    }
    if "compiled" not in modes:
        return built
    for name, (m, ctx, inp) in list(built.items()):
        built[("compiled", name[1])] = (torch.compile(m), ctx, inp)
    built[("compiled", "amprewrite backend")] = (
        torch.compile(model, backend=amprewrite.backend(dtype=dtype)), none, inputs)
    return built


def run(name, device, repeats, dtype, big=False, modes=("eager", "compiled"), tasks=(False, True)):
    model, inputs = MODELS[name](device, big)
    rows = []
    with torch.no_grad():
        ref64 = _out(copy.deepcopy(model).eval().double()(
            *(i.double() if i.is_floating_point() else i for i in inputs))).double()
    for training in tasks:
        model.train(training)
        torch._dynamo.reset()
        grad_ctx = contextlib.nullcontext if training else torch.no_grad
        steps, results = {}, {}
        for (mode, variant), (m, ctx, inp) in _variants(model, inputs, device, dtype,
                                                        training, modes).items():
            def step(m=m, ctx=ctx, inp=inp, training=training):
                with ctx():
                    out = _out(m(*inp))
                if training:
                    out.float().square().mean().backward()
                return out

            row = {"model": name, "device": device, "dtype": str(dtype).replace("torch.", ""),
                   "task": "train step" if training else "infer", "mode": mode,
                   "variant": variant}
            try:
                with grad_ctx():
                    start = time.perf_counter()
                    out = step()
                    _sync(device)
                    row["first_call_s"] = time.perf_counter() - start
                    step()
                if not training:
                    row["rel_err_vs_fp64"] = float((out.double() - ref64).norm() / ref64.norm())
                steps[(mode, variant)] = step
            except Exception as exc:  # model.to(bf16) fails on some models: record why
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
            results[(mode, variant)] = row
        with grad_ctx():
            timings = interleaved(steps, repeats, device, warmup=0)
        for key, row in results.items():
            if key in timings:
                row["median_ms"], row["iqr_ms"] = timings[key]
            rows.append(row)
        base = {r["mode"]: r.get("median_ms") for r in rows
                if r["variant"] == "fp32" and r["task"] == rows[-1]["task"]}
        auto = {r["mode"]: r.get("median_ms") for r in rows
                if r["variant"] == "autocast" and r["task"] == rows[-1]["task"]}
        for r in rows[-len(results):]:
            if r.get("median_ms") and base.get(r["mode"]):
                r["vs_fp32"] = r["median_ms"] / base[r["mode"]]
            if r.get("median_ms") and auto.get(r["mode"]):
                r["vs_autocast"] = r["median_ms"] / auto[r["mode"]]
            print(table([r], [k for k in COLUMNS if k in r]), flush=True)
    return rows


COLUMNS = ["model", "dtype", "task", "mode", "variant", "median_ms", "iqr_ms", "vs_fp32",
           "vs_autocast",
           "rel_err_vs_fp64", "first_call_s", "error"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    parser.add_argument("--big", action="store_true", help="GPU-sized models and inputs")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"],
                        choices=["eager", "compiled"])
    parser.add_argument("--tasks", nargs="+", default=["infer", "train"],
                        choices=["infer", "train"])
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args(argv)
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.dtypes]
    tasks = tuple(t == "train" for t in args.tasks)
    rows = [r for name in args.models for dt in dtypes
            for r in run(name, args.device, args.repeats, dt, args.big, args.modes, tasks)]
    print(table(rows, COLUMNS))
    path = save(f"runtime_{args.device}{'_' + args.tag if args.tag else ''}", rows, {
        "command": f"python -m benchmarks.runtime --repeats {args.repeats} --device "
                   f"{args.device} --models {' '.join(args.models)} --dtypes "
                   f"{' '.join(args.dtypes)} --modes {' '.join(args.modes)} --tasks "
                   f"{' '.join(args.tasks)}" + (" --big" if args.big else "")
                   + (f" --tag {args.tag}" if args.tag else "")})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
