"""Transform time with a saved plan against deciding afresh (docs/guide.md, "Plans").

    python -m benchmarks plan_time                      # LLaMA and UNet2DModel, fp16 and bf16
    python -m benchmarks plan_time --models llama --dtypes fp16 --rounds 1

Each transform runs in a process of its own, so the kernel probes' cache starts empty, as at
a trainer's or a server's start-up. ``afresh`` decides on the zoo model's example inputs
(value ranges recorded, kernels probed, the built-in check run) and saves its plan; ``plan``
applies that plan to a fresh instance with the same example inputs (the check still runs);
``plan, verify=False`` leaves the check out too. Columns: the transform's own total, the
capture (dynamo's, the same work in every variant), ``after capture`` (the total without it:
what a plan can save), and the stages a plan changes (``record_ranges``, ``paint_precision``:
its kernel probes; ``verify``); medians over ``--rounds`` processes each, seconds. On a shared
machine the capture's spread (0.5 s on the zoo's LLaMA) is larger than what a plan saves on
small models: read ``after capture``. Writes docs/benchmarks/plan_time.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..common import save, table

MODELS = ("llama", "unet2d")
DTYPES = ("fp16", "bf16")
VARIANTS = ("afresh", "plan", "plan, verify=False")
STAGES = ("capture", "record_ranges", "paint_precision", "verify")

_CHILD = """
import json, sys
import amprewrite
from amprewrite.testing import zoo
name, dtype, plan, verify, out = sys.argv[1:6]
model, inputs = getattr(zoo, name)()
gm = amprewrite.transform(model, dtype, example_inputs=inputs, progress=False,
                          plan=plan or None, verify=verify == "1")
if out:
    amprewrite.save_plan(gm, out)
rep = amprewrite.report(gm)
print(json.dumps({**rep.timings, "applied": rep.plan.applied if rep.plan else 0}))
"""


def _run(name: str, dtype: str, plan: str, verify: bool, out: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, name, dtype, plan,
                           "1" if verify else "0", out], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise SystemExit(f"{name} {dtype}: the transform failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(models: list[str], dtypes: list[str], rounds: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            for dtype in dtypes:
                path = str(Path(tmp) / f"{name}-{dtype}.json")
                samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
                for k in range(rounds):  # interleaved: drift on a shared machine hits all
                    samples["afresh"].append(_run(name, dtype, "", True, path if k == 0
                                                  else ""))
                    samples["plan"].append(_run(name, dtype, path, True))
                    samples["plan, verify=False"].append(_run(name, dtype, path, False))
                nodes = samples["plan"][0]["applied"]
                base = statistics.median(s["total"] - s["capture"] for s in samples["afresh"])
                for variant, got in samples.items():
                    total = statistics.median(s["total"] for s in got)
                    after = statistics.median(s["total"] - s["capture"] for s in got)
                    row = {"model": name, "dtype": dtype, "variant": variant,
                           "total_s": round(total, 3), "after_capture_s": round(after, 3),
                           **{f"{st}_s": round(statistics.median(s.get(st, 0.0) for s in got), 3)
                              for st in STAGES},
                           "after_capture_vs_afresh": round(after / base, 3), "nodes_from_plan":
                               nodes if variant != "afresh" else 0, "rounds": rounds}
                    rows.append(row)
                    print(row, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    """The docs/benchmarks.md table of the rows."""
    return table(rows, ["model", "dtype", "variant", "total_s", "capture_s", "after_capture_s",
                        "after_capture_vs_afresh", "record_ranges_s", "paint_precision_s",
                        "verify_s", "nodes_from_plan"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks plan_time",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = measure(args.models, args.dtypes, args.rounds)
    print(markdown(rows))
    if not args.no_save:
        print("wrote", save("plan_time", rows))


if __name__ == "__main__":
    main()
