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
- ``amprewrite export TARGET [--inputs SPEC ...] [--to pt2|aoti|onnx] [--out PATH] [--static]
  [--dynamic-seq] [--no-check]``: transform, write a torch.export program, an AOTInductor
  package or ONNX, load it back and run it at two batch sizes (and sequence lengths) against
  fp32, autocast and the GraphModule; exit status 1 when it fails to load or run or departs
  from the GraphModule.
- ``amprewrite families``: the op-family table.

TARGET is ``path/to/file.py:factory`` or ``package.module:factory``; the factory returns a model
or ``(model, example_inputs)``, the inputs a tuple or a dict of keyword inputs. Input specs:
``2x3x64x64``, ``int64:1x1024:0-512``.

Errors print one line, ``amprewrite: error: ...``, and exit with status 2; Ctrl-C prints one line
and exits with status 130, also while torch is still loading: this module and ``amprewrite``'s
``__init__`` import no torch, so everything that does runs inside :func:`main`, and ``--help``,
``--version`` and the usage errors found before the model is loaded never import it. A closed output
pipe (``amprewrite families | head``) ends the command quietly. Run as a command, the process
ends as soon as the command is done (:func:`main` skips the interpreter's teardown of torch).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .errors import AmpRewriteError
from .progress import Steps

# No torch at import (see the module docstring): .dtypes and .target are imported where used.

__all__ = ["main", "write_artefacts"]

FORMATS = ("text", "dot", "svg", "html", "model-explorer")
# Above this many nodes the default --format leaves svg out: Graphviz's dot layout time grows
# steeply with the graph (LLaMA graphs on the 2-core CI machine: 480 nodes 1.5 s, 620 3.9 s,
# 760 30 s, 1,286 3 min 38 s; docs/cli.md, "dump").
SVG_MAX_NODES = 600
RENDER_TIMEOUT = 120.0
_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


# --- wording: the library's errors name Python keywords; the CLI user types flags ------------

_KEYWORD_TO_FLAG = [
    (r"[Pp]ass example_inputs=\(\.\.\.\) to (?:amprewrite\.)?transform", "pass --inputs SPEC ..."),
    (r"example_inputs=\(\.\.\.\)", "--inputs SPEC ..."),
    (r"model\(\*example_inputs\)", "the model called on --inputs"),
    (r"\bexample_inputs\b", "inputs (--inputs)"),
    (r"\bdtype=torch\.bfloat16 \(or 'bf16'\)", "--dtype bf16"),
    (r"\bdtype=torch\.float16 \(or 'fp16'\)", "--dtype fp16"),
    (r"\bupsample='(\w+)'", r"--upsample \1"),
    (r"\brtol=", "--rtol "),
    (r"\bcheck=False\b", "--no-check"),
    (r"\bdynamic_batch=False\b", "--static"),
    (r"\bdynamic_seq=True\b", "--dynamic-seq"),
    (r"\bto='(\w+)'", r"--to \1"),
]


def cli_wording(message: str) -> str:
    """``message`` with the Python keywords it names (``example_inputs=(...)``) written as the
    command line's flags (``--inputs SPEC ...``); the one place where the two are mapped.

    >>> cli_wording("Pass example_inputs=(...) to amprewrite.transform so it is captured")
    'pass --inputs SPEC ... so it is captured'
    """
    for pattern, flag in _KEYWORD_TO_FLAG:
        message = re.sub(pattern, flag, message)
    return re.sub(r"\b(keep_fp32|allow_low)=(\[[^\]]*\])", _selectors_as_flags, message)


def _selectors_as_flags(match: re.Match) -> str:
    """``keep_fp32=['a', 'node:b']`` as ``--keep-fp32 a --keep-fp32 node:b``, shell-quoted."""
    import ast
    import shlex

    try:
        items = ast.literal_eval(match[2])
    except (ValueError, SyntaxError):
        return match[0]  # a placeholder such as [<module path>]: left as Python
    flag = "--" + match[1].replace("_", "-")
    return " ".join(f"{flag} {shlex.quote(str(item))}" for item in items)


# --- argument types: every numeric flag is checked where it is parsed --------------------------

def _dtype_flag(text: str) -> str:
    from .graph.dtypes import low_dtype_name, low_dtype_names

    name = low_dtype_name(text)
    if name is None:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not bfloat16 or float16; use one of {', '.join(low_dtype_names())}")
    return _SHORT[name]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got '{text}'")
    return value


def _positive_int(text: str) -> int:
    if not re.fullmatch(r"\+?\d+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, got '{text}'")
    return int(text)


def _port(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got '{text}'")
    return int(text)


def _formats(text: str) -> set[str]:
    from .precision.target import UsageError

    chosen = {f.strip() for f in text.split(",") if f.strip()}
    bad = chosen - set(FORMATS)
    if bad or not chosen:
        raise UsageError(f"--format takes a comma list of {', '.join(FORMATS)}; got '{text}'.")
    return chosen


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line with a pointer to ``--help`` (argparse prints the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# --- loading the model and its inputs -------------------------------------------------------

@dataclass
class _Target:
    model: object
    inputs: tuple | dict | None  # a dict: keyword inputs (model(**inputs))
    where: str  # what the inputs are, for messages: "--inputs 4x16" or "the inputs f() returns"
    flags: list[str] = field(default_factory=list)  # --inputs ... to repeat in suggestions


def _load(args: argparse.Namespace, need_inputs: bool) -> _Target:
    from .api import _check_model
    from .precision.target import UsageError, load_target, parse_input

    model, inputs = load_target(args.target)
    where = f"the example inputs {args.target}() returns"
    flags: list[str] = []
    if args.inputs:
        if inputs is not None:  # said, not silent: the factory's own inputs are set aside
            print(f"note: --inputs replaces the example inputs {args.target}() returns "
                  f"({_describe(inputs)})", file=sys.stderr)
        inputs = tuple(parse_input(s, seed=i) for i, s in enumerate(args.inputs))
        where, flags = f"--inputs {' '.join(args.inputs)}", ["--inputs", *args.inputs]
    if need_inputs and inputs is None:
        raise UsageError(f"{args.target} gives no example inputs: pass --inputs, e.g. "
                         "--inputs 2x3x64x64 int64:2x16:0-1000.")
    _check_model(model)  # a meta-device model is the model's problem, whatever the inputs
    return _Target(model, inputs, where, flags)


def _describe(inputs: object) -> str:
    import torch
    from torch.utils import _pytree as pytree

    shown = [f"{str(t.dtype).replace('torch.', '')}[{','.join(map(str, t.shape))}]"
             for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return ", ".join(shown) or "no tensors"


def _plain_failure(target: _Target) -> str | None:
    """Why the model fails on the inputs without amprewrite, or None when it runs."""
    import torch

    inputs = target.inputs
    try:
        with torch.no_grad():
            if isinstance(inputs, dict):
                target.model(**inputs)
            else:
                target.model(*inputs)
    except Exception as exc:
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _attempt(what: str, fn, target: _Target):
    """Run a step; on failure say whose fault it is: the model's on these inputs (it fails
    without amprewrite too) or amprewrite's (it runs in fp32)."""
    from .precision.target import UsageError

    try:
        return fn()
    except Exception as exc:
        if target.inputs is not None and not isinstance(exc, UsageError):
            plain = _plain_failure(target)
            if plain is not None:
                fix = ("give --inputs the shapes and dtypes the model's forward takes (a dtype "
                       "prefix makes integers: int64:1x128:0-1000)" if target.flags else
                       "fix the model or the inputs the factory returns (or pass --inputs)")
                raise UsageError(
                    f"the model fails on {target.where} ({_describe(target.inputs)}) without "
                    f"amprewrite, so this is not an amprewrite failure: {plain}. To fix it, "
                    f"{fix}.") from None
        if isinstance(exc, AmpRewriteError):
            raise
        raise UsageError(
            f"amprewrite failed while {what} a model that runs on these inputs in fp32: "
            f"{type(exc).__name__}: {_first_line(exc)}. This is amprewrite's fault: please "
            "report it with this command line (AMPREWRITE_DEBUG=1 adds checks after each "
            "pass).") from None


def _policy(args: argparse.Namespace, **changes):
    from .precision.policy import Policy

    # dump shows the graph and check measures its error itself: neither stops at verification.
    return Policy(dtype=args.dtype, upsample=getattr(args, "upsample", "auto"), verify=False,
                  **{**_selector_flags(args), **changes})


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _out_folder(out: str, flag: str = "--out") -> Path:
    """``out`` as a folder the command can write into, checked before any model work."""
    from .precision.target import UsageError

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {shlex.quote(out)} is a file, and the command writes several "
                         f"files into a folder: give {flag} a folder name (new or existing).")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {shlex.quote(out)} lies under {shlex.quote(str(parent))}, "
                         f"which is a file: give {flag} a folder that can be made.")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {shlex.quote(out)}: {shlex.quote(str(parent))} is not "
                         f"writable; give {flag} a folder you can write to.")
    return path


# --- dump -----------------------------------------------------------------------------------

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

    from .api import transform_with
    from .capture.trace import capture
    from .precision.report import report
    from .show.html import report_page
    from .show.numerics import check_numerics
    from .show.render import SvgRender, node_table, to_dot
    from .show.views import rewritten_nodes

    target = _Target(model, inputs, "the example inputs")
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    notes: list[str] = []

    def write(name: str, text: str) -> None:
        files[name] = out / name
        files[name].write_text(text)

    steps.step("capturing the graph before")
    before = _attempt("capturing", lambda: capture(model, inputs).gm, target)
    passes: list[tuple[str, str]] = []
    if after is None:
        steps.step("capturing again and running the passes")
        after = _attempt("transforming", lambda: transform_with(
            model, policy, inputs, on_pass=(lambda n, g: passes.append((n, g.code)))
            if per_pass else None), target)
    rep = report(after)
    rewritten = rewritten_nodes(after)
    result = None
    if check:
        steps.step("running fp32 and transformed for the per-node error")
        result = _attempt("checking", lambda: check_numerics(model, inputs, policy.dtype,
                                                             gm=after), target)
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
        if "html" in formats:
            write("index.html", report_page(before, after, rewritten, result,
                                            report_text=str(rep),
                                            title=f"amprewrite: {type(model).__name__}"))
        if "model-explorer" in formats:
            from .show.explorer import write_model_explorer

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


def _dump(args: argparse.Namespace) -> int:
    formats = _formats(args.format) if args.format is not None else None
    out = _out_folder(args.out)
    if formats is not None and "svg" in formats and shutil.which("dot") is None:
        from .precision.target import UsageError

        others = ",".join(f for f in FORMATS if f in formats and f != "svg")
        raise UsageError(
            "--format svg needs Graphviz's dot, which is not on PATH: install graphviz "
            "(apt-get install graphviz, brew install graphviz), or leave svg out"
            + (f" (--format {others})" if others else " (--format html shows the graph "
               "in a browser)") + ".")
    steps_total = 1 + artefact_steps(args.check)
    with Steps(steps_total, log=True) as steps:
        steps.step(f"loading {args.target}")
        target = _load(args, need_inputs=args.check)
        made = write_artefacts(target.model, target.inputs, _policy(args), out,
                               formats, args.per_pass, steps, check=args.check,
                               render_timeout=args.render_timeout)
    files = made.files
    if not files:
        print(f"wrote no files to {args.out}")
        for note in made.notes:
            print(f"note: {note}")
        return 1
    print(f"wrote {_plural(len(files), 'file')} to {args.out}: {', '.join(sorted(files))}")
    for note in made.notes:
        print(f"note: {note}")
    if "index.html" in files:
        print(f"open {shlex.quote(str(files['index.html']))} in a browser for the report")
    if "model-explorer/amprewrite_graphs.json" in files:
        graphs = files["model-explorer/amprewrite_graphs.json"]
        overlays = ",".join(str(p) for p in sorted(graphs.parent.glob("*.json")) if p != graphs)
        again = shlex.join(["amprewrite", "explore", args.target, *target.flags,
                            *_option_flags(args)]
                           + (["--dtype", args.dtype] if args.dtype != "bf16" else []))
        explorer = shlex.join(["model-explorer", str(graphs)]
                              + ([f"--node_data_paths={overlays}"] if overlays else []))
        print(f"Model Explorer: `{again}` shows these graphs; or run `{explorer}`")
    return 0


# --- compiled -------------------------------------------------------------------------------

def _compiled(args: argparse.Namespace) -> int:
    import operator

    import torch

    from .capture.trace import split_inputs
    from .compile.backend import backend
    from .precision.report import report
    from .precision.target import UsageError

    if args.calibration:
        raise UsageError("--calibration is transform's: the backend plans from the calls it "
                         "sees (each block's first call); leave it out here.")
    target = _load(args, need_inputs=True)
    options = {k: v for k, v in _selector_flags(args).items() if k != "calibration"}
    compile_with = backend(inner="eager", dtype=args.dtype, upsample=args.upsample, **options)
    model = target.model
    if args.per_block:
        try:
            blocks = operator.attrgetter(args.per_block)(model)
        except AttributeError:
            blocks = None
        if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise UsageError(f"--per-block {args.per_block}: the model has no ModuleList or "
                             "Sequential there; name the attribute that holds the blocks "
                             "(model.layers, transformer.h).")
        for k, block in enumerate(blocks):
            blocks[k] = torch.compile(block, backend=compile_with)
    else:
        model = torch.compile(model, backend=compile_with)
    pos, kw = split_inputs(target.inputs)
    with torch.no_grad():
        _attempt("running the compiled model", lambda: model(*pos, **kw), target)
    print(report(model))
    return 0


# --- explore --------------------------------------------------------------------------------

def _explore(args: argparse.Namespace) -> int:
    from .show.explorer import _port_free, _require, prepare, serve

    _require()  # the install hint and a busy port before any capture work
    _port_free(args.host, args.port)
    with contextlib.ExitStack() as stack:
        with Steps(3, log=True) as steps:
            steps.step(f"loading {args.target}")
            target = _load(args, need_inputs=False)
            steps.step("capturing, transforming" + (
                "" if args.no_check or target.inputs is None
                else " and measuring the per-node error"))
            # Without --out the files live as long as the server: removed when it stops.
            out = args.out or stack.enter_context(
                tempfile.TemporaryDirectory(prefix="amprewrite-me-"))
            files = _attempt("transforming", lambda: prepare(
                target.model, target.inputs, args.dtype, check=not args.no_check, out=out,
                upsample=args.upsample), target)
            steps.step("starting Model Explorer")
        serve(files, args.host, args.port, open_browser=not args.no_browser)
    return 0


# --- check ----------------------------------------------------------------------------------

def _print_check(result, rtol: float, top: int) -> bool:
    """Print the check's result; whether it listed per-node errors."""
    if result.outputs:  # else there is no output error to show ("nothing to compare")
        print(f"output error vs fp32: {result.output_error:.3e} (rtol {rtol:g}); "
              f"outputs finite: {result.finite}")
    if result.first_nonfinite is not None:
        n = result.first_nonfinite
        print(f"first non-finite node: {n.node} ({n.precision}, family {n.family or '-'}, "
              f"module {n.module_path or '-'}, source {n.source or '-'})")
    rows = [r for r in result.nodes
            if r.rel_err is not None and r.precision not in ("placeholder", "get_attr")][:top]
    if rows:
        from .precision.report import text_table

        print(f"worst {len(rows)} nodes (relative error vs the fp32 graph, same node name):")
        table = text_table([[r.node, f"{r.rel_err:.3e}", r.precision, r.family or "-",
                             r.module_path or "-"] for r in rows])
        print("\n".join("  " + line for line in table.splitlines()))
    return bool(rows)


def _check(args: argparse.Namespace) -> int:
    from .api import transform_with
    from .precision.report import report
    from .show.numerics import check_numerics, find_fp32_nodes

    dtype = args.dtype
    keep = fixed = fixed_gm = search_error = None
    with Steps(2 if not args.fix else 4, log=True) as steps:
        steps.step(f"loading {args.target}")
        target = _load(args, need_inputs=True)
        model, inputs = target.model, target.inputs
        steps.step("transforming, then running fp32 and transformed")
        flags = _selector_flags(args)
        result = _attempt("checking", lambda: check_numerics(
            model, inputs, dtype, upsample=args.upsample, **flags), target)
        if args.fix and result.outputs != 0 and not result.passed(args.rtol):
            steps.step("searching for nodes to keep in fp32")
            try:
                keep = _attempt("searching", lambda: find_fp32_nodes(
                    model, inputs, rtol=args.rtol, dtype=dtype, upsample=args.upsample,
                    **flags), target)
            except RuntimeError as exc:
                search_error = exc
            if keep is not None:
                steps.step(f"checking with {_plural(len(keep), 'node')} kept in fp32")
                fixed_gm = _attempt("transforming", lambda: transform_with(
                    model, _policy(args, keep_fp32=tuple(keep)), inputs), target)
                fixed = check_numerics(model, inputs, dtype, gm=fixed_gm)
    shown = _print_check(result, args.rtol, args.top)
    if result.outputs == 0:
        print("check: nothing to compare: the model returns no floating-point outputs, only "
              "integer or bool values" + ("; the per-node errors above compare the float "
                                          "values inside it" if shown else ""))
        return 0
    if result.passed(args.rtol):
        print("check passed")
        return 0
    if not args.fix:
        print("check failed: run with --fix to search for nodes to keep in fp32")
        return 1
    if keep is None:
        last = re.search(r"last: ([^,]+), finite=(\w+)", str(search_error))
        reached = f" (last: error {last[1]}, finite {last[2]})" if last else ""
        print(f"check failed: --fix kept up to 16 nodes in fp32 without bringing the output "
              f"error under --rtol {args.rtol:g}{reached}; raise --rtol, or keep whole modules "
              "in fp32: --keep-fp32 <module path>")
        return 1
    print(f"--fix keeps in fp32: {cli_wording(f'keep_fp32={keep!r}')} (add to dump, export "
          "or check)")
    _print_check(fixed, args.rtol, args.top)
    low = report(fixed_gm).counts().get("low", 0)
    if low == 0:
        print(f"check failed: --fix kept every low-precision op in fp32 "
              f"({_plural(len(keep), 'node')}): nothing runs in {dtype} any more, so the "
              f"error it reaches is fp32's. In {dtype} this model does not meet --rtol "
              f"{args.rtol:g}; raise --rtol (bf16 rounds at 3.9e-3, fp16 at 4.9e-4)")
        return 1
    if fixed.passed(args.rtol):
        print(f"check passed with --keep-fp32 ({_plural(len(keep), 'node')} in fp32, "
              f"{_plural(low, 'op')} still in {dtype})")
        return 0
    print("check failed")
    return 1


# --- export ---------------------------------------------------------------------------------

_EXTENSION = {"pt2": ".pt2", "aoti": ".aoti.pt2", "onnx": ".onnx"}


def _export(args: argparse.Namespace) -> int:
    from .deploy.export import export, preflight

    if args.static and args.dynamic_seq:
        from .precision.target import UsageError

        raise UsageError("--static fixes every size, --dynamic-seq makes the sequence dynamic: "
                         "pass one of them (--dynamic-seq alone keeps the batch dynamic too).")
    out = Path(args.out or args.target.rsplit(":", 1)[-1] + _EXTENSION[args.to])
    preflight(args.to, args.dtype, not args.no_check, out)  # bf16 ONNX, packages: before work
    with Steps(2, log=True) as steps:
        steps.step(f"loading {args.target}")
        target = _load(args, need_inputs=True)
        was_training = target.model.training
        target.model.eval()  # the model is ours, loaded for this command; export is inference
        steps.step(f"exporting to {out}")
        result = _attempt("exporting", lambda: export(
            target.model, target.inputs, path=out, to=args.to, dtype=args.dtype,
            dynamic_batch=not args.static, dynamic_seq=args.dynamic_seq,
            check=not args.no_check, upsample=args.upsample,
            **_selector_flags(args)),
            target)
    if was_training:
        print("note: the factory returned the model in train mode; it was exported in eval "
              "mode, for inference")
    print(cli_wording(result.summary()))
    return 0 if result.passed or result.skipped is not None else 1


# --- demo -----------------------------------------------------------------------------------

def _demo(args: argparse.Namespace) -> int:
    if args.out:
        _out_folder(args.out)
    with Steps(3 + (artefact_steps(True, transformed=True) if args.out else 0),
               log=True) as steps:
        steps.step("building the demo model")
        import time

        import torch

        from .api import transform_with
        from .demo import demo_model
        from .precision.policy import Policy
        from .precision.report import report
        from .show.numerics import rel_err

        model, inputs = demo_model()
        policy = Policy(dtype=args.dtype, upsample=args.upsample)
        steps.step("transforming")
        start = time.perf_counter()
        gm = transform_with(model, policy, inputs)
        elapsed = time.perf_counter() - start
        steps.step("running fp32, amprewrite and autocast")
        with torch.no_grad():
            ref = model(*inputs)
            ours = gm(*inputs)
            with torch.autocast("cpu", dtype=policy.dtype):
                auto = model(*inputs)
        made = None
        if args.out:
            made = write_artefacts(model, inputs, policy, Path(args.out), None, False, steps,
                                   check=True, after=gm)
    rep = report(gm)
    print(rep)
    print(f"\ntransform: {elapsed:.2f} s ({len(gm.graph.nodes)} nodes, {len(rep.casts)} casts)")
    print(f"\nrelative error against fp32 ({args.dtype}):")
    print(f"  {'output':<10}{'amprewrite':>14}{'autocast':>14}")
    for name, o, a, r in zip(("image", "bce loss"), ours, auto, ref):
        print(f"  {name:<10}{rel_err(o, r):>14.3e}{rel_err(a, r):>14.3e}")
    if made is not None:
        print(f"\nwrote {_plural(len(made.files), 'file')} to {args.out}: "
              f"{', '.join(sorted(made.files))}")
        for note in made.notes:
            print(f"note: {note}")
    return 0


# --- the parser -----------------------------------------------------------------------------

def _dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", type=_dtype_flag, default="bf16", metavar="DTYPE",
                   help="bf16 (default) or fp16; also bfloat16, float16, half")


