"""What a process pays for amprewrite besides the transform itself: resident memory kept per
transform (after N transforms of one zoo model, each graph dropped and garbage-collected,
divided by N, after warm-up transforms), and the time ``import amprewrite`` adds to
``import torch`` (median of 5 fresh processes).

    python -m benchmarks.transform_memory [--models gpt2 resnet] [--n 20]

Prints a table and writes docs/benchmarks/transform_memory.{json,csv}. Goals: at most 0.3 MB
per transform (issue 25); import at most 1 s on top of torch (issue 26).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from .common import save


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(name: str, n: int, warmup: int = 3) -> dict:
    import amprewrite
    from amprewrite.testing import zoo

    model, inputs = zoo.MODELS[name]()

    def once() -> None:
        gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs, verify=False,
                                  progress=False)
        del gm
        gc.collect()

    for _ in range(warmup):
        once()
    start, t0 = _rss_mb(), time.perf_counter()
    for _ in range(n):
        once()
    return {"model": name, "transforms": n, "mb_per_transform": (_rss_mb() - start) / n,
            "s_per_transform": (time.perf_counter() - t0) / n}


def import_seconds(runs: int = 5) -> float:
    """Median seconds ``import amprewrite`` takes after ``import torch``, in fresh processes."""
    import statistics
    import subprocess
    import sys

    code = ("import time, torch; t = time.perf_counter(); import amprewrite; "
            "print(time.perf_counter() - t)")
    times = [float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                  text=True).stdout.split()[-1]) for _ in range(runs)]
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt2", "resnet"])
    p.add_argument("--n", type=int, default=20)
    args = p.parse_args(argv)
    seconds = import_seconds()
    print(f"import amprewrite after import torch: {seconds:.2f} s (median of 5 processes)")
    rows = [measure(m, args.n) for m in args.models]
    lines = ["| model | transforms | MB per transform | s per transform |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['transforms']} | {r['mb_per_transform']:.2f} | "
              f"{r['s_per_transform']:.2f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    save("transform_memory", rows, {"import_seconds": seconds})


if __name__ == "__main__":
    main()
