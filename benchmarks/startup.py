"""Start and stop: what ``import amprewrite`` adds to ``import torch``, and how long a process
lives after its last line.

    python -m benchmarks.startup [--rounds 7] [--compare OTHER_CHECKOUT]

Import rows: a fresh process imports torch, then amprewrite (``import amprewrite``, and the
public API a script uses: ``from amprewrite import transform, backend, ...``), timing each
import inside the process. Exit rows: a command runs with unbuffered output; the time from its
last line to the process's end is the wait a user sees after the answer (the interpreter's
teardown of torch and of the graphs, atexit handlers, threads). ``python -c "import torch;
print()"`` gives torch's own share for scripts. Every case runs ``--rounds`` times, the cases
in a new random order each round, and the median is kept: this is a shared machine.

``--compare OTHER_CHECKOUT`` runs the same cases against another checkout's amprewrite in the
same rounds (``PYTHONPATH`` and working directory set to it) and adds its medians and the
ratio. Writes docs/benchmarks/startup.{json,csv}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import save, table

ROOT = Path(__file__).resolve().parent.parent
# Goals of issue 37: the library's import within 1 s over torch's, the end within 0.3 s of the
# last line.
IMPORT_GOAL_S, EXIT_GOAL_S = 1.0, 0.3

_IMPORT = """
import json, sys, time
t0 = time.perf_counter(); import torch
t1 = time.perf_counter(); {statement}
t2 = time.perf_counter()
print(json.dumps({{"torch_s": t1 - t0, "amprewrite_s": t2 - t1,
                  "heavy": sorted(m for m in ("sympy", "networkx") if m in sys.modules)}}))
"""
# case: (what it is, the statement after `import torch`)
IMPORTS = {
    "import": ("import amprewrite", "import amprewrite"),
    "api": ("from amprewrite import transform, backend, ... (the public API)",
            "from amprewrite import transform, backend, check_numerics, for_generation, report, "
            "FAMILIES, Policy"),
}
# case: (what it is, the python arguments)
COMMANDS = {
    "families": ("amprewrite families", ["-m", "amprewrite.cli", "families"]),
    "check": ("amprewrite check examples/cli_models.py:mlp --inputs 4x16",
              ["-m", "amprewrite.cli", "check", "examples/cli_models.py:mlp", "--inputs",
               "4x16"]),
    "demo": ("amprewrite demo", ["-m", "amprewrite.cli", "demo"]),
    "torch_script": ("python -c 'import torch; print()' (torch's own teardown)",
                     ["-c", "import torch; print('done')"]),
    "transform_script": ("a script: transform an MLP with example inputs, print",
                         ["-c", "import torch, amprewrite; amprewrite.transform("
                          "torch.nn.Linear(16, 4), example_inputs=(torch.randn(4, 16),), "
                          "verify=False); print('done')"]),
}


def _env(checkout: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout), "PYTHONUNBUFFERED": "1"}


def _import(checkout: Path, statement: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _IMPORT.format(statement=statement)],
                         capture_output=True, text=True, cwd=checkout, env=_env(checkout),
                         check=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


def _exit_lag(checkout: Path, argv: list[str]) -> dict:
    """Seconds from the command's last line (stdout or stderr) to its end, and in all."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=checkout, env=_env(checkout))
    last = start
    for _ in proc.stdout:
        last = time.perf_counter()
    code = proc.wait(timeout=600)
    end = time.perf_counter()
    if code != 0:
        raise RuntimeError(f"{argv} exited with status {code}")
    return {"after_last_line_s": end - last, "total_s": end - start}


def measure(checkouts: dict[str, Path], rounds: int) -> list[dict]:
    cases = [(who, "import", name) for who in checkouts for name in IMPORTS]
    cases += [(who, "exit", name) for who in checkouts for name in COMMANDS]
    samples: dict[tuple, list[dict]] = {c: [] for c in cases}
    for k in range(rounds):
        order = random.sample(cases, len(cases))
        for who, kind, name in order:
            where = checkouts[who]
            samples[(who, kind, name)].append(
                _import(where, IMPORTS[name][1]) if kind == "import"
                else _exit_lag(where, COMMANDS[name][1]))
        print(f"round {k + 1}/{rounds} done", file=sys.stderr, flush=True)
    rows = []
    for kind, names, figure in (("import", IMPORTS, "amprewrite_s"),
                                ("exit", COMMANDS, "after_last_line_s")):
        for name in names:
            row: dict[str, object] = {"kind": kind, "case": name, "what": names[name][0]}
            for who in checkouts:
                got = samples[(who, kind, name)]
                row[f"{who}_s"] = statistics.median(s[figure] for s in got)
                if kind == "import":
                    row[f"{who}_torch_s"] = statistics.median(s["torch_s"] for s in got)
                    row[f"{who}_heavy"] = ",".join(got[-1]["heavy"]) or "-"
                else:
                    row[f"{who}_total_s"] = statistics.median(s["total_s"] for s in got)
            if "other" in checkouts:
                row["ratio"] = row["this_s"] / row["other_s"]
            # The goals are the CLI's and the library's import; a script's end is torch's
            # teardown, which a library cannot skip for its caller (shown for comparison).
            if not name.endswith("_script"):
                goal = IMPORT_GOAL_S if kind == "import" else EXIT_GOAL_S
                row["goal_s"] = goal
                row["met"] = row["this_s"] <= goal
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compare", type=Path, metavar="OTHER_CHECKOUT")
    args = parser.parse_args(argv)
    checkouts = {"this": ROOT}
    if args.compare is not None:
        checkouts["other"] = args.compare.resolve()
    rows = measure(checkouts, args.rounds)
    columns = ["kind", "what", "this_s"]
    if args.compare is not None:
        columns += ["other_s", "ratio"]
    columns += ["goal_s", "met", "this_heavy", "this_torch_s", "this_total_s"]
    print(table(rows, [c for c in columns if any(c in r for r in rows)]))
    extra = {"rounds": args.rounds, "compare": str(checkouts.get("other", "")),
             "load_1min": os.getloadavg()[0]}
    print(f"wrote {save('startup', rows, extra)}")


if __name__ == "__main__":
    main()
