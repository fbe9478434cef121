"""The ``amprewrite`` command line.

- ``amprewrite demo [--dtype bf16|fp16] [--out DIR]``: transform the built-in demo model, print
  the report and the error against fp32 next to torch.autocast's.
- ``amprewrite dump TARGET [--inputs SPEC ...] [--out DIR]
  [--format text,dot,svg,html,model-explorer] [--check] [--per-pass]``: write the graph before
  and after, a diff, the report, the HTML report and Model Explorer graphs.
- ``amprewrite explore TARGET [--inputs SPEC ...] [--port P]``: start Model Explorer on localhost
  with both graphs and the overlays (``pip install 'amprewrite[explorer]'``).
- ``amprewrite check TARGET [--inputs SPEC ...] [--rtol R] [--fix]``: fp32 vs transformed
  error, per-node errors, the first non-finite node; exit status 1 when it fails, 2 on bad usage.
- ``amprewrite families``: the op-family table.

TARGET is ``path/to/file.py:factory`` or ``package.module:factory``; the factory returns a model
or ``(model, example_inputs)``. Input specs: ``2x3x64x64``, ``int64:1x1024:0-512``.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path

import torch

from .api import transform_with
from .capture import capture
from .errors import AmpRewriteError
from .numerics import check_numerics, find_fp32_nodes, rel_err
from .coverage import families_markdown
from .policy import Policy, parse_dtype
from .render import node_table, to_dot, to_svg
from .report import report
from .report_html import report_page
from .target import UsageError, load_target, parse_input
from .views import rewritten_nodes

__all__ = ["main"]

FORMATS = ("text", "dot", "svg", "html", "model-explorer")


class _Progress:
    """Step lines: rewritten in place on a terminal, one plain line each otherwise."""

    def __init__(self, total: int):
        self.total, self.step, self.tty = total, 0, sys.stderr.isatty()

    def __call__(self, message: str) -> None:
        self.step += 1
        text = f"[{self.step}/{self.total}] {message}"
        if self.tty:
            sys.stderr.write("\r\033[K" + text + ("\n" if self.step == self.total else ""))
        else:
            sys.stderr.write(f"amprewrite: {text}\n")
        sys.stderr.flush()


def _model_and_inputs(args: argparse.Namespace, need_inputs: bool):
    model, inputs = load_target(args.target)
    if args.inputs:
        inputs = tuple(parse_input(s, seed=i) for i, s in enumerate(args.inputs))
    if need_inputs and inputs is None:
        raise UsageError(f"{args.target} gives no example inputs: pass --inputs, e.g. "
                         "--inputs 2x3x64x64 int64:2x16:0-1000.")
    return model, inputs


def _policy(args: argparse.Namespace) -> Policy:
    # dump shows the graph and check measures its error itself: neither stops at verification.
    return Policy(dtype=parse_dtype(args.dtype), upsample=getattr(args, "upsample", "auto"),
                  verify=False)


def _run_model(what: str, fn):
    try:
        return fn()
    except AmpRewriteError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UsageError(f"the model failed while {what}: {type(exc).__name__}: {first}") from None


def write_artefacts(model, inputs, policy: Policy, out: Path, formats: set[str],
                    per_pass: bool, progress: _Progress, check: bool = False) -> dict[str, Path]:
    """Before/after code and tables, diff, report, dot/svg, HTML, Model Explorer JSON; with
    ``check`` also the per-node error against fp32. Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}

    def write(name: str, text: str) -> None:
        files[name] = out / name
        files[name].write_text(text)

    progress("capturing the graph before")
    before = _run_model("being captured", lambda: capture(model, inputs).gm)
    steps: list[tuple[str, str]] = []
    progress("running the passes")
    after = _run_model("being transformed", lambda: transform_with(
        model, policy, inputs, on_pass=(lambda n, g: steps.append((n, g.code))) if per_pass
        else None))
    rep = report(after)
    rewritten = rewritten_nodes(after)
    result = None
    if check:
        progress("running fp32 and transformed for the per-node error")
        result = _run_model("being checked", lambda: check_numerics(
            model, inputs, policy.dtype, gm=after))
    progress("writing files")
    if "text" in formats:
        write("before.py", before.code)
        write("after.py", after.code)
        write("before.txt", node_table(before))
        write("after.txt", node_table(after, rewritten))
        write("diff.patch", "".join(difflib.unified_diff(
            before.code.splitlines(True), after.code.splitlines(True), "before.py", "after.py")))
        write("report.txt", str(rep))
    if formats & {"dot", "svg"}:
        dots = (to_dot(before, "before"), to_dot(after, "after", rewritten))
        write("before.dot", dots[0])
        write("after.dot", dots[1])
        if "svg" in formats:
            for name, dot in zip(("before.svg", "after.svg"), dots):
                svg = to_svg(dot)
                if svg is not None:
                    write(name, svg)
    if "html" in formats:
        write("index.html", report_page(before, after, rewritten, result, report_text=str(rep),
                                        title=f"amprewrite: {type(model).__name__}"))
    if "model-explorer" in formats:
        from .explorer import write_model_explorer

        for name, path in write_model_explorer(out / "model-explorer", before, after, rewritten,
                                               result, label=type(model).__name__).items():
            files[f"model-explorer/{name}"] = path
    for k, (name, code) in enumerate(steps):
        path = out / "passes" / f"{k:02d}_{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(code)
        files[f"passes/{path.name}"] = path
    return files


