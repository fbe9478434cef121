"""Nearest upsampling: native F.interpolate vs amprewrite's exact replacement (the subgraph
``replace_upsample`` emits for a symbolic trace: sizes and rank read at run time).

    python -m benchmarks.upsample [--repeats 20] [--device cpu|cuda]

Eager and torch.compile'd, forward and forward+backward, fp32 and bf16, on a UNet-decoder-like
feature map (8 x 64 x 64 x 64, factor 2). Native and rewrite are timed interleaved; medians over
repeats with the interquartile range; ratios are rewrite / native.
Writes docs/benchmarks/upsample_<device>.{json,csv}.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import fx

from amprewrite.passes.replace_upsample import ReplaceUpsample
from amprewrite.precision.policy import Policy

from .common import interleaved, save, table


def _native(x):
    return F.interpolate(x, scale_factor=2, mode="nearest")


# Only the rewrite pass, no cast plan: fp32 and bf16 inputs both run the subgraph as they are.
_rewrite = fx.symbolic_trace(_native)
ReplaceUpsample(Policy(upsample="always")).run(_rewrite)
_rewrite.recompile()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 64, 64, 64])
    args = parser.parse_args(argv)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for compiled in (False, True):
            for backward in (False, True):
                x = torch.randn(args.shape, device=args.device, dtype=dtype,
                                requires_grad=backward)
                fns = {"native": _native, "rewrite": _rewrite}
                if compiled:
                    torch._dynamo.reset()
                    fns = {k: torch.compile(f, dynamic=False) for k, f in fns.items()}
                assert torch.equal(fns["native"](x), fns["rewrite"](x))

                def step(fn, x=x, backward=backward):
                    y = fn(x)
                    if backward:
                        y.backward(torch.ones_like(y))

                med = interleaved({k: (lambda f=f: step(f)) for k, f in fns.items()},
                                  args.repeats, args.device, warmup=3)
                rows.append({
                    "device": args.device, "dtype": str(dtype).replace("torch.", ""),
                    "mode": "compiled" if compiled else "eager",
                    "pass": "fwd+bwd" if backward else "fwd",
                    "native_ms": med["native"][0], "native_iqr_ms": med["native"][1],
                    "rewrite_ms": med["rewrite"][0], "rewrite_iqr_ms": med["rewrite"][1],
                    "rewrite/native": med["rewrite"][0] / med["native"][0],
                })
                print(table(rows[-1:], list(rows[-1])), flush=True)
    cols = ["device", "dtype", "mode", "pass", "native_ms", "native_iqr_ms", "rewrite_ms",
            "rewrite_iqr_ms", "rewrite/native"]
    print(table(rows, cols))
    path = save(f"upsample_{args.device}", rows, {
        "command": f"python -m benchmarks.upsample --repeats {args.repeats} --device "
                   f"{args.device} --shape {' '.join(map(str, args.shape))}"})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
