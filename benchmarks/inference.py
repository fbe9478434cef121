"""Weight-bound inference: fp32, autocast, model.to(dtype), amprewrite params="fp32" / "low".

    python -m benchmarks.inference [--repeats 15] [--modes eager compiled] [--cases ...]

Cases: a LLaMA-class decoder (transformers; hidden 512, 4 layers, vocab 8192: 21M parameters)
at prefill shapes (batch 1 and 8, 64 tokens) and one-token shapes (batch 1 and 8, 1 token, no
KV cache: the decode step's matmul shapes, weight-bound), and one diffusers UNet2DModel step
(batch 1). For each: median time over interleaved repeats (eval, no_grad), the output's
relative L2 error against an fp64 copy of the model, and the resident weight memory of what
the variant keeps once the caller drops the fp32 model (unique parameter and buffer storages
the variant's module holds). Within one case all variants are timed interleaved, so only ratios
from one run are compared. ``--big`` (what ``python -m benchmarks gpu`` runs): a 1.1B-parameter
decoder (TinyLlama's shape), 512-token prompts and a larger UNet at 64 x 64. Writes
docs/benchmarks/inference_<device>.{json,csv}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch

import amprewrite

from .common import interleaved, save, table

BIG = False  # --big: GPU sizes (a 1.1B-parameter decoder, a larger UNet, longer prompts)


def _llama(batch: int, seq: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    if BIG:  # TinyLlama-1.1B's shape
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                          num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                          max_position_embeddings=2048, use_cache=False)
        seq = seq * 8 if seq > 1 else seq
    else:
        cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=512, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().to(device)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator()
                        .manual_seed(1)).to(device)
    return model, (ids,)


def _unet(device: str):
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    size, channels = (64, (128, 256, 512)) if BIG else (32, (32, 64))
    down = ("DownBlock2D",) * (len(channels) - 1) + ("AttnDownBlock2D",)
    up = ("AttnUpBlock2D",) + ("UpBlock2D",) * (len(channels) - 1)
    model = UNet2DModel(sample_size=size, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=channels, norm_num_groups=8,
                        down_block_types=down, up_block_types=up).eval().to(device)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(1, 3, size, size, generator=g).to(device),
                   torch.tensor([500]).to(device))


CASES = {
    "llama prefill b1x64": lambda d: _llama(1, 64, d),
    "llama prefill b8x64": lambda d: _llama(8, 64, d),
    "llama 1-token b1": lambda d: _llama(1, 1, d),
    "llama 1-token b8": lambda d: _llama(8, 1, d),
    "unet step b1": _unet,
}


def _out(o) -> torch.Tensor:
    for attr in ("logits", "sample"):
        if hasattr(o, attr):
            return getattr(o, attr)
    return o


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages among ``module``'s parameters and buffers."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def run(case: str, device: str, dtype: torch.dtype, repeats: int, modes: list[str]) -> list[dict]:
    model, inputs = CASES[case](device)
    low_inputs = tuple(i.to(dtype) if i.is_floating_point() else i for i in inputs)
    with torch.no_grad():
        ref = _out(copy.deepcopy(model).double()(
            *(i.double() if i.is_floating_point() else i for i in inputs))).double()
    fp32_bytes = resident_bytes(model)
    none = contextlib.nullcontext

    def autocast():
        return torch.autocast(device, dtype=dtype)

    to_low = copy.deepcopy(model).to(dtype)
    variants = {
        "fp32": (model, none, inputs, fp32_bytes),
        "autocast": (model, autocast, inputs, fp32_bytes),
        "model.to(dtype)": (to_low, none, low_inputs, resident_bytes(to_low)),
    }
    for params in ("fp32", "low"):
        gm = amprewrite.transform(model, dtype=dtype, example_inputs=inputs, params=params,
                                  verify=False)
        # What stays resident once the caller drops the fp32 model: with params="fp32" the
        # graph shares (and so keeps) every fp32 weight; with "low", its own copies and the
        # fp32 weights FP32 ops read.
        variants[f'amprewrite params="{params}"'] = (gm, none, inputs, resident_bytes(gm))
    rows, steps = [], {}
    for mode in modes:
        for name, (m, ctx, inp, nbytes) in variants.items():
            fn = torch.compile(m) if mode == "compiled" else m

            def step(fn=fn, ctx=ctx, inp=inp):
                with torch.no_grad(), ctx():
                    return _out(fn(*inp))

            out = step()
            err = float((out.double() - ref).norm() / ref.norm())
            steps[(mode, name)] = step
            rows.append({"case": case, "dtype": str(dtype).replace("torch.", ""), "mode": mode,
                         "variant": name, "rel_err_vs_fp64": err,
                         "weights_mb": nbytes / 2**20, "weights_vs_fp32": nbytes / fp32_bytes})
    timings = interleaved(steps, repeats, device, warmup=2)
    for row in rows:
        row["median_ms"], row["iqr_ms"] = timings[(row["mode"], row["variant"])]
    for mode in modes:
        of = {r["variant"]: r for r in rows if r["mode"] == mode}
        for r in of.values():
            r["vs_autocast"] = r["median_ms"] / of["autocast"]["median_ms"]
            r["vs_to_dtype"] = r["median_ms"] / of["model.to(dtype)"]["median_ms"]
    return rows


COLUMNS = ["case", "mode", "variant", "median_ms", "iqr_ms", "vs_autocast", "vs_to_dtype",
           "rel_err_vs_fp64", "weights_mb", "weights_vs_fp32"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inference", description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    parser.add_argument("--big", action="store_true",
                        help="GPU sizes: a 1.1B LLaMA-class decoder, prompts x8, a larger UNet")
    args = parser.parse_args(argv)
    global BIG
    BIG = args.big
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = []
    for case in args.cases:
        case_rows = run(case, args.device, dtype, args.repeats, args.modes)
        print(table(case_rows, COLUMNS), flush=True)
        rows += case_rows
    print(table(rows, COLUMNS))
    save(f"inference_{args.device}{'_' + args.tag if args.tag else ''}", rows, {
        "command": f"python -m benchmarks.inference --repeats {args.repeats} --modes "
                   f"{' '.join(args.modes)} --device {args.device} --dtype {args.dtype}"
                   f" --cases {' '.join(repr(c) for c in args.cases)}"
                   + (" --big" if args.big else "")})
    return rows


if __name__ == "__main__":
    main()