def _formats(text: str) -> set[str]:
    chosen = {f.strip() for f in text.split(",") if f.strip()}
    bad = chosen - set(FORMATS)
    if bad or not chosen:
        raise UsageError(f"--format takes a comma list of {', '.join(FORMATS)}; got '{text}'.")
    return chosen


def _dump(args: argparse.Namespace) -> int:
    formats = _formats(args.format)
    progress = _Progress(5 if args.check else 4)
    progress(f"loading {args.target}")
    model, inputs = _model_and_inputs(args, need_inputs=args.check)
    files = write_artefacts(model, inputs, _policy(args), Path(args.out), formats,
                            args.per_pass, progress, check=args.check)
    print(f"wrote {len(files)} files to {args.out}: {', '.join(sorted(files))}")
    if "svg" in formats and not any(f.endswith(".svg") for f in files):
        print("note: Graphviz 'dot' is not installed, so no SVG was rendered (the .dot files "
              "are there; install graphviz for SVG)")
    if "html" in formats:
        print(f"open {Path(args.out) / 'index.html'} in a browser for the report")
    if "model-explorer" in formats:
        me = Path(args.out) / "model-explorer"
        graphs = me / "amprewrite_graphs.json"
        overlays = ",".join(str(p) for p in sorted(me.glob("*.json")) if p != graphs)
        print(f"Model Explorer: `amprewrite explore {args.target}` shows these graphs; or run "
              f"`model-explorer {graphs} --node_data_paths={overlays}`")
    return 0


def _explore(args: argparse.Namespace) -> int:
    from .explorer import _port_free, _require, prepare, serve

    _require()  # the install hint and a busy port before any capture work
    _port_free(args.host, args.port)
    progress = _Progress(3)
    progress(f"loading {args.target}")
    model, inputs = _model_and_inputs(args, need_inputs=False)
    progress("capturing, transforming" + ("" if args.no_check or inputs is None
                                          else " and measuring the per-node error"))
    files = _run_model("being transformed", lambda: prepare(
        model, inputs, parse_dtype(args.dtype), check=not args.no_check, out=args.out,
        upsample=args.upsample))
    progress("starting Model Explorer")
    serve(files, args.host, args.port, open_browser=not args.no_browser)
    return 0


def _print_check(result, rtol: float, top: int) -> None:
    print(f"output error vs fp32: {result.output_error:.3e} (rtol {rtol:g}); "
          f"outputs finite: {result.finite}")
    if result.first_nonfinite is not None:
        n = result.first_nonfinite
        print(f"first non-finite node: {n.node} ({n.precision}, family {n.family or '-'}, "
              f"module {n.module_path or '-'}, source {n.source or '-'})")
    rows = [r for r in result.nodes
            if r.rel_err is not None and r.precision not in ("placeholder", "get_attr")][:top]
    if rows:
        print(f"worst {len(rows)} nodes (relative error vs the fp32 graph, same node name):")
        width = max(len(r.node) for r in rows)
        for r in rows:
            print(f"  {r.node.ljust(width)}  {r.rel_err:10.3e}  {r.precision:8s} "
                  f"{r.family or '-':22s} {r.module_path or '-'}")


