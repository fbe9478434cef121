"""Export a transformed model for deployment, then check the file it wrote.

:func:`export` transforms a model, writes it as a ``torch.export`` program (``pt2``), an
AOTInductor package (``aoti``) or an ONNX file (``onnx``), loads the file back the way a
deployment would (``torch.export.load``, ``torch._inductor.aoti_load_package``, an
``onnxruntime.InferenceSession``), runs it at the example batch and at another batch size, and
compares its outputs with the fp32 model's, torch.autocast's and the GraphModule's. Behind
``amprewrite export`` (docs/cli.md); the facts it relies on are in docs/guide.md, "Deploying".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..api import transform
from ..capture.verify import VERIFY_ROUNDOFFS, rel_err, verify_bound
from ..errors import AmpRewriteError, PolicyError
from ..graph.shapes import BATCH, SEQ, capture_spec, sequence_limit, split_inputs
from ..precision.float8 import check_factor
from ..precision.plan_file import save_plan
from ..precision.policy import parse_dtype
from ..precision.report import text_table
from ..precision.saved_plan import PLAN_FILE
from ..progress import quiet_loggers, status
from .portable import foreign_types, loads_alone, plain, portable_module

__all__ = ["FORMATS", "ONNX_DTYPE_NOTE", "ONNX_INSTALL", "SAME_AS_GRAPH", "CheckRow",
           "DeployError", "DeployResult", "default_dtype", "export", "preflight",
           "sequence_limit"]

FORMATS = ("pt2", "aoti", "onnx")
"""What :func:`export` writes: a ``torch.export`` program, an AOTInductor package, ONNX."""

SAME_AS_GRAPH = 1e-6
# Formats that run kernels of their own (Inductor's generated code, onnxruntime's): held to
# transform's error bound, not to the GraphModule's outputs.
_OWN_KERNELS = ("aoti", "onnx")
"""Relative difference up to which an artefact's output counts as the GraphModule's."""

ONNX_INSTALL = "pip install onnx onnxscript onnxruntime"

_DESCRIBE = {"pt2": "torch.export program", "aoti": "AOTInductor package", "onnx": "ONNX file"}
_LOADER = {"pt2": "torch.export.load(path).module()",
           "aoti": "torch._inductor.aoti_load_package(path)",
           "onnx": "onnxruntime.InferenceSession (CPU provider)"}
# The weights go to a separate .data file past this size: one protobuf holds at most 2 GiB.
_ONNX_INLINE_BYTES = 1 << 30


class DeployError(AmpRewriteError, RuntimeError):
    """Exporting the transformed graph failed, or a package the format needs is missing."""


@dataclass(frozen=True)
class CheckRow:
    """The artefact run on one set of inputs, against the fp32 model, autocast and ``gm``."""

    batch: int | None  # dimension 0 of the batched inputs; None when no input has one
    error: float  # the artefact's relative error against the fp32 model
    autocast_error: float  # torch.autocast's on the same inputs (inf where autocast fails)
    graph_error: float  # the artefact's relative difference from the GraphModule's output
    # ONNX only: the file's error against fp32 with every value it declares float16 really
    # rounded (amprewrite/deploy/onnx_rounded.py); onnxruntime's CPU provider skips most roundings.
    rounded_error: float | None = None
    # dimension 1 of the inputs whose sequence is dynamic (export(dynamic_seq=True)), else None
    seq: int | None = None

    @property
    def equal(self) -> bool:
        """Whether the artefact's output is the GraphModule's within :data:`SAME_AS_GRAPH`."""
        return self.graph_error <= SAME_AS_GRAPH


@dataclass
class DeployResult:
    """What :func:`export` wrote and what the check of it found."""

    to: str
    dtype: torch.dtype
    files: list[Path]  # the artefact first (an ONNX file's external weights after it)
    gm: fx.GraphModule  # the transformed graph that was exported
    batch_range: tuple[int, float] | None  # the batch sizes the artefact takes; None: static
    rows: list[CheckRow] = field(default_factory=list)
    # the sequence lengths it takes (dimension 1; export(dynamic_seq=True)); None: static
    seq_range: tuple[int, float] | None = None
    rule: str = ""  # what every row must meet, in words
    problems: list[str] = field(default_factory=list)  # why the check failed
    skipped: str | None = None  # why the artefact was not loaded and run (check=False)
    notes: list[str] = field(default_factory=list)
    # Wall seconds of each step: "transform", "export" (torch.export.export), "write" (saving,
    # or the AOTInductor compile, or the ONNX translation) and "check" (loading and running).
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.files[0]

    @property
    def passed(self) -> bool:
        """The artefact was loaded and run, and every row meets :attr:`rule`."""
        return self.skipped is None and not self.problems

    def summary(self) -> str:
        """What was written, the table of errors and the verdict, as ``amprewrite export``
        prints them."""
        dtype = str(self.dtype).replace("torch.", "")
        shapes = ", ".join(f"{what} dynamic in {_range(r)}" for what, r in (
            ("batch", self.batch_range), ("sequence", self.seq_range)) if r is not None)
        shapes = shapes or "every size static"
        lines = [f"wrote {', '.join(map(str, self.files))} ({_DESCRIBE[self.to]}, {dtype}, "
                 f"{shapes})"]
        lines += [f"note: {note}" for note in self.notes]
        if self.skipped is not None:
            return "\n".join([*lines, f"not checked: {self.skipped}"])
        if self.rows:
            lines.append(f"loaded with {_LOADER[self.to]} and run; relative errors:")
            rounded = any(r.rounded_error is not None for r in self.rows)
            seq = self.seq_range is not None
            table = [["batch", *(["seq"] if seq else []), "vs fp32",
                      *([f"{dtype} rounded vs fp32"] if rounded else []),
                      "autocast vs fp32", "vs GraphModule", f"equal (<= {SAME_AS_GRAPH:g})"]]
            table += [["-" if r.batch is None else str(r.batch),
                       *([str(r.seq) if r.seq is not None else "-"] if seq else []),
                       f"{r.error:.3e}",
                       *([_num(r.rounded_error)] if rounded else []),
                       f"{r.autocast_error:.3e}", f"{r.graph_error:.3e}",
                       "yes" if r.equal else "no"] for r in self.rows]
            lines += ["  " + line for line in text_table(table).splitlines()]
        if self.passed:
            lines.append(f"check passed: {self.rule}")
        else:
            lines += [f"check failed: {p}" for p in self.problems]
        return "\n".join(lines)


def default_dtype(to: str) -> torch.dtype:
    """The dtype :func:`export` writes ``to`` in when it is given none: float16 for ONNX (a
    bf16 file onnxruntime's CPU provider refuses), bfloat16 otherwise.

    >>> default_dtype("onnx"), default_dtype("pt2")
    (torch.float16, torch.bfloat16)
    """
    return torch.float16 if to == "onnx" else torch.bfloat16


ONNX_DTYPE_NOTE = (
    "float16, the default for ONNX: onnxruntime's CPU provider has no bfloat16 Conv, Gemm or "
    "MatMul, so a bf16 file could be neither checked nor run there; dtype=torch.bfloat16 "
    "(or 'bf16') with check=False writes one for a runtime that has those kernels")


def preflight(to: str, dtype: torch.dtype | str | None, check: bool = True,
              path: str | os.PathLike | None = None) -> torch.dtype:
    """Refuse, before any work, what :func:`export` cannot do; return the dtype (``None``:
    :func:`default_dtype`).

    >>> preflight("onnx", "bf16")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    amprewrite.errors.PolicyError: onnxruntime's CPU provider has no bfloat16 kernels ...
    """
    if to not in FORMATS:
        raise PolicyError(f"to={to!r} is not a format export writes: use one of "
                          f"{', '.join(FORMATS)}.")
    dtype = parse_dtype(default_dtype(to) if dtype is None else dtype)
    if to == "aoti" and path is not None and Path(path).suffix != ".pt2":
        raise PolicyError(f"an AOTInductor package must be a .pt2 file, got path='{path}': "
                          f"name it {Path(path).with_suffix('.pt2').name}.")
    if to == "onnx":
        if dtype == torch.bfloat16 and check:
            raise PolicyError(
                "onnxruntime's CPU provider has no bfloat16 kernels for Conv, Gemm or MatMul: "
                "it refuses a bf16 ONNX file (\"Type 'tensor(bfloat16)' of input parameter "
                "... of operator (Conv) ... is invalid\", \"Could not find an implementation "
                "for Gemm(13)\", the same for MatMul(13)), so the file could be neither "
                "checked here nor run on a CPU. "
                "Export in float16 instead, the default for ONNX: pass dtype=torch.float16 "
                "(or 'fp16'), or leave the dtype out, and onnxruntime runs it on the CPU; or "
                "pass check=False to write the bf16 file unchecked, for a runtime that has "
                "bfloat16 kernels.")
        _require_onnx(check)
    return dtype


def _require_onnx(runtime: bool) -> None:
    needed = ["onnx", "onnxscript"] + (["onnxruntime"] if runtime else [])
    missing = [name for name in needed if not _importable(name)]
    if missing:
        why = ("torch.onnx's exporter needs onnx and onnxscript, and the check runs the file in "
               "onnxruntime")
        raise DeployError(
            f"ONNX export needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
            f" not installed ({why}). Install them with `{ONNX_INSTALL}`"
            + (", or pass check=False to write the file without running it."
               if missing == ["onnxruntime"] else "."))


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def export(model: nn.Module, example_inputs: object, *, path: str | os.PathLike,
           to: str = "pt2", dtype: torch.dtype | str | None = None,
           dynamic_batch: bool = True, dynamic_seq: bool = False, check: bool = True,
           other_batches: int = 1, **options: object) -> DeployResult:
    """Transform ``model``, write it to ``path`` as ``to`` and check the file.

    Args:
        model: the fp32 model, in eval mode (export is for inference; train mode would draw
            dropout masks and update batch-norm statistics). It is never modified.
        example_inputs: a tuple of positional inputs or a dict of keyword inputs.
        path: the file to write. AOTInductor packages must end in ``.pt2``.
        to: ``"pt2"`` (``torch.export.save``), ``"aoti"``
            (``torch._inductor.aoti_compile_and_package``) or ``"onnx"``
            (``torch.onnx.export(..., dynamo=True)``, then made lean by exact rewrites,
            :func:`amprewrite.deploy.onnx_lean.lean`, which also stores a float16 file's float32
            embedding tables float16, cast to float32 after the lookup; needs ``pip install
            onnx onnxscript onnxruntime``; float16 unless ``check=False``, see
            :func:`preflight`).
        dtype: ``"bf16"`` or ``"fp16"``, as for :func:`amprewrite.transform`; by default
            ``"bf16"``, and ``"fp16"`` for ``to="onnx"`` (onnxruntime's CPU provider has no
            bfloat16 Conv, Gemm or MatMul, so a bf16 file could be neither checked nor run
            there; a note in the result says so).
        dynamic_batch: dimension 0 of every input dynamic where the model allows it
            (``transform(dynamic_shapes="batch")`` and ``Dim.AUTO`` at export); ``False``
            fixes every size to the example's.
        dynamic_seq: dimension 1 of every input of two or more dimensions dynamic too where the
            model allows it (``Dim.AUTO``, as for the batch): the sequence of ``[batch, seq]``
            token ids and masks and ``[batch, seq, hidden]`` embeddings, so a language model's
            artefact takes other lengths than the example's. An input whose dimension 1 the
            model fixes (an image's channels) stays static; a note says so when none became
            dynamic. Checked, like the batch, at the example's length and another.
        check: load the file back, run it at the example batch and at another batch size (and
            with ``dynamic_seq`` at another sequence length), and compare (see
            :class:`DeployResult`); ``False`` only writes it, and skips the transform's own
            check against fp32 too (``verify=`` in ``options`` says otherwise).
        other_batches: how many batch sizes besides the example's the check runs, where the
            artefact's batch range has that many.
        options: more keywords for :func:`amprewrite.transform` (``keep_fp32``,
            ``upsample``, ...).

    The check holds a ``pt2`` artefact to the GraphModule's outputs within
    :data:`SAME_AS_GRAPH` relative: it is the same program on PyTorch's kernels. AOTInductor
    and onnxruntime run kernels of their own: Inductor's fp32 ``exp``, ``cos``, GroupNorm or
    BatchNorm differ from ATen's by about one fp32 unit, which flips some roundings to the low
    dtype (measured up to 6e-3 relative from the GraphModule on the zoo UNet2D in bf16, at the
    same error against fp32 as autocast's; docs/benchmarks.md, "Deploying"), and onnxruntime's
    float16 Conv and MatMul round differently. An ``aoti`` or ``onnx`` artefact is therefore
    held to the bound ``transform``'s own check accepts: its error against fp32 at most 4x
    autocast's plus 16 unit roundoffs; how far it is from the GraphModule is reported. An
    ``onnx`` file is also run with every value it declares float16 rounded to float16
    (:mod:`amprewrite.deploy.onnx_rounded`; onnxruntime's CPU provider computes most float16 ops in
    float32 and would hide an overflow) and held to the same bound
    (:attr:`CheckRow.rounded_error`).

    Example:
        >>> import tempfile, torch, amprewrite.deploy.export
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1)).eval()
        >>> with tempfile.TemporaryDirectory() as out:
        ...     result = amprewrite.deploy.export.export(model, (torch.randn(4, 8),),
        ...                                       path=f"{out}/model.pt2", dtype="bf16")
        ...     program = torch.export.load(f"{out}/model.pt2").module()
        ...     y = program(torch.randn(5, 8))
        >>> result.passed, [(row.batch, row.equal) for row in result.rows]
        (True, [(4, True), (7, True)])
        >>> y.dtype, result.batch_range  # from 1: the check ran batch 1 too
        (torch.float32, (1, inf))
    """
    chose = ONNX_DTYPE_NOTE if dtype is None and to == "onnx" else None
    dtype = preflight(to, dtype, check, path)
    if to == "onnx" and options.get("fp8") not in (None, False):
        raise PolicyError(
            "fp8 graphs do not go to ONNX: their float8 GEMMs are aten._scaled_mm, which "
            "torch.onnx has no translation for (torch 2.13), and ONNX has no float8 GEMM op (a "
            "float8 ONNX file is QuantizeLinear/DequantizeLinear around MatMul, for runtimes "
            "such as TensorRT to fuse; amprewrite does not write those). Export the fp8 graph "
            "to='pt2' or to='aoti', or to ONNX without fp8.")
    path = Path(path)
    if not isinstance(model, nn.Module):
        raise PolicyError(f"export takes an nn.Module, got {type(model).__name__}.")
    if model.training:
        raise PolicyError(
            "the model is in train mode: export writes a program for inference, and in train "
            "mode dropout draws masks and batch norm updates its statistics, so the artefact "
            "could not be compared with anything. Call model.eval() first.")
    args, kwargs = split_inputs(example_inputs)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    status(f"transforming to {str(dtype).replace('torch.', '')}", log=True)
    dims = (0,) * bool(dynamic_batch) + (SEQ,) * bool(dynamic_seq)
    # Dimension 0 alone: transform's own default, "batch"; with the sequence, the same
    # Dim.AUTO spec for dimensions 0 and 1, built on the model's arguments.
    seq_max, seq_why = sequence_limit(model) if dynamic_seq else (None, None)
    shapes = (None if not dims else BATCH if dims == (0,)
              else capture_spec(model, args, kwargs, BATCH, dims, seq_max)[0])
    # check=False (--no-check) is the export the user asked for, unchecked: the transform's
    # own check too, unless verify= says otherwise.
    gm = transform(model, dtype, example_inputs=example_inputs, dynamic_shapes=shapes,
                   **{"verify": check, **options})
    timings["transform"] = time.perf_counter() - start
    spec = capture_spec(gm, args, kwargs, BATCH, dims, seq_max)[0] if dims else None
    status("exporting with torch.export", log=True)
    start = time.perf_counter()
    try:
        # Outputs in torch's own containers: a ModelOutput or a cache in the program would
        # make it load only where transformers registered them (amprewrite.deploy.portable).
        ep = torch.export.export(portable_module(gm), args, kwargs, dynamic_shapes=spec)
    except Exception as exc:
        raise DeployError(
            f"torch.export.export failed on the transformed graph: {type(exc).__name__}: "
            f"{_first_line(exc)}. The GraphModule itself runs; please report the model, and "
            + ("try without dynamic_seq=True, or " if dynamic_seq else "try ")
            + "dynamic_batch=False meanwhile.") from None
    timings["export"] = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _quiet():
        # a .pt2 carries the plan next to the weights (docs/guide.md, "Plans")
        files = _WRITERS[to](ep, args, kwargs, path,
                             **({"plan": save_plan(gm)} if to == "pt2" else {}))
    timings["write"] = time.perf_counter() - start
    result = DeployResult(to, dtype, files, gm, _dim_range(ep, 0),
                          seq_range=_dim_range(ep, SEQ) if dynamic_seq else None,
                          timings=timings)
    if chose is not None:
        result.notes.append(chose)
    if result.seq_range is not None and seq_max is not None:
        result.notes.append(f"sequence lengths up to {seq_max}: the model's {seq_why}")
    guard = getattr(gm, "_amp_inputs", None)
    line = guard.bounded_by(0) if guard is not None else None
    if result.batch_range is not None and math.isfinite(result.batch_range[1]) and line:
        # diffusers' Upsample2D: `if hidden_states.shape[0] >= 64:` bounds its batch at 63
        result.notes.append(
            f"batch sizes up to {int(result.batch_range[1])}: the model's code branches on the "
            f"batch, {line}, and the program keeps the branch it was captured on")
    if dynamic_seq and result.seq_range is None:
        result.notes.append(
            "dynamic_seq: no input's dimension 1 became dynamic (the model fixes it, or no "
            "input has one of size 2 or more), so the artefact takes the example's length only")
    changed = foreign_types(getattr(gm.graph._codegen, "pytree_info", None)
                            and gm.graph._codegen.pytree_info.out_spec)
    if changed:
        result.notes.append(
            f"the program returns dicts and tuples where the model returns "
            f"{', '.join(sorted({c.__name__ for c in changed}))}, so that it loads where only "
            "torch is imported (a dataclass as a dict, a cache as its layers' tensors; "
            "docs/guide.md, \"Deploying\")")
    if not check:
        result.skipped = "the file was not loaded back or run (check=False)"
        return result
    sizes = "every batch size" + (" and sequence length" if result.seq_range else "")
    result.rule = (
        f"{'onnxruntime' if to == 'onnx' else 'the AOTInductor package'}'s error against fp32 "
        + ("and the file's with every value it declares low rounded " if to == "onnx" else "")
        + f"is within transform's own bound at {sizes} (4x autocast's + "
        f"{VERIFY_ROUNDOFFS} unit roundoffs of {str(dtype).replace('torch.', '')}; its own "
        "kernels round differently from the GraphModule's)" if to in _OWN_KERNELS else
        f"the artefact's outputs equal the GraphModule's within {SAME_AS_GRAPH:g} relative at "
        f"{sizes}")
    start = time.perf_counter()
    _check(result, model, ep, args, kwargs, path, other_batches)
    timings["check"] = time.perf_counter() - start
    return result


# --- writing ------------------------------------------------------------------------------

def _write_pt2(ep, args: tuple, kwargs: dict, path: Path, plan: str | None = None
               ) -> list[Path]:
    """The program, with the plan's text as the extra file ``PLAN_FILE``: read it back with
    ``torch.export.load(path, extra_files={PLAN_FILE: ""})`` and apply it with
    ``transform(..., plan=...)``."""
    torch.export.save(ep, path, extra_files={PLAN_FILE: plan} if plan else None)
    return [path]


def _write_aoti(ep, args: tuple, kwargs: dict, path: Path) -> list[Path]:
    status("compiling with AOTInductor (half a minute or more on a small CPU)", log=True)
    try:
        # emulate_precision_casts: Inductor otherwise computes a fused chain of low-precision
        # elementwise ops in fp32 without the roundings between them, and the package departs
        # from the GraphModule by about one roundoff (zoo LLaMA, bf16: 3.1e-3); with it, 0.
        torch._inductor.aoti_compile_and_package(
            ep, package_path=os.fspath(path),
            inductor_configs={"emulate_precision_casts": True})
    except Exception as exc:
        raise DeployError(
            f"AOTInductor failed to compile the exported program: {type(exc).__name__}: "
            f"{_first_line(exc)}. The torch.export program itself may still work: try "
            "to='pt2'.") from None
    return [path]


def _write_onnx(ep, args: tuple, kwargs: dict, path: Path) -> list[Path]:
    import onnx

    from .onnx_lean import lean

    status("writing ONNX with torch.onnx.export(dynamo=True)", log=True)
    size = sum(t.numel() * t.element_size() for t in ep.state_dict.values())
    external = size > _ONNX_INLINE_BYTES
    try:
        # optimize=False: onnxscript's optimizer (0.7) folds a batch norm kept in fp32 into the
        # fp16 Conv before it and writes fp32 weights for that Conv, which onnxruntime refuses
        # ("bound to different types"). onnx_lean.lean runs its folding passes without that
        # rewrite.
        torch.onnx.export(ep, args, os.fspath(path), kwargs=kwargs, dynamo=True,
                          optimize=False, verbose=False, external_data=external,
                          custom_translation_table=_transformers_translations())
    except Exception as exc:
        raise DeployError(
            f"torch.onnx.export failed on the exported program: {type(exc).__name__}: "
            f"{_first_line(exc)}. to='pt2' writes the torch.export program, which needs no "
            "translation.") from None
    data = path.with_name(path.name + ".data")
    status("making the ONNX file lean (weights read only in float16 stored float16)", log=True)
    model = onnx.load(os.fspath(path))
    try:
        # exact, but for tables=True: in a float16 file, a float32 embedding table is stored
        # float16 and its lookups cast to float32 after; and bias=True: a float16 bias added
        # in float32 where the sum is widened after, one rounding fewer; and softmax=True: a
        # float16 Softmax (attention's, as torch.onnx writes it) computed in float32 (onnx_lean.py)
        model = lean(model, tables=True, bias=True, softmax=True)
    except Exception as exc:  # a bug to report, not a reason to ship nothing
        logging.getLogger("amprewrite").warning(
            "the ONNX file is written as torch.onnx.export wrote it: making it lean failed "
            "(%s: %s); please report the model", type(exc).__name__, _first_line(exc))
        return [path, data] if external and data.exists() else [path]
    _name_onnx_io(model, ep)
    if external:
        data.unlink(missing_ok=True)  # onnx.save appends to an existing data file
    onnx.save(model, os.fspath(path), save_as_external_data=external, location=data.name)
    return [path, data] if external and data.exists() else [path]


def _transformers_translations() -> dict | None:
    """transformers' own ONNX translations of ops torch.onnx has none for (its exporter's table,
    ``transformers.exporters.exporter_onnx``): its MoE experts' ``grouped_mm_fallback`` (Mixtral,
    Qwen3-MoE), ``_grouped_mm``, ``bincount``. None without a transformers that ships one, and
    None where the process has not imported transformers: those ops come from its models, and
    importing it for a plain model cost seconds and printed torchao's load failures."""
    if "transformers" not in sys.modules:
        return None
    try:
        with quiet_loggers("torchao", "torch.utils._pytree"):
            from transformers.exporters.exporter_onnx import _ONNX_TRANSLATION_TABLE
    except Exception:  # older than its exporters (5.2x)
        return None
    return dict(_ONNX_TRANSLATION_TABLE) or None


