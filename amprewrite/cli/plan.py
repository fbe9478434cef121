"""``amprewrite plan``: a saved plan (:func:`amprewrite.save_plan`) shown, or two diffed.

``amprewrite plan show PLAN.json`` prints it as the report prints decisions;
``amprewrite plan diff A.json B.json`` lists the nodes whose class, dtypes, casts or float8
verdicts differ, with both reasons, and exits 1 when any do (0 when none), so a CI job can
gate a precision change on it. No torch at import.
"""

from __future__ import annotations

import argparse

__all__ = ["add_plan_command", "run_plan"]


def add_plan_command(plan: argparse.ArgumentParser) -> None:
    """The ``plan`` command's actions, on its parser."""
    actions = plan.add_subparsers(dest="action", required=True, metavar="ACTION",
                                  help="show: print a plan; diff: compare two")
    show = actions.add_parser("show", help="print a plan file as the report prints decisions",
                              description="Print a plan file (amprewrite.save_plan) as the "
                                          "report prints decisions.")
    show.add_argument("plan_file", metavar="PLAN.json", help="a file written by save_plan")
    diff = actions.add_parser("diff", help="the nodes whose decisions differ; exit 1 if any",
                              description="List the nodes whose precision, casts or float8 "
                                          "verdicts differ between two plan files, with both "
                                          "reasons; exit 1 when any differ, 0 when none do.")
    diff.add_argument("a", metavar="A.json", help="the plan before")
    diff.add_argument("b", metavar="B.json", help="the plan after")
    plan.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from ..precision.plan_file import diff_plans, show_plan

    if args.action == "show":
        print(show_plan(args.plan_file))
        return 0
    lines, differ = diff_plans(args.a, args.b)
    print("\n".join(lines))
    return 1 if differ else 0