def _common(p: argparse.ArgumentParser) -> None:
    from .graph.dtypes import NAMES

    # nargs="?" with a check after parsing: `check --inputs 4x16 file.py:mlp` would otherwise
    # hand the target to --inputs and report it missing (see _take_target).
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="path/to/file.py:factory or package.module:factory")
    p.add_argument("--inputs", nargs="+", metavar="SPEC",
                   help="example inputs: 2x3x64x64, int64:1x1024:0-512 (one spec per input; "
                        f"dtypes: {', '.join(NAMES)})")
    _dtype_option(p)
    p.add_argument("--upsample", choices=("auto", "always", "never"), default="auto",
                   help="rewrite nearest upsampling by an integer factor as an exact "
                        "expand/reshape: auto (the default: where the device has no "
                        "low-precision kernel for it), always, never")
    p.add_argument("--keep-fp32", action="append", default=[], metavar="SEL",
                   help="compute this in fp32: a module path, an op family or node:NAME "
                        "(repeat the flag for more)")
    p.add_argument("--allow-low", action="append", default=[], metavar="SEL",
                   help="let an fp32 op run in its inputs' precision (same selectors)")
    p.add_argument("--calibration", metavar="FILE.py:NAME",
                   help="more input batches whose value ranges the plan reads: a function "
                        "(or iterable) in a file returning an iterable of batches, each like "
                        "the example inputs")
    p.add_argument("--overflow", choices=("auto", "fp32", "rescale"), default="auto",
                   help="fp16 with inputs: what a value past fp16's range gets (auto, the "
                        "default: fp32 unless that leaves under half the matmul FLOPs in fp16; "
                        "fp32; rescale)")
    p.add_argument("--fp8", nargs="?", const="tensorwise", default=None, metavar="RECIPE",
                   help="bf16 with inputs: run in float8 the linears that pay on an H100 and "
                        "pass the per-layer numerics check (recipe: tensorwise, the default, "
                        "rowwise, rowwise_with_gw_hp; needs torchao)")
    p.add_argument("--fp8-any-size", action="store_true",
                   help="with --fp8: turn the cost model off, so that small layers are "
                        "checked and may run in float8 too (to try it on a CPU)")


