"""Which low-precision and mixed-dtype kernels a device has, and how exact they are.

    python -m benchmarks.kernel_probe                 # the CPU
    python -m benchmarks.kernel_probe --device cuda   # a GPU: writes kernel_probe_cuda.json

For each op and dtype (bf16, fp16): does the low-precision kernel run, and its error against
fp64; and for the mixed signatures the memory plan wants (DESIGN.md, "Compute dtype is not
storage dtype"): a norm reading a low input with fp32 weight and statistics, a reduction or
softmax reading a low input with ``dtype=torch.float32``. "exact" there means the result equals
what the fp32 op gives on the upcast input, rounded once to the output dtype.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .common import save, table

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _x(shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device)


def _cases(device: str) -> dict[str, tuple[Callable[[torch.dtype], object], str]]:
    """name -> (fn(dtype) computing with inputs of that dtype, kind)."""
    x4, x5, x3 = _x((2, 8, 16, 16), device), _x((1, 2, 4, 4, 4), device), _x((2, 16, 64), device)
    w8, b8 = _x((8,), device).abs() + 0.5, _x((8,), device)
    rm, rv = _x((8,), device) * 0.1, _x((8,), device).abs() + 0.5
    w64, b64 = _x((64,), device).abs() + 0.5, _x((64,), device)
    grid = _x((2, 16, 16, 2), device).tanh()

    def low(t: torch.Tensor, d: torch.dtype) -> torch.Tensor:
        return t.to(d)

    return {
        # Plain low-precision kernels (every input in the dtype).
        "conv2d": (lambda d: F.conv2d(low(x4, d), low(x4[:8, :8, :3, :3], d)), "low"),
        "avg_pool3d": (lambda d: F.avg_pool3d(low(x5, d), 2), "low"),
        "adaptive_avg_pool3d(1)": (lambda d: F.adaptive_avg_pool3d(low(x5, d), 1), "low"),
        "upsample_nearest2d": (lambda d: F.interpolate(low(x4, d), scale_factor=2), "low"),
        "upsample_bilinear2d": (lambda d: F.interpolate(low(x4, d), scale_factor=2,
                                                        mode="bilinear"), "low"),
        "upsample_nearest3d": (lambda d: F.interpolate(low(x5, d), scale_factor=2), "low"),
        "grid_sample": (lambda d: F.grid_sample(low(x4, d), low(grid, d),
                                                align_corners=False), "low"),
        # Mixed: a low input with fp32 parameters and statistics.
        "batch_norm(low x, fp32 stats) eval": (
            lambda d: F.batch_norm(low(x4, d), rm, rv, w8, b8, training=False), "mixed"),
        "batch_norm(low x, fp32 stats) train": (
            lambda d: F.batch_norm(low(x4, d), rm.clone(), rv.clone(), w8, b8, training=True),
            "mixed"),
        "layer_norm(low x, fp32 w)": (
            lambda d: F.layer_norm(low(x3, d), (64,), w64, b64), "mixed"),
        "group_norm(low x, fp32 w)": (lambda d: F.group_norm(low(x4, d), 4, w8, b8), "mixed"),
        # Mixed: a low input read by a reduction that accumulates in fp32.
        "softmax(low x, dtype=fp32)": (lambda d: low(x3, d).softmax(-1, dtype=torch.float32),
                                       "mixed"),
        "log_softmax(low x, dtype=fp32)": (
            lambda d: low(x3, d).log_softmax(-1, dtype=torch.float32), "mixed"),
        "sum(low x, dtype=fp32)": (lambda d: low(x3, d).sum(-1, dtype=torch.float32), "mixed"),
        "mean(low x, dtype=fp32)": (lambda d: low(x3, d).mean(-1, dtype=torch.float32),
                                    "mixed"),
        "cumsum(low x, dtype=fp32)": (lambda d: low(x3, d).cumsum(-1, dtype=torch.float32),
                                      "mixed"),
    }


def probe(device: str) -> list[dict]:
    rows = []
    for name, (fn, kind) in _cases(device).items():
        for label, d in LOW.items():
            row = {"op": name, "kind": kind, "dtype": label, "device": device}
            try:
                out = fn(d)
            except Exception as exc:  # a missing kernel is the finding, not a failure
                row.update(runs=False, out_dtype="", error="", note=str(exc).split("\n")[0][:80])
                rows.append(row)
                continue
            ref = _upcast(fn, d)  # the op in fp32 on the rounded input: an fp32 island
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            row.update(runs=True, out_dtype=str(out.dtype).replace("torch.", ""),
                       error=f"{err:.2e}", note="")
            rows.append(row)
    return rows


def _upcast(fn: Callable[[torch.dtype], object], d: torch.dtype) -> torch.Tensor:
    """fn on inputs rounded to ``d`` and computed in fp32: the island amprewrite builds today."""
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.dtype == d:
            return real_to(out, torch.float32)
        return out

    torch.Tensor.to = to
    try:
        return fn(d)
    finally:
        torch.Tensor.to = real_to


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    rows = probe(args.device)
    name = f"kernel_probe_{args.device.split(':')[0]}"
    extra = {"torch": torch.__version__}
    if args.device.startswith("cuda"):
        extra["gpu"] = torch.cuda.get_device_name()
    save(name, rows, extra)
    print(table(rows, ["op", "kind", "dtype", "runs", "out_dtype", "error", "note"]))


if __name__ == "__main__":
    main()
