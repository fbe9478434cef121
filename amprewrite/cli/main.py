"""The command line's parser and its run: flags to commands, errors to one line and an exit
status, and the process's quick end (:func:`main`). No torch at import."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading

from .. import __version__
from ..errors import AmpRewriteError
from .commands import run_check, run_compiled, run_demo, run_explore, run_export
from .dump import RENDER_TIMEOUT, SVG_MAX_NODES, run_dump, write_artefacts
from .flags import (
    Parser,
    cli_wording,
    dtype_flag,
    port,
    positive_float,
    positive_int,
)
from .plan import add_plan_command

# No torch at import (see the module docstring): .dtypes and .target are imported where used.

__all__ = ["build_parser", "main", "write_artefacts"]


# --- wording: the library's errors name Python keywords; the CLI user types flags ------------


# --- argument types: every numeric flag is checked where it is parsed --------------------------


# --- loading the model and its inputs -------------------------------------------------------


# --- dump -----------------------------------------------------------------------------------


# --- compiled -------------------------------------------------------------------------------


# --- explore --------------------------------------------------------------------------------


# --- check ----------------------------------------------------------------------------------


# --- export ---------------------------------------------------------------------------------


# --- demo -----------------------------------------------------------------------------------


# --- the parser -----------------------------------------------------------------------------

def _dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", type=dtype_flag, default="bf16", metavar="DTYPE",
                   help="bf16 (default) or fp16; also bfloat16, float16, half")


def _common(p: argparse.ArgumentParser) -> None:
    from ..graph.dtypes import NAMES

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
    p.add_argument("--plan", metavar="FILE",
                   help="apply a saved plan (amprewrite.save_plan's JSON) instead of deciding "
                        "again; nodes it does not know are decided afresh and named")


def _take_target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The target where an option before it took it (``--inputs 4x16 file.py:mlp``)."""
    if not hasattr(args, "target"):
        return
    from .target import is_input_spec

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
    from .target import check_input_spec, check_target

    if getattr(args, "target", None) is not None:
        check_target(args.target)
    for spec in getattr(args, "inputs", None) or ():
        check_input_spec(spec)


def build_parser() -> argparse.ArgumentParser:
    """The ``amprewrite`` argument parser (docs/cli.md lists the same flags; a test checks)."""
    parser = Parser(prog="amprewrite", description="The amprewrite command line.")
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
    demo.set_defaults(run=run_demo)
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
    dump.add_argument("--render-timeout", type=positive_float, default=RENDER_TIMEOUT,
                      metavar="S", help="seconds dot may take for both svg files together "
                                        f"(default {RENDER_TIMEOUT:g})")
    dump.set_defaults(run=run_dump)
    comp = command("compiled", "compile with backend='amprewrite' (each block, or the whole "
                               "model), call it once, print what the backend planned")
    _common(comp)
    comp.add_argument("--per-block", metavar="ATTR",
                      help="compile each module of this ModuleList/Sequential on its own, as "
                           "torchtitan does (model.layers); default: the whole model")
    comp.set_defaults(run=run_compiled)
    check = command("check", "compare with fp32; find the first non-finite node")
    _common(check)
    check.add_argument("--rtol", type=positive_float, default=1e-2,
                       help="largest relative output error that passes (default 1e-2)")
    check.add_argument("--top", type=positive_int, default=10, metavar="N",
                       help="how many worst nodes to list (default 10)")
    check.add_argument("--fix", action="store_true",
                       help="search for nodes to keep in fp32 so the check passes")
    check.set_defaults(run=run_check)
    explore = command("explore", "open both graphs in Model Explorer (localhost)")
    _common(explore)
    explore.add_argument("--host", default="localhost",
                         help="the address Model Explorer listens on (default localhost: this "
                              "machine only)")
    explore.add_argument("--port", type=port, default=8080,
                         help="the port Model Explorer listens on (default 8080)")
    explore.add_argument("--no-browser", action="store_true",
                         help="print the address instead of opening a browser")
    explore.add_argument("--no-check", action="store_true",
                         help="skip the per-node error overlay (saves two model runs)")
    explore.add_argument("--out", help="keep the JSON files here (default: a temporary folder, "
                                       "removed when the server stops)")
    explore.set_defaults(run=run_explore)
    exp = command("export", "write a .pt2, AOTInductor or ONNX artefact and check "
                                        "it against fp32, autocast and the GraphModule")
    _common(exp)
    exp.add_argument("--to", choices=("pt2", "aoti", "onnx"), default="pt2",
                     help="pt2: torch.export program (default); aoti: AOTInductor package; "
                          "onnx: ONNX file, fp16 unless --dtype says otherwise (onnxruntime's "
                          "CPU provider has no bf16 Conv/Gemm/MatMul: bf16 only with --dtype "
                          "bf16 --no-check; needs pip install onnx onnxscript onnxruntime)")
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
    # no --dtype: bf16, and fp16 for --to onnx (deploy.export.default_dtype)
    exp.set_defaults(run=run_export, dtype=None)
    fams = command("families", "print the op-family table (Markdown)",
                          description="Print the op-family table as Markdown: each family, "
                                      "its precision class and every spelling it matches "
                                      "(docs/families.md is this output).")
    fams.set_defaults(run=_families)
    add_plan_command(command("plan", "show a saved plan (plan show PLAN.json) or diff two "
                                     "(plan diff A.json B.json: exit 1 when they differ)"))
    return parser


def _families(args: argparse.Namespace) -> int:
    from ..precision.coverage import families_markdown

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