def _check(args: argparse.Namespace) -> int:
    progress = _Progress(3 if not args.fix else 4)
    progress(f"loading {args.target}")
    model, inputs = _model_and_inputs(args, need_inputs=True)
    dtype = parse_dtype(args.dtype)
    progress("transforming and running fp32 and transformed")
    result = _run_model("being checked", lambda: check_numerics(
        model, inputs, dtype, upsample=args.upsample))
    progress("comparing")
    _print_check(result, args.rtol, args.top)
    if result.passed(args.rtol):
        print("check passed")
        return 0
    if not args.fix:
        print("check failed: run with --fix to search for nodes to keep in fp32")
        return 1
    progress("searching for nodes to keep in fp32")
    try:
        keep = _run_model("being searched", lambda: find_fp32_nodes(
            model, inputs, rtol=args.rtol, dtype=dtype, upsample=args.upsample))
    except RuntimeError as exc:
        print(f"check failed: {exc}")
        return 1
    fixed = check_numerics(model, inputs, dtype, keep_fp32=keep, upsample=args.upsample)
    print(f"keep_fp32={keep!r}")
    _print_check(fixed, args.rtol, args.top)
    print("check passed with keep_fp32" if fixed.passed(args.rtol) else "check failed")
    return 0 if fixed.passed(args.rtol) else 1


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo_model

    model, inputs = demo_model()
    policy = Policy(dtype=parse_dtype(args.dtype), upsample=args.upsample)
    start = time.perf_counter()
    gm = transform_with(model, policy, inputs)
    elapsed = time.perf_counter() - start
    rep = report(gm)
    print(rep)
    with torch.no_grad():
        ref = model(*inputs)
        ours = gm(*inputs)
        with torch.autocast("cpu", dtype=policy.dtype):
            auto = model(*inputs)
    print(f"\ntransform: {elapsed:.2f} s ({len(gm.graph.nodes)} nodes, {len(rep.casts)} casts)")
    print(f"\nrelative error against fp32 ({args.dtype}):")
    print(f"  {'output':<10}{'amprewrite':>14}{'autocast':>14}")
    for name, o, a, r in zip(("image", "bce loss"), ours, auto, ref):
        print(f"  {name:<10}{rel_err(o, r):>14.3e}{rel_err(a, r):>14.3e}")
    if args.out:
        files = write_artefacts(model, inputs, policy, Path(args.out), set(FORMATS), False,
                                _Progress(4), check=True)
        print(f"\nwrote {len(files)} files to {args.out}: {', '.join(sorted(files))}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="path/to/file.py:factory or package.module:factory")
    p.add_argument("--inputs", nargs="+", metavar="SPEC",
                   help="example inputs: 2x3x64x64, int64:1x1024:0-512 (one spec per input)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--upsample", choices=("auto", "always", "never"), default="auto")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amprewrite", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="transform the built-in demo model and print the report")
    demo.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    demo.add_argument("--upsample", choices=("auto", "always", "never"), default="always",
                      help="the demo shows the exact upsample rewrite by default; 'auto' "
                           "rewrites only where the device has no kernel")
    demo.add_argument("--out", help="also write the dump artefacts for the demo model here")
    demo.set_defaults(run=_demo)
    dump = sub.add_parser("dump", help="write the graph before and after, diff, report, renders")
    _common(dump)
    dump.add_argument("--out", default="amprewrite-out")
    dump.add_argument("--format", default=",".join(FORMATS),
                      help="comma list of text,dot,svg,html,model-explorer (default: all)")
    dump.add_argument("--check", action="store_true",
                      help="also run fp32 and transformed: per-node error in the HTML report and "
                           "a Model Explorer overlay (needs example inputs)")
    dump.add_argument("--per-pass", action="store_true", help="also the graph after each pass")
    dump.set_defaults(run=_dump)
    check = sub.add_parser("check", help="compare with fp32; find the first non-finite node")
    _common(check)
    check.add_argument("--rtol", type=float, default=1e-2)
    check.add_argument("--top", type=int, default=10, help="how many worst nodes to list")
    check.add_argument("--fix", action="store_true",
                       help="search for nodes to keep in fp32 so the check passes")
    check.set_defaults(run=_check)
    explore = sub.add_parser("explore", help="open both graphs in Model Explorer (localhost)")
    _common(explore)
    explore.add_argument("--host", default="localhost")
    explore.add_argument("--port", type=int, default=8080)
    explore.add_argument("--no-browser", action="store_true",
                         help="print the address instead of opening a browser")
    explore.add_argument("--no-check", action="store_true",
                         help="skip the per-node error overlay (saves two model runs)")
    explore.add_argument("--out", help="keep the JSON files here (default: a temporary folder)")
    explore.set_defaults(run=_explore)
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
