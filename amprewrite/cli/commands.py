"""The commands besides ``dump``: ``compiled`` (the report of a model compiled with the backend),
``explore`` (Model Explorer on localhost), ``check`` (the numerics against fp32), ``export``
(a file to ship, loaded back and checked) and ``demo`` (the built-in demo model).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
from pathlib import Path

from ..progress import Steps
from .dump import artefact_steps, write_artefacts
from .flags import cli_wording
from .target import attempt, load, out_folder, plural, policy_of, selector_flags


def run_compiled(args: argparse.Namespace) -> int:
    import operator

    import torch

    from ..compile.backend import backend
    from ..graph.shapes import split_inputs
    from ..precision.report import report
    from .target import UsageError

    if args.calibration:
        raise UsageError("--calibration is transform's: the backend plans from the calls it "
                         "sees (each block's first call); leave it out here.")
    target = load(args, need_inputs=True)
    options = {k: v for k, v in selector_flags(args).items() if k != "calibration"}
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
        attempt("running the compiled model", lambda: model(*pos, **kw), target)
    print(report(model))
    return 0


def run_explore(args: argparse.Namespace) -> int:
    from ..show.explorer import _port_free, _require, prepare, serve

    _require()  # the install hint and a busy port before any capture work
    _port_free(args.host, args.port)
    with contextlib.ExitStack() as stack:
        with Steps(3, log=True) as steps:
            steps.step(f"loading {args.target}")
            target = load(args, need_inputs=False)
            steps.step("capturing, transforming" + (
                "" if args.no_check or target.inputs is None
                else " and measuring the per-node error"))
            # Without --out the files live as long as the server: removed when it stops.
            out = args.out or stack.enter_context(
                tempfile.TemporaryDirectory(prefix="amprewrite-me-"))
            files = attempt("transforming", lambda: prepare(
                target.model, target.inputs, args.dtype, check=not args.no_check, out=out,
                upsample=args.upsample), target)
            steps.step("starting Model Explorer")
        serve(files, args.host, args.port, open_browser=not args.no_browser)
    return 0


def _print_check(result, rtol: float, top: int) -> bool:
    """Print the check's result; whether it listed per-node errors."""
    if result.outputs:  # else there is no output error to show ("nothing to compare")
        print(f"output error vs fp32: {result.output_error:.3e} (rtol {rtol:g}); "
              f"outputs finite: {result.finite}")
    if result.first_nonfinite is not None:
        n = result.first_nonfinite
        print(f"first non-finite node: {n.node} ({n.precision}, family {n.family or '-'}, "
              f"module {n.module_path or '-'}, source {n.source or '-'})")
    # Nodes that compute and differ: inputs and parameters are the fp32 graph's own (error 0).
    differ = [r for r in result.nodes if r.rel_err is not None and r.rel_err != 0
              and r.precision not in ("input", "param", "output", "placeholder", "get_attr")]
    rows = differ[:top]
    if rows:
        from ..precision.report import text_table

        head = (f"worst {len(rows)} nodes" if len(differ) > len(rows)
                else f"the {plural(len(rows), 'node')} that differ")
        print(f"{head} (relative error vs the fp32 graph, same node name):")
        table = text_table([[r.node, f"{r.rel_err:.3e}", r.precision, r.family or "-",
                             r.module_path or "-"] for r in rows])
        print("\n".join("  " + line for line in table.splitlines()))
    return bool(rows)


def run_check(args: argparse.Namespace) -> int:
    from ..api import transform_with
    from ..capture.trace import keep_captured
    from ..precision.report import report
    from ..show.numerics import check_numerics, find_fp32_nodes

    dtype = args.dtype
    keep = fixed = fixed_gm = search_error = None
    # One capture for the check, each round of --fix and the check of what it found.
    with Steps(2 if not args.fix else 4, log=True) as steps, keep_captured():
        steps.step(f"loading {args.target}")
        target = load(args, need_inputs=True)
        model, inputs = target.model, target.inputs
        steps.step("transforming, then running fp32 and transformed")
        flags = selector_flags(args)
        result = attempt("checking", lambda: check_numerics(
            model, inputs, dtype, upsample=args.upsample, **flags), target)
        if args.fix and result.outputs != 0 and not result.passed(args.rtol):
            steps.step("searching for nodes to keep in fp32")
            try:
                keep = attempt("searching", lambda: find_fp32_nodes(
                    model, inputs, rtol=args.rtol, dtype=dtype, upsample=args.upsample,
                    **flags), target)
            except RuntimeError as exc:
                search_error = exc
            if keep is not None:
                steps.step(f"checking with {plural(len(keep), 'node')} kept in fp32")
                fixed_gm = attempt("transforming", lambda: transform_with(
                    model, policy_of(args, keep_fp32=tuple(keep)), inputs), target)
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
              f"({plural(len(keep), 'node')}): nothing runs in {dtype} any more, so the "
              f"error it reaches is fp32's. In {dtype} this model does not meet --rtol "
              f"{args.rtol:g}; raise --rtol (bf16 rounds at 3.9e-3, fp16 at 4.9e-4)")
        return 1
    if fixed.passed(args.rtol):
        print(f"check passed with --keep-fp32 ({plural(len(keep), 'node')} in fp32, "
              f"{plural(low, 'op')} still in {dtype})")
        return 0
    print("check failed")
    return 1


_EXTENSION = {"pt2": ".pt2", "aoti": ".aoti.pt2", "onnx": ".onnx"}


def run_export(args: argparse.Namespace) -> int:
    from ..deploy.export import export, preflight

    if args.static and args.dynamic_seq:
        from .target import UsageError

        raise UsageError("--static fixes every size, --dynamic-seq makes the sequence dynamic: "
                         "pass one of them (--dynamic-seq alone keeps the batch dynamic too).")
    out = Path(args.out or args.target.rsplit(":", 1)[-1] + _EXTENSION[args.to])
    # bf16 ONNX, packages: before work (no --dtype: export's default for the format)
    preflight(args.to, args.dtype, not args.no_check, out)
    with Steps(2, log=True) as steps:
        steps.step(f"loading {args.target}")
        target = load(args, need_inputs=True)
        was_training = target.model.training
        target.model.eval()  # the model is ours, loaded for this command; export is inference
        steps.step(f"exporting to {out}")
        result = attempt("exporting", lambda: export(
            target.model, target.inputs, path=out, to=args.to, dtype=args.dtype,
            dynamic_batch=not args.static, dynamic_seq=args.dynamic_seq,
            check=not args.no_check, upsample=args.upsample,
            **selector_flags(args)),
            target)
    if was_training:
        print("note: the factory returned the model in train mode; it was exported in eval "
              "mode, for inference")
    print(cli_wording(result.summary()))
    return 0 if result.passed or result.skipped is not None else 1


def run_demo(args: argparse.Namespace) -> int:
    if args.out:
        out_folder(args.out)
    with Steps(3 + (artefact_steps(True, transformed=True) if args.out else 0),
               log=True) as steps:
        steps.step("building the demo model")
        import time

        import torch

        from ..api import transform_with
        from ..demo import demo_model
        from ..precision.policy import Policy
        from ..precision.report import report
        from ..show.numerics import rel_err

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
        print(f"\nwrote {plural(len(made.files), 'file')} to {args.out}: "
              f"{', '.join(sorted(made.files))}")
        for note in made.notes:
            print(f"note: {note}")
    return 0
