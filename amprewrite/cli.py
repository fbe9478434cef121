"""The ``amprewrite`` command line.

``amprewrite demo [--dtype bf16|fp16]`` transforms the built-in demo model, prints the report and
compares the output error against fp32 with torch.autocast's. ``amprewrite families`` prints the
op-family table.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .api import transform
from .errors import AmpRewriteError
from .ops import families_markdown
from .report import report

__all__ = ["main"]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo_model

    model, inputs = demo_model()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    start = time.perf_counter()
    gm = transform(model, dtype=dtype, example_inputs=inputs, upsample=args.upsample)
    elapsed = time.perf_counter() - start
    rep = report(gm)
    print(rep)
    with torch.no_grad():
        ref = model(*inputs)
        ours = gm(*inputs)
        with torch.autocast("cpu", dtype=dtype):
            auto = model(*inputs)
    print(f"\ntransform: {elapsed:.2f} s ({len(gm.graph.nodes)} nodes, {len(rep.casts)} casts)")
    print(f"\nrelative error against fp32 ({args.dtype}):")
    print(f"  {'output':<10}{'amprewrite':>14}{'autocast':>14}")
    for name, o, a, r in zip(("image", "bce loss"), ours, auto, ref):
        print(f"  {name:<10}{_rel_err(o, r):>14.3e}{_rel_err(a, r):>14.3e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amprewrite", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="transform the built-in demo model and print the report")
    demo.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    demo.add_argument("--upsample", choices=("auto", "always", "never"), default="always",
                      help="the demo shows the exact upsample rewrite by default; 'auto' "
                           "rewrites only where the device has no kernel")
    demo.set_defaults(run=_demo)
    fams = sub.add_parser("families", help="print the op-family table (Markdown)")
    fams.set_defaults(run=lambda args: print(families_markdown()) or 0)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except AmpRewriteError as exc:
        print(f"amprewrite: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