def _option_flags(args: argparse.Namespace) -> list[str]:
    """The common options given on the command line, as flags again (to repeat in a
    suggested command): ``--keep-fp32 fc --overflow fp32``."""
    flags: list[str] = []
    if getattr(args, "upsample", "auto") != "auto":
        flags += ["--upsample", args.upsample]
    for sel in getattr(args, "keep_fp32", ()) or ():
        flags += ["--keep-fp32", sel]
    for sel in getattr(args, "allow_low", ()) or ():
        flags += ["--allow-low", sel]
    if getattr(args, "calibration", None):
        flags += ["--calibration", args.calibration]
    if getattr(args, "overflow", "auto") != "auto":
        flags += ["--overflow", args.overflow]
    if getattr(args, "fp8", None) is not None:
        flags += ["--fp8", args.fp8]
    if getattr(args, "fp8_any_size", False):
        flags.append("--fp8-any-size")
    return flags


def _selector_flags(args: argparse.Namespace) -> dict:
    """transform's keep_fp32 / allow_low / calibration / overflow / fp8 keywords from the
    common flags."""
    out: dict = {"keep_fp32": tuple(getattr(args, "keep_fp32", ()) or ()),
                 "allow_low": tuple(getattr(args, "allow_low", ()) or ()),
                 "overflow": getattr(args, "overflow", "auto")}
    spec = getattr(args, "calibration", None)
    if spec:
        from .precision.target import load_batches

        out["calibration"] = load_batches(spec)
    recipe = getattr(args, "fp8", None)
    if recipe is not None or getattr(args, "fp8_any_size", False):
        out["fp8"] = {"recipe": recipe or "tensorwise",
                      **({"min_speedup": 0.0} if getattr(args, "fp8_any_size", False) else {})}
    return out