def _name_onnx_io(model, ep) -> None:
    """Name the file's outputs after the model's (``logits``, ``past_key_values.0.1``; the
    export names them after graph nodes: ``layer_norm_4``) and its batch dimension ``batch``
    (the export's symbol: ``s72``) and a dynamic sequence ``sequence``, so a runtime's user
    reads them as the model's."""
    from torch.utils._pytree import keystr, tree_flatten_with_path

    graph = model.graph
    spec = ep.call_spec.out_spec  # the outputs' structure, without running the program
    out = pytree.tree_unflatten([0] * spec.num_leaves, spec)
    paths = [keystr(p) for p, _ in tree_flatten_with_path(out)[0]]
    if len(paths) == len(graph.output):
        taken = {i.name for i in graph.input} | {t.name for t in graph.initializer}
        renames = {}
        for k, (o, path) in enumerate(zip(graph.output, paths)):
            name = re.sub(r"[^\w.]+", ".", path).strip(".") or f"output_{k}"
            if name not in taken and name not in renames.values():
                renames[o.name] = name
        for node in graph.node:
            node.output[:] = [renames.get(n, n) for n in node.output]
            node.input[:] = [renames.get(n, n) for n in node.input]
        for o in graph.output:
            o.name = renames.get(o.name, o.name)
    # The symbol of dimension 0 of the inputs (one, when the batch is dynamic) is "batch"; of
    # dimension 1 (one, when the sequence is: export(dynamic_seq=True)) "sequence".
    names: dict[str, str] = {}
    for k, name in ((0, "batch"), (SEQ, "sequence")):
        symbols = {i.type.tensor_type.shape.dim[k].dim_param for i in graph.input
                   if i.type.HasField("tensor_type") and len(i.type.tensor_type.shape.dim) > k
                   and i.type.tensor_type.shape.dim[k].dim_param}
        if len(symbols) == 1 and not symbols & names.keys():
            names[symbols.pop()] = name
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param in names:  # (setting it on a static dim would clear its size)
                    dim.dim_param = names[dim.dim_param]


