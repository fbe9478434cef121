"""``amprewrite dump``: the graph before and after, a diff, the report, the HTML report and
Model Explorer graphs, written to a folder (and, with ``--check``, the numerics check).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..progress import Steps
from .flags import (
    FORMATS,
    formats_flag,
    option_flags,
)
from .target import Target, attempt, load, out_folder, plural, policy_of

# Above this many nodes the default --format leaves svg out: Graphviz's dot layout time grows
# steeply with the graph (LLaMA graphs on the 2-core CI machine: 480 nodes 1.5 s, 620 3.9 s,
# 760 30 s, 1,286 3 min 38 s; docs/cli.md, "dump").
SVG_MAX_NODES = 600


RENDER_TIMEOUT = 120.0


@dataclass
class Artefacts:
    """What :func:`write_artefacts` wrote, and notes on what it did not (svg renders)."""

    files: dict[str, Path]
    notes: list[str]


def artefact_steps(check: bool, transformed: bool = False) -> int:
    """How many progress steps :func:`write_artefacts` takes."""
    return 3 + int(check) - int(transformed)


def write_artefacts(model, inputs, policy, out: Path, formats: set[str] | None,
                    per_pass: bool, steps: Steps, check: bool = False, after=None,
                    render_timeout: float = RENDER_TIMEOUT) -> Artefacts:
    """Before/after code and tables, diff, report, dot/svg, HTML, Model Explorer JSON; with
    ``check`` also the per-node error against fp32. ``formats`` None is every format, svg
    only up to :data:`SVG_MAX_NODES` nodes. ``after``: the model transformed already."""
    import difflib

    from ..api import transform_with
    from ..capture.trace import capture, keep_captured
    from ..precision.plan_file import save_plan
    from ..precision.report import report
    from ..show.html import report_page
    from ..show.numerics import check_numerics
    from ..show.render import SvgRender, node_table, to_dot
    from ..show.views import rewritten_nodes

    target = Target(model, inputs, "the example inputs")
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    notes: list[str] = []

    def write(name: str, text: str) -> None:
        files[name] = out / name
        files[name].write_text(text)

    steps.step("capturing the graph before")
    passes: list[tuple[str, str]] = []
    with keep_captured():  # one capture: the graph before, the transform's, the check's fp32
        before = attempt("capturing", lambda: capture(model, inputs).gm, target)
        if after is None:
            steps.step("running the passes on that capture")
            after = attempt("transforming", lambda: transform_with(
                model, policy, inputs, on_pass=(lambda n, g: passes.append((n, g.code)))
                if per_pass else None), target)
        result = None
        if check:
            steps.step("running fp32 and transformed for the per-node error")
            result = attempt("checking", lambda: check_numerics(model, inputs, policy.dtype,
                                                                 gm=after), target)
    rep = report(after)
    rewritten = rewritten_nodes(after)
    steps.step("writing files")
    nodes = max(len(before.graph.nodes), len(after.graph.nodes))
    if formats is None:
        formats = set(FORMATS)
        if nodes > SVG_MAX_NODES:
            formats.discard("svg")
            notes.append(f"no svg: the graph has {nodes} nodes, above the {SVG_MAX_NODES} where "
                         "Graphviz's dot takes minutes; index.html shows the graph (ask for "
                         "svg with --format text,dot,svg,html,model-explorer)")
    render = None
    if formats & {"dot", "svg"}:
        dots = {"before": to_dot(before, "before"), "after": to_dot(after, "after", rewritten)}
        if "dot" in formats:
            write("before.dot", dots["before"])
            write("after.dot", dots["after"])
        if "svg" in formats:  # dot runs in the background while the other files are written
            render = SvgRender({"before.svg": (dots["before"], len(before.graph.nodes)),
                                "after.svg": (dots["after"], len(after.graph.nodes))},
                               timeout=render_timeout)
    try:
        if "text" in formats:
            write("before.py", before.code)
            write("after.py", after.code)
            write("before.txt", node_table(before))
            write("after.txt", node_table(after, rewritten))
            write("diff.patch", "".join(difflib.unified_diff(
                before.code.splitlines(True), after.code.splitlines(True), "before.py",
                "after.py")))
            write("report.txt", str(rep))
            write("plan.json", save_plan(after))  # `amprewrite plan show/diff`, --plan
        if "html" in formats:
            write("index.html", report_page(before, after, rewritten, result,
                                            report_text=str(rep),
                                            title=f"amprewrite: {type(model).__name__}"))
        if "model-explorer" in formats:
            from ..show.explorer import write_model_explorer

            for name, path in write_model_explorer(out / "model-explorer", before, after,
                                                   rewritten, result,
                                                   label=type(model).__name__).items():
                files[f"model-explorer/{name}"] = path
        for k, (name, code) in enumerate(passes):
            path = out / "passes" / f"{k:02d}_{name}.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text(code)
            files[f"passes/{path.name}"] = path
        if render is not None:
            missing: dict[str, list[str]] = {}  # problem -> the files it left out
            for done in render.wait(lambda pending, waited: steps.status(
                    f"waiting for dot on {', '.join(pending)} ({waited:.0f} s of "
                    f"{render.timeout:g} s)")):
                if done.svg is not None:
                    write(done.name, done.svg)
                else:
                    missing.setdefault(done.problem, []).append(done.name)
            # One note per cause: dot missing leaves out both files for one reason.
            notes += [f"no {' or '.join(names)}: {problem}" + (
                "; index.html shows the graph" if "index.html" in files else "")
                for problem, names in missing.items()]
    finally:
        if render is not None:
            render.stop()
    return Artefacts(files, notes)


def run_dump(args: argparse.Namespace) -> int:
    formats = formats_flag(args.format) if args.format is not None else None
    out = out_folder(args.out)
    if formats is not None and "svg" in formats and shutil.which("dot") is None:
        from .target import UsageError

        others = ",".join(f for f in FORMATS if f in formats and f != "svg")
        raise UsageError(
            "--format svg needs Graphviz's dot, which is not on PATH: install graphviz "
            "(apt-get install graphviz, brew install graphviz), or leave svg out"
            + (f" (--format {others})" if others else " (--format html shows the graph "
               "in a browser)") + ".")
    steps_total = 1 + artefact_steps(args.check)
    with Steps(steps_total, log=True) as steps:
        steps.step(f"loading {args.target}")
        target = load(args, need_inputs=args.check)
        made = write_artefacts(target.model, target.inputs, policy_of(args), out,
                               formats, args.per_pass, steps, check=args.check,
                               render_timeout=args.render_timeout)
    files = made.files
    if not files:
        print(f"wrote no files to {args.out}")
        for note in made.notes:
            print(f"note: {note}")
        return 1
    print(f"wrote {plural(len(files), 'file')} to {args.out}: {', '.join(sorted(files))}")
    for note in made.notes:
        print(f"note: {note}")
    if "index.html" in files:
        print(f"open {shlex.quote(str(files['index.html']))} in a browser for the report")
    if "model-explorer/amprewrite_graphs.json" in files:
        graphs = files["model-explorer/amprewrite_graphs.json"]
        overlays = ",".join(str(p) for p in sorted(graphs.parent.glob("*.json")) if p != graphs)
        again = shlex.join(["amprewrite", "explore", args.target, *target.flags,
                            *option_flags(args)]
                           + (["--dtype", args.dtype] if args.dtype != "bf16" else []))
        explorer = shlex.join(["model-explorer", str(graphs)]
                              + ([f"--node_data_paths={overlays}"] if overlays else []))
        print(f"Model Explorer: `{again}` shows these graphs; or run `{explorer}`")
    return 0