def _take_target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The target where an option before it took it (``--inputs 4x16 file.py:mlp``)."""
    if not hasattr(args, "target"):
        return
    from .precision.target import is_input_spec

    if args.target is None and args.inputs:
        for k, item in enumerate(args.inputs):
            if not is_input_spec(item):
                args.target = args.inputs.pop(k)
                break
    if args.target is None:
        parser.error("the following arguments are required: TARGET")


def _check_usage(args: argparse.Namespace) -> None:
    """The usage errors found without torch (a TARGET without a factory or a file, a bad input
    spec), reported before anything imports it: at once, not after seconds of imports."""
    from .precision.target import check_input_spec, check_target

    if getattr(args, "target", None) is not None:
        check_target(args.target)
    for spec in getattr(args, "inputs", None) or ():
        check_input_spec(spec)


def build_parser() -> argparse.ArgumentParser:
    """The ``amprewrite`` argument parser (docs/cli.md lists the same flags; a test checks)."""
    parser = _Parser(prog="amprewrite", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, **kwargs) -> argparse.ArgumentParser:
        # The one-line help in `amprewrite --help`, and the start of `amprewrite NAME --help`.
        kwargs.setdefault("description", summary[0].upper() + summary[1:] + ".")
        return sub.add_parser(name, help=summary, **kwargs)

    demo = command("demo", "transform the built-in demo model and print the report")
    _dtype_option(demo)
    demo.add_argument("--upsample", choices=("auto", "always", "never"), default="always",
                      help="the demo shows the exact upsample rewrite by default; 'auto' "
                           "rewrites only where the device has no kernel")
    demo.add_argument("--out", help="also write the dump artefacts for the demo model here")
    demo.set_defaults(run=_demo)
    dump = command("dump", "write the graph before and after, diff, report, renders")
    _common(dump)
    dump.add_argument("--out", default="amprewrite-out", metavar="DIR",
                      help="the folder to write into, made if missing (default amprewrite-out)")
    dump.add_argument("--format", default=None,
                      help="comma list of text,dot,svg,html,model-explorer (default: all, svg "
                           f"only for graphs of up to {SVG_MAX_NODES} nodes)")
    dump.add_argument("--check", action="store_true",
                      help="also run fp32 and transformed: per-node error in the HTML report and "
                           "a Model Explorer overlay (needs example inputs)")
    dump.add_argument("--per-pass", action="store_true", help="also the graph after each pass")
    dump.add_argument("--render-timeout", type=_positive_float, default=RENDER_TIMEOUT,
                      metavar="S", help="seconds dot may take for both svg files together "
                                        f"(default {RENDER_TIMEOUT:g})")
    dump.set_defaults(run=_dump)
    comp = command("compiled", "compile with backend='amprewrite' (each block, or the whole "
                               "model), call it once, print what the backend planned")
    _common(comp)
    comp.add_argument("--per-block", metavar="ATTR",
                      help="compile each module of this ModuleList/Sequential on its own, as "
                           "torchtitan does (model.layers); default: the whole model")
    comp.set_defaults(run=_compiled)
    check = command("check", "compare with fp32; find the first non-finite node")
    _common(check)
    check.add_argument("--rtol", type=_positive_float, default=1e-2,
                       help="largest relative output error that passes (default 1e-2)")
    check.add_argument("--top", type=_positive_int, default=10, metavar="N",
                       help="how many worst nodes to list (default 10)")
    check.add_argument("--fix", action="store_true",
                       help="search for nodes to keep in fp32 so the check passes")
    check.set_defaults(run=_check)
    explore = command("explore", "open both graphs in Model Explorer (localhost)")
    _common(explore)
    explore.add_argument("--host", default="localhost",
                         help="the address Model Explorer listens on (default localhost: this "
                              "machine only)")
    explore.add_argument("--port", type=_port, default=8080,
                         help="the port Model Explorer listens on (default 8080)")
    explore.add_argument("--no-browser", action="store_true",
                         help="print the address instead of opening a browser")
    explore.add_argument("--no-check", action="store_true",
                         help="skip the per-node error overlay (saves two model runs)")
    explore.add_argument("--out", help="keep the JSON files here (default: a temporary folder, "
                                       "removed when the server stops)")
    explore.set_defaults(run=_explore)
    exp = command("export", "write a .pt2, AOTInductor or ONNX artefact and check "
                                        "it against fp32, autocast and the GraphModule")
    _common(exp)
    exp.add_argument("--to", choices=("pt2", "aoti", "onnx"), default="pt2",
                     help="pt2: torch.export program (default); aoti: AOTInductor package; "
                          "onnx: ONNX file (fp16; bf16 only with --no-check; needs pip install "
                          "onnx onnxscript onnxruntime)")
    exp.add_argument("--out", metavar="PATH",
                     help="the file to write (default: FACTORY.pt2, FACTORY.aoti.pt2 or "
                          "FACTORY.onnx in the current directory)")
    shapes = exp.add_mutually_exclusive_group()
    shapes.add_argument("--dynamic-batch", action="store_true",
                        help="dimension 0 of every input dynamic where the model allows it "
                             "(the default)")
    shapes.add_argument("--static", action="store_true",
                        help="every size fixed to the example inputs'")
    exp.add_argument("--dynamic-seq", action="store_true",
                     help="dimension 1 of every input dynamic too where the model allows it: "
                          "the sequence of token ids and masks ([batch, seq]), so the artefact "
                          "takes other lengths; checked at the example's length and another")
    exp.add_argument("--no-check", action="store_true",
                     help="write the file without loading it back and running it (needed for "
                          "a bf16 ONNX file: onnxruntime has no bf16 Conv/MatMul on the CPU)")
    exp.set_defaults(run=_export)
    fams = command("families", "print the op-family table (Markdown)",
                          description="Print the op-family table as Markdown: each family, "
                                      "its precision class and every spelling it matches "
                                      "(docs/families.md is this output).")
    fams.set_defaults(run=_families)
    return parser


def _families(args: argparse.Namespace) -> int:
    from .precision.coverage import families_markdown

    print(families_markdown())
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return (f"amprewrite {__version__} (torch {torch}, Python "
            f"{'.'.join(map(str, sys.version_info[:3]))})")


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    # parse_known_args: an unknown flag after a command is that command's error, pointing at
    # its --help (parse_args would report it as the top-level parser's).
    args, extra = parser.parse_known_args(argv)
    command = parser._subparsers._group_actions[0].choices[args.command]
    if extra:
        import difflib

        flags = [f for a in command._actions for f in a.option_strings if f.startswith("--")]
        close = {x: difflib.get_close_matches(x.split("=")[0], flags, n=1)
                 for x in extra if x.startswith("--")}
        hint = "; ".join(f"did you mean {m[0]} for {x.split('=')[0]}?"
                         for x, m in close.items() if m)
        command.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({hint})" if hint else ""))
    _take_target(args, command)
    try:
        _check_usage(args)
        return args.run(args)
    except AmpRewriteError as exc:
        print(f"amprewrite: error: {cli_wording(str(exc))}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 check failed, 2 usage, 130 ^C,
    141 output pipe closed). With ``argv`` None it is the process's own command (the
    ``amprewrite`` script, ``python -m amprewrite``): then it ends the process itself once
    the command is done (:func:`_finish`)."""
    try:
        try:
            code = _run(argv)
        except SystemExit as exc:  # argparse: --help, --version, usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        sys.stdout.flush()
    except KeyboardInterrupt:
        print("amprewrite: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say; stdout's buffer goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    if argv is None:
        _finish(code)
    return code


def _finish(code: int) -> None:
    """End the process now: wait for the command's own threads, run the atexit handlers
    (temporary folders, torch's), flush, and exit without the interpreter's teardown, which
    frees torch's modules and the graphs one object at a time (0.4-2.7 s after the last line,
    docs/benchmarks.md, "Start and stop")."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        code = 141
    os._exit(code)


if __name__ == "__main__":
    main()