_WRITERS: dict[str, Callable[..., list[Path]]] = {
    "pt2": _write_pt2, "aoti": _write_aoti, "onnx": _write_onnx}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch.onnx's warnings (it lists the torchvision ops it skips) and FutureWarnings
    (torch's pytree warns about its own deprecations when a program is pickled): noise about
    torch's internals, nothing a user of the artefact can act on."""
    with quiet_loggers("torch.onnx"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


# --- loading back ---------------------------------------------------------------------------

def _load_pt2(path: Path) -> Callable[..., object]:
    return torch.export.load(path).module()


def _load_aoti(path: Path) -> Callable[..., object]:
    return torch._inductor.aoti_load_package(os.fspath(path))


class _OnnxFile:
    """An ONNX file in onnxruntime's CPU provider, as a deployment runs it; :meth:`rounded`
    runs it with every value it declares float16 really rounded (amprewrite/deploy/onnx_rounded.py:
    the CPU provider computes most float16 ops in float32 and drops the roundings between
    them, which hides overflow)."""

    def __init__(self, path: Path) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: it warns about each fold it cannot make
        self.path = path
        self.session = onnxruntime.InferenceSession(os.fspath(path), options,
                                                    providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]
        self._rounded = None

    def feeds(self, args: tuple, kwargs: dict) -> dict[str, object]:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if len(tensors) != len(self.names):
            raise RuntimeError(f"the ONNX graph takes {len(self.names)} inputs "
                               f"({', '.join(self.names)}) and the example has {len(tensors)} "
                               "tensors")
        return {n: t.detach().cpu().numpy() for n, t in zip(self.names, tensors)}

    def __call__(self, *args: object, **kwargs: object) -> list[torch.Tensor]:
        return [torch.from_numpy(a) for a in self.session.run(None, self.feeds(args, kwargs))]

    def rounded(self, *args: object, **kwargs: object) -> list[torch.Tensor]:
        from .onnx_rounded import RoundedSession

        if self._rounded is None:
            self._rounded = RoundedSession(self.path)
        return [torch.from_numpy(a) for a in self._rounded.run(self.feeds(args, kwargs))]


def _load_onnx(path: Path) -> Callable[..., object]:
    return _OnnxFile(path)


_LOADERS: dict[str, Callable[[Path], Callable[..., object]]] = {
    "pt2": _load_pt2, "aoti": _load_aoti, "onnx": _load_onnx}


# --- the check ------------------------------------------------------------------------------

def _check(result: DeployResult, model: nn.Module, ep, args: tuple, kwargs: dict,
           path: Path, other_batches: int = 1) -> None:
    artefact = _check_runs(result, model, ep, args, kwargs, path, other_batches)
    if artefact is not None:
        _probe_size_one(result, artefact, model, ep, args, kwargs)


def _check_runs(result: DeployResult, model: nn.Module, ep, args: tuple, kwargs: dict,
                path: Path, other_batches: int = 1) -> Callable[..., object] | None:
    """Load the artefact and run it at the example's and other batch sizes; returns it
    (None when it does not load)."""
    status("loading the artefact back", log=True)
    try:
        with _quiet():
            artefact = _LOADERS[result.to](path)
    except Exception as exc:
        result.problems.append(f"{path} fails to load with {_LOADER[result.to]}: "
                               f"{type(exc).__name__}: {_first_line(exc)}")
        return None
    if result.to == "pt2":
        status("loading the program in a new process that imports only torch", log=True)
        alone = loads_alone(path)
        if alone is not None:
            result.problems.append(f"{path} fails to load with {_LOADER[result.to]} in a new "
                                   f"Python process that imports only torch: {alone}")
    for batch, seq, a, k in _runs(result, ep, args, kwargs, other_batches):
        at = f"batch {batch}" + (f", sequence length {seq}" if seq is not None else "")
        status(f"running the artefact at {at}")
        try:
            with torch.no_grad():
                outs = _tensors(artefact(*a, **k))
        except Exception as exc:
            result.problems.append(f"the artefact fails to run at {at}: "
                                   f"{type(exc).__name__}: {_first_line(exc)}")
            continue
        with torch.no_grad():
            graphs = _tensors(result.gm(*a, **k))
            refs = _floats(model(*a, **k))
            autos = _autocast(model, a, k, result.dtype)
        problem = _compare(outs, graphs, at)
        if problem is not None:
            result.problems.append(problem)
            continue
        outs = [o for o in outs if o.is_floating_point()]
        graphs = [g for g in graphs if g.is_floating_point()]
        if not graphs and not result.rows:
            result.notes.append("the model returns no floating-point outputs: its integer "
                                "outputs are compared for equality, there is no error to "
                                "measure")
        row = CheckRow(batch, _worst(outs, refs),
                       math.inf if autos is None else _worst(autos, refs), _worst(outs, graphs),
                       seq=seq)
        if isinstance(artefact, _OnnxFile):
            try:
                with _quiet():
                    rounded = [o for o in artefact.rounded(*a, **k) if o.is_floating_point()]
            except Exception as exc:
                result.problems.append(
                    f"the ONNX file could not be run with its float16 values rounded at {at}: "
                    f"{type(exc).__name__}: {_first_line(exc)}")
            else:
                row = dataclasses.replace(row, rounded_error=_worst(rounded, refs))
        result.rows.append(row)
        if result.to in _OWN_KERNELS:
            bound = verify_bound(row.autocast_error, result.dtype) * check_factor(result.gm)
            if not row.error <= bound:
                result.problems.append(
                    f"at {at} the {_DESCRIBE[result.to]}'s error against fp32 is "
                    f"{row.error:.3g}, "
                    f"above the {bound:.3g} transform's check accepts (autocast's: "
                    f"{row.autocast_error:.3g})")
            if row.rounded_error is not None and not row.rounded_error <= bound:
                finite = all(bool(torch.isfinite(r).all()) for r in refs)
                result.problems.append(
                    f"at {at}, with every value the ONNX file declares "
                    f"{_dtype_name(result.dtype)} rounded to it (as a {_dtype_name(result.dtype)}"
                    " runtime computes; onnxruntime's CPU provider computes most of them in "
                    "float32), the file's error against fp32 is "
                    + ("non-finite where fp32 is finite: a value passes the dtype's range. "
                       "Transform with example inputs that reach the model's real ranges, or "
                       "keep the overflowing modules in fp32 (keep_fp32=...)"
                       if finite and not math.isfinite(row.rounded_error) else
                       f"{row.rounded_error:.3g}, above the {bound:.3g} transform's check "
                       "accepts"))
        elif not row.equal:
            result.problems.append(
                f"at {at} the artefact departs from the GraphModule by "
                f"{row.graph_error:.3g} relative (allowed: {SAME_AS_GRAPH:g}); please report "
                "the model")
    return artefact


def _probe_size_one(result: DeployResult, artefact: Callable[..., object], model: nn.Module,
                    ep, args: tuple, kwargs: dict) -> None:
    """torch.export records 2 as the low end of a dynamic size (it specialises 0 and 1), yet
    the program may run at 1. Run it there, batch and sequence each: a range says [1, ...] only
    where size 1 ran and was as close to fp32 as the check asks; otherwise a note says why it
    starts at 2."""
    for dim, what in ((0, "batch"), (SEQ, "sequence length")):
        size_range = result.batch_range if dim == 0 else result.seq_range
        if size_range is None or size_range[0] != 2 or result.problems:
            continue
        leaves = _dynamic_leaves(ep, args, kwargs, dim)
        if not leaves:
            continue
        a, k = _resized(args, kwargs, leaves, 1, dim)
        status(f"running the artefact at {what} 1")
        try:
            with torch.no_grad(), _quiet():
                outs = _floats(artefact(*a, **k))
                refs = _floats(model(*a, **k))
        except Exception as exc:
            result.notes.append(f"{what} 1 does not run ({type(exc).__name__}: "
                                f"{_first_line(exc)}): the {what} starts at 2, as "
                                "torch.export records a dynamic size")
            continue
        autos = _autocast(model, a, k, result.dtype)
        error = _worst(outs, refs)
        bound = verify_bound(math.inf if autos is None else _worst(autos, refs),
                             result.dtype) * check_factor(result.gm)
        if error <= bound:
            if dim == 0:
                result.batch_range = (1, size_range[1])
            else:
                result.seq_range = (1, size_range[1])
            result.notes.append(f"{what} 1 ran too (error against fp32 {error:.3g}): "
                                "torch.export records a dynamic size from 2, the program takes "
                                "1 as well")
        else:
            result.notes.append(f"at {what} 1 the error against fp32 is {error:.3g}, above the "
                                f"{bound:.3g} the check accepts: use {what}s from 2")


def _runs(result: DeployResult, ep, args: tuple, kwargs: dict, other_batches: int = 1
          ) -> list[tuple[int | None, int | None, tuple, dict]]:
    """(batch, sequence length, args, kwargs): the example inputs; (when the batch is dynamic)
    the same at ``other_batches`` other batch sizes; (when the sequence is) at another
    length. The sequence length is None where it is static."""
    batch, batches = _other_sizes(result, ep, args, kwargs, 0, other_batches)
    seq, lengths = (_other_sizes(result, ep, args, kwargs, SEQ, 1)
                    if result.seq_range is not None else (None, ([], [])))
    runs = [(batch, seq, args, kwargs)]
    runs += [(n, seq, *_resized(args, kwargs, batches[0], n, 0)) for n in batches[1]]
    runs += [(batch, n, *_resized(args, kwargs, lengths[0], n, SEQ)) for n in lengths[1]]
    return runs


def _other_sizes(result: DeployResult, ep, args: tuple, kwargs: dict, dim: int, count: int
                 ) -> tuple[int | None, tuple[list[int], list[int]]]:
    """The example's size of dimension ``dim`` (0: the batch; :data:`SEQ`), and (the flat
    indices of the inputs where it is dynamic, up to ``count`` other sizes to run)."""
    leaves = pytree.tree_leaves((args, kwargs))
    dynamic = _dynamic_leaves(ep, args, kwargs, dim)
    size_range = result.batch_range if dim == 0 else result.seq_range
    shaped = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > dim]
    first = leaves[dynamic[0]] if dynamic else (shaped[0] if shaped else None)
    example = None if first is None else first.shape[dim]
    others = _other_batches(example, size_range, count) if dynamic else []
    if not others and size_range is not None:
        what = "batch size" if dim == 0 else "sequence length"
        result.notes.append(f"no {what} other than the example's {example} in the range "
                            f"{size_range} to run")
    return example, (dynamic, others)


def _tensors(value: object) -> list[torch.Tensor]:
    # The program returns its outputs plain (portable_module); the model's and the graph's are
    # read in the same form, so the three compare leaf by leaf.
    return [t for t in pytree.tree_leaves(plain(value)) if isinstance(t, torch.Tensor)]


def _floats(value: object) -> list[torch.Tensor]:
    return [t for t in _tensors(value) if t.is_floating_point()]


def _compare(outs: list[torch.Tensor], graphs: list[torch.Tensor], at: str) -> str | None:
    """Why the artefact's outputs cannot be the GraphModule's (shapes, dtypes, an integer
    output that differs), or None."""
    got = [(tuple(o.shape), o.dtype) for o in outs]
    want = [(tuple(g.shape), g.dtype) for g in graphs]
    if got != want:
        return (f"at {at} the artefact returns {_shapes(got)}, the GraphModule "
                f"{_shapes(want)}")
    for k, (o, g) in enumerate(zip(outs, graphs)):
        if not o.is_floating_point() and not torch.equal(o.cpu(), g.cpu()):
            return (f"at {at} the artefact's integer output {k} differs from the "
                    "GraphModule's")
    return None


def _shapes(items: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    return ", ".join(f"{str(d).replace('torch.', '')}[{','.join(map(str, s))}]"
                     for s, d in items) or "no tensors"


def _worst(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    return max((rel_err(o.cpu(), r.cpu()) for o, r in zip(outs, refs)), default=0.0)


def _autocast(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype
              ) -> list[torch.Tensor] | None:
    device = next((t.device.type for t in [*model.parameters(), *model.buffers()]), "cpu")
    try:
        with torch.autocast(device, dtype=dtype):
            return _floats(model(*args, **kwargs))
    except Exception:  # an op without a low-precision kernel: autocast has no error to show
        return None


def _dim_range(ep, dim: int) -> tuple[int, float] | None:
    """The sizes ``ep`` takes in dimension ``dim`` of its inputs (0: the batch; :data:`SEQ`:
    the sequence), over every input where it is dynamic, or None where it is nowhere."""
    ranges = [ep.range_constraints.get(s.node.expr) for s in _input_dims(ep, dim)
              if isinstance(s, torch.SymInt)]
    ranges = [r for r in ranges if r is not None]
    if not ranges:
        return None
    lo = max(int(r.lower) for r in ranges)
    hi = min(float(r.upper) for r in ranges)  # int_oo, unbounded, reads as inf
    return lo, hi


def _input_dims(ep, dim: int) -> list[object]:
    """Dimension ``dim`` of each tensor user input of ``ep`` (None where it has none), in the
    order of its flat inputs."""
    user = set(ep.graph_signature.user_inputs)
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
    return [v.shape[dim] if isinstance(v, torch.Tensor) and v.dim() > dim else None
            for v in vals]


def _dynamic_leaves(ep, args: tuple, kwargs: dict, dim: int) -> list[int]:
    """Flat indices of the inputs whose dimension ``dim`` is dynamic in ``ep``."""
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    dims = _input_dims(ep, dim)
    if len(dims) == len(leaves):
        pairs = list(enumerate(dims))
    elif len(dims) == len(tensors):
        pairs = list(zip(tensors, dims))
    else:  # inputs the program dropped or added: nothing to resize safely
        return []
    return [i for i, d in pairs if isinstance(d, torch.SymInt)]


def _other_batches(example: int | None, batch_range: tuple[int, float] | None, count: int
                   ) -> list[int]:
    """Up to ``count`` batch sizes other than the example's inside the range the artefact
    takes."""
    if example is None or batch_range is None:
        return []
    lo, hi = batch_range
    # Sizes 0 and 1 are never dynamic in a capture (dynamo specialises them).
    sizes = (example + 3, example + 1, example - 1, max(lo, 2), example + 5, example + 2)
    fits = [n for n in sizes if max(lo, 2) <= n <= hi and n != example]
    return list(dict.fromkeys(fits))[:count]


def _resized(args: tuple, kwargs: dict, dynamic: list[int], n: int, dim: int = 0
             ) -> tuple[tuple, dict]:
    """The inputs with size ``n`` in dimension ``dim`` (the same for every input in
    ``dynamic``, so token ids stay in the vocabulary and an id row keeps its mask): rows of the
    example drawn at random for the batch; for the sequence its first ``n`` positions, repeated
    from the start past its end."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    example = leaves[dynamic[0]].shape[dim]
    index = (torch.randint(example, (n,), generator=torch.Generator().manual_seed(0))
             if dim == 0 else torch.arange(n) % example)
    for i in dynamic:
        if leaves[i].shape[dim] == example:
            leaves[i] = leaves[i].index_select(dim, index.to(leaves[i].device))
    return pytree.tree_unflatten(leaves, spec)


def _range(size_range: tuple[int, float]) -> str:
    lo, hi = size_range
    return f"[{lo}, {'inf' if math.isinf(hi) else int(hi)}]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3e}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
