"""``amprewrite.transform``: the one call."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Iterable

import torch
from torch import fx, nn

from .capture.exported import is_exported_program, transform_program
from .capture.trace import capture_model, eager_failure, import_compiler
from .capture.verify import AdviceSearch
from .errors import PassError, PolicyError, VerificationError
from .graph.graphmodule import DynamoGraphModule, sources_die_with_code
from .graph.runtime import no_enclosing_autocast
from .passes import pipeline, run_pipeline
from .precision.plan_file import option_notes, policy_summary
from .precision.policy import Policy, Selector, calibration_batches
from .precision.report import POLICY_KEY, REPORT_KEY, Report, decisions_of, transform_notes
from .progress import status, transform_progress

__all__ = ["transform"]


def transform(
    model: nn.Module | torch.export.ExportedProgram,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    example_inputs: object = None,
    calibration: Iterable[object] = (),
    overflow: str = "auto",
    fp8: object = None,
    keep_fp32: Iterable[Selector] = (),
    allow_low: Iterable[Selector] = (),
    params: str = "fp32",
    keep_io_dtype: bool = True,
    upsample: str = "auto",
    device: torch.device | str | None = None,
    on_new_shape: str = "transform",
    verify: bool = True,
    progress: bool | None = None,
    dynamic_shapes: object = "batch",
    capture: str = "dynamo",
    plan: object = None,
    strict: bool = False,
) -> fx.GraphModule | torch.export.ExportedProgram:
    """Return a GraphModule that runs ``model`` in ``dtype`` where safe and in fp32 where not.

    Args:
        model: the fp32 ``nn.Module`` to convert. It is never modified. A
            ``torch.export.ExportedProgram`` gives an ExportedProgram: its module is transformed
            on ``example_inputs`` (default: the inputs it was exported with,
            ``ep.example_inputs``) and exported again with the same dynamic dimensions, ready
            for ``torch.export.save`` and AOTInductor (docs/guide.md, "Deploying").
        dtype: ``torch.bfloat16`` / ``"bf16"`` or ``torch.float16`` / ``"fp16"``.
        example_inputs: a tuple of positional inputs (or a dict of keyword inputs). With them the
            model is captured by dynamo (or torch.export, ``capture=``), which handles
            real-world models; without them it is traced with ``torch.fx.symbolic_trace`` and
            ``gm.train()``/``gm.eval()`` keep switching BatchNorm and Dropout.
        calibration: more input batches, each of the form of ``example_inputs``, whose value
            ranges the plan reads besides the example inputs' (DESIGN.md, "Values are facts
            too"): in fp16 a value past 65504 / 16 on any of them is computed and stored in
            fp32, with the reason in the report. Without ``example_inputs`` the first batch
            is the example inputs. Verification runs on the example inputs only.
        overflow: what a value past fp16's range (on the example inputs and calibration
            batches) gets: ``"fp32"`` computes and stores it in fp32, the most accurate;
            ``"auto"`` (default) does the same unless that leaves under half of the matmul
            FLOPs in fp16, then rescales matmuls from the output backwards until half are;
            ``"rescale"`` runs a linear or matmul whose result passes it in fp16 on
            its weight scaled by a power of two and scales the result back in fp32 (exact):
            its FLOPs stay in fp16, its result carries fp16's rounding.
        fp8: with ``dtype=torch.bfloat16`` and ``example_inputs``, run in float8 the linears
            that pay on a GPU (a cost model) and whose float8 error on the example inputs stays
            near e4m3's ordinary error (a check per layer); the rest follows the bf16 plan.
            ``True`` (torchao's ``"tensorwise"`` recipe), a recipe name (``"rowwise"``,
            ``"rowwise_with_gw_hp"``) or :class:`amprewrite.Float8` (bound, cost model,
            include / exclude selectors). Each linear's verdict is in the report. Needs
            torchao. See docs/guide.md, "float8".
        keep_fp32: module paths (``"encoder.layer.0"``), module types (``nn.LayerNorm``), op
            family names (``"softmax"``) or graph nodes (``"node:matmul_1"``, names as in the
            report; what :func:`amprewrite.find_fp32_nodes` returns) to compute in fp32.
        allow_low: the same kinds of selector; FP32 ops they name run in their inputs' precision.
        params: ``"fp32"`` shares the model's Parameters (training ``gm`` trains ``model``);
            ``"low"`` stores ``dtype`` copies of weights that only low-precision ops read.
        keep_io_dtype: return outputs in the dtype the original model returns them.
        upsample: ``"auto"`` rewrites nearest upsampling that has no kernel for ``dtype`` on
            ``device`` (found by running it once) into exact copies, and non-nearest modes
            without a kernel into fp32 islands; ``"always"`` rewrites every nearest upsample;
            ``"never"`` none.
        device: the device the graph will run on; defaults to the model's. Kernel probes run
            there.
        on_new_shape: with ``example_inputs``, what a call with inputs the graph was not
            captured for does (other sizes, other non-tensor arguments): ``"transform"`` runs
            it on a graph transformed for them (made once per new shape class, dimensions that
            changed become dynamic; cached on ``gm``); ``"error"`` raises ``ShapeError``.
        verify: with ``example_inputs``, run the fp32 model, autocast and the graph once on
            them and raise ``VerificationError`` (naming the first node that departs from
            fp32) when the graph's error is far beyond autocast's; in train mode too (equal
            dropout masks, buffers restored). Without ``example_inputs`` there is nothing to
            run: the report and a ``NotVerifiedWarning`` say so. See docs/guide.md.
        progress: show the stage it is in (capture, passes, verification) and the time spent on
            a live line on stderr, as ``torch.hub.load(progress=...)`` does for downloads;
            ``None`` (default) shows it when stderr is a terminal, ``False`` never.
        dynamic_shapes: with ``example_inputs``, the sizes the graph serves, in
            ``torch.export``'s form (a dict by argument name or a tuple by position of
            ``{dim: torch.export.Dim(...)}``): ``torch.export.export(gm, ...)`` with the same
            spec accepts every size in those ranges, and calls outside them raise
            ``ShapeError``. ``"batch"`` (default) makes dimension 0 of every input dynamic where
            the model allows it (the report says whether it did); ``None`` fixes every size.
            For an ExportedProgram, ``"batch"`` means the program's own dynamic dimensions (a
            ``Dim`` per symbol, with its range from ``ep.range_constraints``).
        capture: with ``example_inputs``, how the model becomes a graph. ``"dynamo"``
            (default): ``torch._dynamo.export``, torch-level ops; every pass applies (loop
            re-rolling, the upsample rewrite, low embedding tables) and custom
            ``autograd.Function``s keep their backward. ``"export"``: non-strict
            ``torch.export.export``, an ATen-level graph, 2-4x faster to capture on the
            zoo's real models; it refuses custom ``autograd.Function``s, inlines activation
            checkpointing, and the passes above do not yet match its ATen ops (docs/guide.md,
            "Capture").
        plan: a saved plan (:func:`amprewrite.save_plan`: its path, its JSON text or dict):
            each node it has an entry for takes the saved (or hand-edited) decision instead of
            deciding again; ranges are not recorded and kernels not probed where it has them,
            and the built-in check still runs on ``example_inputs``. A node it does not know
            (the model changed) is decided afresh and named in the report (``report.plan``);
            a plan for another model raises ``PolicyError``. See docs/guide.md, "Plans".
        strict: with ``plan``, raise ``PolicyError`` instead when the graph has nodes the plan
            does not know or lacks nodes it has.

    Example:
        >>> import torch, amprewrite
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
        >>> gm = amprewrite.transform(model, dtype=torch.bfloat16)
        >>> gm(torch.randn(2, 8)).dtype
        torch.float32
        >>> [(d.family, str(d.dtype)) for d in amprewrite.report(gm).decisions if d.family]
        [('linear', 'torch.bfloat16'), ('softmax', 'torch.float32')]
        >>> ep = amprewrite.transform(torch.export.export(model, (torch.randn(2, 8),)), "bf16")
        >>> type(ep).__name__, ep.module()(torch.randn(2, 8)).dtype
        ('ExportedProgram', torch.float32)
    """
    calibration = calibration_batches(calibration)
    if example_inputs is None and calibration:
        example_inputs, calibration = calibration[0], calibration[1:]
    policy = Policy(dtype=dtype, keep_fp32=tuple(_items(keep_fp32, "keep_fp32")),
                    allow_low=tuple(_items(allow_low, "allow_low")), params=params,
                    keep_io_dtype=keep_io_dtype, upsample=upsample, device=device,
                    on_new_shape=on_new_shape, verify=verify, dynamic_shapes=dynamic_shapes,
                    capture=capture, calibration=calibration, overflow=overflow, fp8=fp8,
                    plan=plan, strict=strict)
    if policy.fp8 is not None and example_inputs is None and not (
            is_exported_program(model) and getattr(model, "example_inputs", None)):
        raise PolicyError(
            "fp8 chooses each float8 linear by its size on the inputs and checks its numerics "
            "on them, so it needs example_inputs=(...) (or calibration=[...]); without inputs "
            "there is nothing to measure. Pass example inputs, or drop fp8.")
    with transform_progress(progress):
        return transform_with(model, policy, example_inputs)


def _items(value: object, name: str) -> Iterable[Selector]:
    if isinstance(value, (str, type)):
        return (value,)
    if value is None:
        return ()
    if not isinstance(value, Iterable):
        raise PolicyError(f"{name} must be a list of module paths, module types or family names, "
                          f"got {value!r}.")
    return value


_GC_LOCK = threading.Lock()
_gc_depth = 0


@contextlib.contextmanager
def older_objects_not_collected():
    """While a transform runs, the garbage collector leaves alone the objects that were there
    before it (``gc.freeze``), and they go back as they were after (``gc.unfreeze``).

    A capture makes hundreds of thousands of objects (dynamo's trace, fake tensors, fx nodes);
    each full collection they set off also walked every object the process had before:
    torch's and transformers' modules, the model. That was 0.45 of the 5.0 s of a first
    transform of the zoo's Swin (0.08 s with them left alone; docs/benchmarks.md). (The passes
    pause the collector altogether: :func:`amprewrite.passes.run_pipeline`.) Cycles
    among the older objects are collected after the transform instead of during it. Nested
    and concurrent transforms freeze once; a process that froze objects itself (``gc.freeze``
    before forking workers) or turned the collector off is left as it is.

    >>> import gc
    >>> with older_objects_not_collected():
    ...     frozen = gc.get_freeze_count() > 0
    >>> frozen, gc.get_freeze_count()
    (True, 0)
    """
    global _gc_depth
    with _GC_LOCK:
        mine = _gc_depth == 0 and gc.isenabled() and gc.get_freeze_count() == 0
        _gc_depth += 1
        if mine:
            gc.freeze()
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_depth -= 1
            if mine:
                gc.unfreeze()


def transform_with(model: nn.Module | torch.export.ExportedProgram, policy: Policy,
                   example_inputs: object = None, on_pass=None, advise: bool = True
                   ) -> fx.GraphModule | torch.export.ExportedProgram:
    """:func:`transform` with a ready :class:`~amprewrite.Policy` (used by the CLI and backend).

    ``advise``: when verification fails, transform again to find ``keep_fp32`` advice that
    passes (the error's ``keep_fp32``)."""
    with older_objects_not_collected(), no_enclosing_autocast():
        if is_exported_program(model):
            return transform_program(model, policy, example_inputs, transform_with, on_pass)
        search = AdviceSearch(policy, advise)
        while True:
            try:
                gm = _transform_module(model, search.policy, example_inputs,
                                       None if search.searching else on_pass)
            except VerificationError as exc:
                if (error := search.failed(exc)) is not None:
                    raise error from None
                continue
            if (error := search.passed()) is not None:
                raise error from None
            return gm


def _transform_module(model: nn.Module, policy: Policy, example_inputs: object, on_pass
                      ) -> fx.GraphModule:
    """Capture, the passes, the report: one transform of an ``nn.Module``."""
    start = time.perf_counter()
    imported = import_compiler()
    captured, policy = capture_model(model, example_inputs, policy)
    rep = Report(dtype=str(policy.dtype).replace("torch.", ""), capture=captured.method,
                 policy=policy_summary(policy, model))
    if imported:
        rep.timings["import torch._inductor"] = imported
    rep.timings["capture"] = time.perf_counter() - start - imported
    gm = captured.gm
    gm.meta[REPORT_KEY] = rep
    gm.meta[POLICY_KEY] = policy
    if on_pass is not None:
        on_pass("capture", gm)
    status(f"running the passes on {len(gm.graph.nodes)} nodes")
    passes = pipeline(policy, model=model, example_inputs=example_inputs)
    with sources_die_with_code():  # the passes' recompiles of a plain fx.GraphModule too
        try:
            gm = run_pipeline(gm, passes, rep.timings, on_pass)
        except PassError:
            # The first real run of the graph is in the passes: values a capture on fake
            # tensors never checks (a token id past the vocabulary) fail there.
            own = eager_failure(model, example_inputs) if example_inputs is not None else None
            if own is not None:
                raise own from None
            raise
    rep.notes += transform_notes(gm, captured.method, policy) + option_notes(policy)
    rep.decisions = decisions_of(gm, policy)
    if isinstance(gm, DynamoGraphModule) and example_inputs is not None:
        # To transform again for inputs of other shapes. With params="low" only weakly: the
        # point of low weights is that dropping the fp32 model frees its weights.
        gm._amp_source = (weakref.ref(model) if policy.params == "low" else model, policy,
                          transform_with)
    rep.timings["total"] = time.perf_counter() - start
    return gm


def transform_graph(gm: fx.GraphModule, policy: Policy, method: str = "dynamo",
                    example_inputs: object = None,
                    declared: dict[str, tuple[str, str]] | None = None,
                    prior: dict | None = None, reduce=None,
                    fp8_prior: dict | None = None) -> fx.GraphModule:
    """Run the passes on an already captured graph (the torch.compile backend's entry): value
    ranges are recorded on ``example_inputs`` (the graph's own flat inputs); ``declared``,
    ``prior``, ``reduce`` and ``fp8_prior`` as :func:`amprewrite.passes.pipeline` takes them."""
    start = time.perf_counter()
    rep = Report(dtype=str(policy.dtype).replace("torch.", ""), capture=method,
                 policy=policy_summary(policy))
    gm.meta[REPORT_KEY] = rep
    gm = run_pipeline(gm, pipeline(policy, example_inputs=example_inputs, declared=declared,
                                   prior=prior, reduce=reduce, fp8_prior=fp8_prior),
                      rep.timings)
    rep.decisions = decisions_of(gm, policy)
    rep.timings["total"] = time.perf_counter() - start
    return gm
