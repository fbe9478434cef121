"""Mutation testing of the precision classes: does some test fail when a family's class flips?

    python -m benchmarks mutants                          # every FP32 and LOW family
    python -m benchmarks mutants --families softmax conv  # some of them
    python -m benchmarks mutants --tests tests/test_seeds.py tests/precision/test_ops.py --name
    mutants_before

Each FP32 family in turn becomes PROMOTE (it follows its inputs, like autocast's unlisted ops)
and each LOW family becomes FP32; the test selection then runs in a subprocess
(``python -m pytest -x -q -p no:cacheprovider -p benchmarks.mutant_plugin ...``) with
``AMPREWRITE_MUTANT=family=class`` (see ``benchmarks/mutant_plugin.py``). A flip is *caught* when
a test fails (the first failing test is recorded) and *SURVIVED* when the selection passes. The
unflipped selection runs first and must pass. Writes docs/benchmarks/<name>.{json,csv,md}.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from amprewrite.precision.ops import FAMILIES, Precision

from .common import RESULTS, save, table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["tests/precision/test_precision_classes.py", "tests/test_seeds.py"]
FLIP = {Precision.FP32: Precision.PROMOTE, Precision.LOW: Precision.FP32}
COLUMNS = ["family", "class", "flipped to", "result", "first failing test", "seconds"]


def flippable() -> list[str]:
    """Every family whose class is FP32 or LOW, in registry order."""
    return [n for n, f in FAMILIES.items() if f.precision in FLIP]


def run_selection(tests: list[str], mutant: str | None, timeout: float
                  ) -> tuple[int, str, float]:
    """(return code, output, seconds) of the test selection with ``mutant`` applied."""
    env = dict(os.environ)
    env.pop("AMPREWRITE_MUTANT", None)
    if mutant:
        env["AMPREWRITE_MUTANT"] = mutant
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-p", "benchmarks.mutant_plugin", *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = -1
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return code, out, time.perf_counter() - start


def first_failure(output: str) -> str:
    """The first test pytest's short summary names (``FAILED path::test[param]``)."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if m is None:
        return ""
    return m.group(1).removeprefix("tests/")


def mutate(family: str, tests: list[str], timeout: float) -> dict[str, object]:
    old = FAMILIES[family].precision
    new = FLIP[old]
    code, out, seconds = run_selection(tests, f"{family}={new.value}", timeout)
    if code == 0:
        result, failing = "SURVIVED", ""
    elif code == 1:
        result, failing = "caught", first_failure(out)
    elif code == -1:
        result, failing = "timeout", ""
    else:  # usage error, collection error, interrupted: not a verdict on the tests
        result, failing = f"error (pytest exit {code})", first_failure(out)
    return {"family": family, "class": old.value, "flipped to": new.value, "result": result,
            "first failing test": failing, "seconds": round(seconds, 1)}


def summary(rows: list[dict[str, object]]) -> str:
    caught = sum(r["result"] == "caught" for r in rows)
    survived = [str(r["family"]) for r in rows if r["result"] == "SURVIVED"]
    text = f"{caught} of {len(rows)} flips caught"
    if survived:
        text += f"; survived: {', '.join(survived)}"
    others = len(rows) - caught - len(survived)
    if others:
        text += f"; {others} not decided (error or timeout)"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=None,
                        help="families to flip (default: every FP32 and LOW family)")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS,
                        help=f"the test selection (default: {' '.join(DEFAULT_TESTS)})")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--name", default="mutants",
                        help="result files docs/benchmarks/<name>.{json,csv,md}")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unflipped run (it must pass for the table to mean "
                             "anything)")
    args = parser.parse_args(argv)
    families = args.families or flippable()
    unknown = [f for f in families if f not in FAMILIES or FAMILIES[f].precision not in FLIP]
    if unknown:
        parser.error(f"not an FP32 or LOW family: {', '.join(unknown)}")
    if not args.no_baseline:
        code, out, seconds = run_selection(args.tests, None, args.timeout)
        print(f"baseline (no flip): pytest exit {code} in {seconds:.0f} s", flush=True)
        if code != 0:
            print(out[-4000:], file=sys.stderr)
            print("the unflipped selection must pass first", file=sys.stderr)
            return 1
    rows = []
    for family in families:
        row = mutate(family, args.tests, args.timeout)
        rows.append(row)
        print(f"{family:34s} {row['class']:4s} -> {row['flipped to']:7s} {row['result']:8s} "
              f"{row['first failing test']}  {row['seconds']} s", flush=True)
    command = "python -m benchmarks mutants " + " ".join(argv if argv is not None else
                                                         sys.argv[1:])
    md = "\n".join([f"`{command.strip()}`", "",
                    f"Test selection: {' '.join(args.tests)}", "",
                    table(rows, COLUMNS), "", summary(rows), ""])
    save(args.name, rows, {"tests": args.tests, "command": command.strip(),
                           "summary": summary(rows)})
    (RESULTS / f"{args.name}.md").write_text(md)
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
