"""Capture a model into a ``torch.fx.GraphModule``.

Without example inputs the model is traced symbolically (``torch.fx.symbolic_trace``); with them
it is captured by dynamo (``torch._dynamo.export``, ``capture="dynamo"``, the default), which
handles real-world models and unrolls Python loops, or by non-strict ``torch.export.export``
(``capture="export"``): the model's Python runs on fake tensors, with no bytecode tracing and no
guards to build, and the graph is ATen-level. Every way the result:

- names parameters and buffers by their original qualified names (``gm.state_dict()`` keys equal
  the model's) and shares the caller's tensors, never copies them;
- never shares a module object with the caller: leaf modules the graph calls are shallow copies
  that share parameters, so ``gm.train()`` cannot flip the caller's modules;
- records the original module path of every node in ``node.meta`` (see
:mod:`amprewrite.graph.meta`);
- returns what the model returns: output dataclasses and, for a transformers model with its
  default ``use_cache=True``, the KV cache (transformers' cache classes registered with
  torch's pytree by ``transformers.exporters``, scoped to the graphs returning them).

A module whose forward flattens or unflattens types other than torch's containers, dataclasses
and namedtuples (``ep.module()`` of a program that returns a transformers cache) is captured
with non-strict export whatever ``method`` says: dynamo cannot trace those functions.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import inspect
import operator
import os
import sys
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from ..errors import AmpRewriteError, CaptureError, ModelError, PolicyError
from ..graph import meta as M
from ..graph import runtime
from ..graph.graphmodule import (
    REGISTERED_OUTPUTS,
    DynamoGraphModule,
    _release_registrations,
    add_input_check,
    sources_die_with_code,
)
from ..graph.modules import buffer_clone_copy, get_attr, has_attr, rebuild, share_copy, tensor_names
from ..graph.shapes import BATCH, InputGuard, capture_spec, flat_inputs
from ..precision.ops import family_of
from ..precision.report import POLICY_KEY, REPORT_KEY
from ..progress import quiet_loggers

__all__ = ["Capture", "annotate_dynamo_graph", "capture", "eager_failure", "split_inputs"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)


@dataclass
class Capture:
    """A captured graph and how it was obtained."""

    gm: fx.GraphModule
    method: str  # "symbolic_trace" or "dynamo"
    training: bool | None  # the mode dynamo baked in; None for symbolic graphs (mode follows gm)


def split_inputs(example_inputs: object) -> tuple[tuple, dict]:
    """(positional, keyword) inputs from a tuple/list, a dict of keyword inputs, or one value."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame in user code (not torch, not amprewrite)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH_DIR) and not path.startswith(_OWN_DIR):
            return frame
    return None


class _Tracer(fx.Tracer):
    """fx's tracer, except that a parametrized module (``weight_norm``, ``spectral_norm``,
    ``register_parametrization``) is traced through, as dynamo does: its forward reads
    ``self.weight``, which calls the parametrization (a leaf module computing the weight each
    call) and gives a node the later passes can cast like any weight."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if parametrize.is_parametrized(m):
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def create_arg(self, a: object) -> object:
        if isinstance(a, type) and isinstance(getattr(a, "dtype", None), torch.dtype):
            # x.type(torch.FloatTensor): fx cannot record the class; Tensor.type takes its name.
            return f"{a.__module__}.{a.__name__}"
        return super().create_arg(a)


def _symbolic(model: nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    tracer.record_stack_traces = True
    traced = buffer_clone_copy(model)
    try:
        graph = tracer.trace(traced)
    except Exception as exc:
        frame = _user_frame(exc)
        where = ""
        if frame is not None:
            where = f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise CaptureError(
            f"amprewrite could not trace {type(model).__name__} symbolically{where}: "
            f"{type(exc).__name__}: {text}. {_symbolic_cause(text)} Pass example_inputs=(...) "
            "to amprewrite.transform so the model is captured with torch dynamo, which "
            "handles it (branches on tensor values need torch.where or torch.cond)."
        ) from None
    written = [f"{mod_name}.{name}".lstrip(".") for mod_name, mod in traced.named_modules()
               for name, b in mod._buffers.items() if b is not None and b._version > 0]
    if written:
        raise ModelError(
            f"{type(model).__name__}.forward updates buffer '{written[0]}' in place. "
            "torch.fx.symbolic_trace runs that update once while tracing and leaves it out of the "
            "graph, so the result would silently differ from the model. Pass "
            "example_inputs=(...) so dynamo captures the update into the graph, or move the "
            "update out of forward."
        )
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        entries = list(stack.values())
        node.meta[M.MODULE_PATH] = entries[-1][0] if entries else ""
        node.meta[M.MODULE_TYPES] = tuple(e[1] for e in entries if isinstance(e[1], type))
        if node.op == "call_module":
            node.meta[M.MODULE_PATH] = str(node.target)
            sub = model.get_submodule(str(node.target))
            if not node.meta[M.MODULE_TYPES] or node.meta[M.MODULE_TYPES][-1] is not type(sub):
                node.meta[M.MODULE_TYPES] = (*node.meta[M.MODULE_TYPES], type(sub))
    # Modules and tensors come from the caller's model (shared, not the clones); constants the
    # tracer created (``_tensor_constant0``) only exist on the traced copy.
    return rebuild(model, graph, lambda target: get_attr(model, target) if has_attr(model, target)
                    else get_attr(traced, target), fx.GraphModule)


def _symbolic_cause(text: str) -> str:
    """What a symbolic-trace failure means, from its message."""
    if "Proxy" in text and "assignment" in text:
        return ("The model assigns into a tensor or attribute being traced (x[i] = v, "
                "config.x = t), which torch.fx.symbolic_trace cannot record.")
    if "control flow" in text or "iterate" in text or "bool" in text.lower():
        return ("torch.fx.symbolic_trace cannot follow Python control flow or loops on tensor "
                "shapes or values.")
    return "torch.fx.symbolic_trace cannot trace this construct."


def _with_inputs(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: object = None,
                 method: str = "dynamo") -> fx.GraphModule:
    """Capture with example inputs: ``method`` ``"dynamo"`` (``torch._dynamo.export``) or
    ``"export"`` (non-strict ``torch.export.export``, an ATen-level graph)."""
    import torch._dynamo  # imported on first capture, not with amprewrite (seconds)

    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise CaptureError(
            f"example_inputs do not match {type(model).__name__}.forward"
            f"{inspect.signature(model.forward)}: {exc}. Pass a tuple of positional inputs "
            "(or a dict of keyword inputs) that the model can be called with."
        ) from None
    spec, _ = capture_spec(model, args, kwargs, dynamic_shapes)
    _register_hf_caches(model)
    run = _export if method == "dynamo" else _export_nonstrict
    try:
        src = run(model, args, kwargs, spec)
    except Exception as exc:
        src, error = None, exc
        _raise_if_own(model, exc)
    if src is None:
        failure, out = _eager_run(model, args, kwargs)
        if failure is not None:
            raise fails_without_amprewrite(model, kwargs, failure) from None
        if _register_output_dataclasses(out):
            try:
                src = run(model, args, kwargs, spec)
            except Exception as exc:
                error = exc
                _raise_if_own(model, exc)
        if src is None:
            if spec is not None and "Constraints violated" in str(error):
                # The sizes asked dynamic are fixed by the model: say which, in torch's words.
                raise CaptureError(
                    f"{type(model).__name__} cannot be captured with the dynamic_shapes asked "
                    f"for: {' '.join(str(error).split())} Widen or drop those dimensions in "
                    "dynamic_shapes (torch's suggested fixes above), or pass dynamic_shapes=None "
                    "for a graph of exactly the example's sizes."
                ) from None
            if method == "dynamo":
                _raise_if_plain_export_works(model, args, kwargs, error)
            text = str(error).strip()
            first = text.splitlines()[0] if text else type(error).__name__
            tool = "dynamo" if method == "dynamo" else "torch.export (non-strict)"
            raise CaptureError(
                f"{tool} could not capture {type(model).__name__} with the given "
                f"example_inputs: {type(error).__name__}: {first} The model runs eagerly on "
                f"these inputs (the cause is outside amprewrite). {_capture_advice(text, out)}"
            ) from None
    if method == "dynamo":
        graph, resolve = src.graph, functools.partial(get_attr, src)
        annotate_dynamo_graph(graph)
        names = tensor_names(model)
        for node in graph.nodes:
            if node.op == "get_attr":
                obj = get_attr(src, str(node.target))
                if isinstance(obj, torch.Tensor) and id(obj) in names:
                    node.target = names[id(obj)]
        owner = src
    else:  # targets are the model's own qualified names already
        graph, resolve, owner = src
        _annotate_exported(graph, model)
    gm = rebuild(model, graph, resolve, DynamoGraphModule)
    _release(owner)
    _functions_as_calls(gm)
    gm._amp_captured_training = model.training
    gm._amp_inputs = InputGuard(gm, flat_inputs(gm, args, kwargs))
    add_input_check(gm)
    _operand_dtypes(gm, model)
    return gm


def _export_nonstrict(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: object = None
                      ) -> tuple[fx.Graph, Callable[[str], object], fx.GraphModule]:
    """Non-strict ``torch.export.export``: runs ``forward`` as Python on fake tensors (no
    bytecode tracing, no guards), ATen-level ops. Returns the graph with parameters and
    buffers as ``get_attr`` nodes named as in the model, how to resolve other targets, and
    the module that owns the graph."""
    with (warnings.catch_warnings(), _quiet_loggers(), _no_backend_choice(dynamic_shapes),
          _keep_dim_marks((args, kwargs)), _release_export_state(), _custom_functions() as seen):
        warnings.simplefilter("ignore")
        registered = set(pytree.SUPPORTED_NODES)
        # The structural copy as in _export: forward's attribute assignments land on it.
        ep = torch.export.export(share_copy(model), args, kwargs, dynamic_shapes=dynamic_shapes,
                                 strict=False)
        for cls in set(pytree.SUPPORTED_NODES) - registered:
            # torch.export registers output dataclasses itself, for the process; scope them to
            # the graphs that return them, as amprewrite's own registrations are.
            if dataclasses.is_dataclass(cls):
                REGISTERED_OUTPUTS.setdefault(cls, 0)
        if seen:
            names = ", ".join(sorted({f"{c.__module__}.{c.__qualname__}" for c in seen}))
            raise CaptureError(
                f"capture='export' cannot capture {type(model).__name__}: it calls the custom "
                f"autograd.Function {names}, and non-strict torch.export records only its "
                "forward, so gradients through the graph would not be the Function's backward. "
                "Use capture='dynamo' (the default), which keeps the Function."
            )
        if _writes_through_views(ep.graph_module):
            # Writes through views, into inputs' views and into out= arguments: torch
            # functionalizes them (one retrace), where the functionalize pass knows torch-level
            # spellings of such writes, not ATen's. Plain in-place ops on fresh values and on
            # buffers (BatchNorm's statistics, whose functional form would break its backward)
            # stay for the pass.
            ep = ep.run_decompositions({})
            _refuse_parameter_writes(model, ep)
        return _unlifted(ep)


def _unlifted(ep: torch.export.ExportedProgram
              ) -> tuple[fx.Graph, Callable[[str], object], fx.GraphModule]:
    """``ep.module()``'s graph, made in place on the exported graph: parameters, buffers and
    constants become ``get_attr`` nodes, writes into buffers and inputs ``copy_`` nodes, and
    the graph takes the model's inputs. ``ep.module()`` does the same on a deep copy, recompiles
    four times and adds input guards amprewrite replaces with its own: 18% of the export's
    time on a 12-layer LLaMA. Programs outside the common case (effect tokens, script
    objects, a functionalized program) take ``ep.module()``."""
    from torch.export import _unlift
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    lifted = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    helpers = ("_unlift_inputs_as_getattr", "_insert_copy_for_mutations", "_get_codegen")
    if (ep.verifiers[0].dialect != "TRAINING"
            or any(s.kind not in (*lifted, InputKind.USER_INPUT) for s in sig.input_specs)
            or not all(hasattr(_unlift, h) for h in helpers)):
        gm = ep.module()
        return gm.graph, functools.partial(get_attr, gm), gm
    gm = ep.graph_module
    writes = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION,
              OutputKind.PARAMETER_MUTATION)
    attrs, inputs = _unlift._unlift_inputs_as_getattr(
        gm, [s.target if s.kind in lifted else None for s in sig.input_specs])
    _unlift._insert_copy_for_mutations(
        gm, [s.target if s.kind in writes else None for s in sig.output_specs], attrs, inputs)
    call = ep.module_call_graph[0].signature
    gm.graph._codegen = _unlift._get_codegen(ep.call_spec.in_spec, ep.call_spec.out_spec,
                                             call.forward_arg_names if call else None)
    constants = ep.constants
    return (gm.graph, lambda target: constants[target] if target in constants
            else get_attr(gm, target), gm)


def _refuse_parameter_writes(model: nn.Module, ep: torch.export.ExportedProgram) -> None:
    """What the functionalize pass says of a dynamo graph that writes a parameter: params='low'
    may store it low, and the copy back would run outside the model's no_grad block."""
    from torch.export.graph_signature import OutputKind

    values = ep.graph.output_node().args[0]
    for spec, value in zip(ep.graph_signature.output_specs, values):
        param = get_attr(model, spec.target, None) if spec.target else None
        if (spec.kind == OutputKind.PARAMETER_MUTATION and isinstance(param, torch.Tensor)
                and param.is_floating_point()):
            where = M.source_line(value) if isinstance(value, fx.Node) else None
            where = None if where and where.startswith("<") else where  # the retrace's own code
            raise ModelError(
                f"{type(model).__name__}.forward updates floating-point parameter "
                f"'{spec.target}' in place{' at ' + where if where else ''}. amprewrite casts "
                "parameters where they are read and may store them in low precision, so it "
                "does not capture updates of them. Move the update out of forward (into the "
                "training step, or a hook), or keep such state in a buffer."
            )


def _writes_through_views(gm: fx.GraphModule) -> bool:
    """Does the exported graph write a tensor through a view, into an ``out=`` argument, or
    inside a body (a ``no_grad`` block is a submodule)?"""
    for mod in gm.modules():
        for node in mod.graph.nodes if isinstance(mod, fx.GraphModule) else ():
            target = node.target
            if not (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
                    and target._schema.is_mutable):
                continue
            if mod is not gm:
                return True
            for i, arg in enumerate(target._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                if arg.is_out:
                    return True
                value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) \
                    else node.args[i]
                if _through_view(value):
                    return True
    return False


def _through_view(value: object) -> bool:
    """Is ``value`` a view of another tensor? Walked back through ``getitem`` (a view when it
    picks from a view op's outputs, as ``split``'s; not from ``topk``'s) and in-place ops,
    which return their input."""
    viewed = False
    while isinstance(value, fx.Node) and value.op == "call_function" and value.args:
        target = value.target
        if isinstance(target, torch._ops.OpOverload) and target.is_view:
            viewed = True
        elif not (target is operator.getitem or (isinstance(target, torch._ops.OpOverload)
                                                 and target._schema.is_mutable)):
            break
        value = value.args[0]
    return viewed


@contextlib.contextmanager
def _custom_functions() -> Iterator[set[type]]:
    """Record the custom ``torch.autograd.Function`` classes applied inside the block.
    Non-strict export traces a Function's forward like any code and drops its backward;
    dynamo keeps the Function (``autograd_function_apply``)."""
    function = torch.autograd.function.Function
    original = function.__dict__["apply"]
    seen: set[type] = set()

    def apply(cls, *args, **kwargs):
        # A custom op's registered autograd (torch.library) is a Function too, applied by the
        # op itself; the graph keeps the op, and the op keeps its backward.
        if not cls.__module__.startswith("torch._library"):
            seen.add(cls)
        # __get__, not __func__: torch 2.14 makes apply a C classmethod, which has none.
        return original.__get__(None, cls)(*args, **kwargs)

    function.apply = classmethod(apply)
    try:
        yield seen
    finally:
        function.apply = original


# Nodes ep.module() adds that check what amprewrite checks itself or that a mixed-precision
# graph must not: ``_guards_fn`` (the input guards; InputCheck replaces it) and
# ``_assert_tensor_metadata`` (asserts the fp32 dtype a ``.to()`` saw while exporting).
_EXPORT_CHECKS = ("_assert_tensor_metadata",)


def _annotate_exported(graph: fx.Graph, model: nn.Module) -> None:
    """:func:`annotate_dynamo_graph` for a non-strict export's graph, whose ``nn_module_stack``
    names module types as strings: the types come from ``model``'s own submodules."""
    for node in list(graph.nodes):
        if ((node.op == "call_module" and str(node.target) == "_guards_fn")
                or (node.op == "call_function"
                    and getattr(node.target, "__name__", "").split(".")[0] in _EXPORT_CHECKS)):
            graph.erase_node(node)
    modules = dict(model.named_modules())
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        paths = [M.clean_module_path(e[0]) for e in stack.values()]
        paths = [p for p in paths if p in modules]
        node.meta[M.MODULE_PATH] = paths[-1] if paths else ""
        node.meta[M.MODULE_TYPES] = tuple(type(modules[p]) for p in paths)
        if node.op != "output":
            node.meta[M.ORIG] = M.info_from_value(M.fake_value(node))


def _functions_as_calls(gm: fx.GraphModule) -> None:
    """Custom ``torch.autograd.Function``s, which dynamo captures as the higher-order op
    ``autograd_function_apply`` (forward and backward graphs), become calls of
    :func:`amprewrite.graph.runtime.autograd_function_apply`: the same Function at run time, and one
    that ``torch.compile`` can trace (it rejects the higher-order op in a graph it is handed)."""
    hop = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    if hop is None:
        return
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        nodes = mod.graph.find_nodes(op="call_function", target=hop)
        for node in nodes:
            node.target = runtime.autograd_function_apply
        if nodes and mod is not gm:
            mod.recompile()


def _release(src: fx.GraphModule) -> None:
    """Drop the exported module's references to the model's tensors. dynamo's cache entry for
    the export (on a code object only the export ran) keeps that module alive; with its
    tensors, dropping the fp32 model after ``params="low"`` would free nothing. Then let the
    export's shape environment go (:func:`_release_tracked_fakes`)."""
    for mod in src.modules():
        mod._parameters.clear()
        mod._buffers.clear()
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor):
                delattr(mod, name)
    _release_tracked_fakes(src.graph)


def _release_tracked_fakes(graph: fx.Graph) -> None:
    """Empty the export's list of the fake inputs it made (``ShapeEnv.tracked_fakes``), which
    only the export's own guard and constraint solving reads. With a dynamic size, that list
    made a cycle the garbage collector cannot see: the shape environment holds the fake
    input, whose symbolic sizes (C++ ``SymInt``s) hold ``SymNode``s, which hold the shape
    environment. So every export kept its shape environment, fake tensors and fake-tensor
    dispatch cache for the life of the process (about 1.2 MB per transform of the zoo GPT-2)."""
    for node in graph.nodes:
        env = getattr(getattr(M.fake_value(node), "fake_mode", None), "shape_env", None)
        if env is not None:
            if isinstance(getattr(env, "tracked_fakes", None), list):
                env.tracked_fakes.clear()  # in place: dynamo's OutputGraph shares the list
            return


def _no_recompile_limit() -> contextlib.AbstractContextManager:
    """Every export adds a cache entry to the model class's ``forward`` code object, and dynamo
    refuses a code object after ``recompile_limit`` (8) entries: without this the ninth
    transform of any ``nn.Sequential`` in a process failed (``find_fp32_nodes`` transforms up
    to 17 times). The entries are only consulted under torch.compile, never in eager calls."""
    names = set(torch._dynamo.config._config)
    keys = [("recompile_limit", "accumulated_recompile_limit"),
            ("cache_size_limit", "accumulated_cache_size_limit")]
    for pair in keys:
        if all(k in names for k in pair):
            return torch._dynamo.config.patch({k: 1 << 30 for k in pair})
    return contextlib.nullcontext()


@contextlib.contextmanager
def _private_top_frame() -> Iterator[None]:
    """Give this export its own top-level code object.

    dynamo exports a module through ``external_utils.wrap_inline``, whose ``inner`` code object is
    shared with every ``torch.compile``-d module in the process. Each export left a cache entry
    on it, so after 8 transforms the next ``torch.compile(module)`` hit dynamo's recompile limit,
    which marks that shared code "skip" for good: from then on torch.compile ran modules eagerly
    and every later export failed ("Unexpectedly found a Tensor in the outputs"). A fresh copy
    of ``inner`` per export keeps its cache entries private; they die with the copy.
    """
    utils = torch._dynamo.external_utils
    shared = getattr(utils, "wrap_inline", None)
    if shared is None:
        yield
        return

    codes = []

    def wrap_inline(fn):
        inner = shared(fn)
        code = inner.__code__
        inner.__code__ = code.replace(co_varnames=code.co_varnames)  # a distinct code object
        codes.append(inner.__code__)
        return inner

    utils.wrap_inline = wrap_inline
    try:
        yield
    finally:
        utils.wrap_inline = shared
        # The cache entries hold the export's guards, and through them its shape environment
        # and fake tensors; nothing calls the copy again, and the code object can outlive it.
        reset = getattr(torch._dynamo.eval_frame, "reset_code", None)
        for code in codes if callable(reset) else ():
            reset(code)


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: object = None
            ) -> fx.GraphModule:
    with (warnings.catch_warnings(), _quiet_loggers(), _no_recompile_limit(),
          _private_top_frame(), _no_backend_choice(dynamic_shapes),
          _keep_dim_marks((args, kwargs)), _release_export_state()):
        warnings.simplefilter("ignore")
        # A structural copy: assignments in forward (``self.count = self.count + 1``) land on
        # the copy, never on the caller's modules (dynamo would leave FakeTensors there).
        # Static by default (fast, and a graph for exactly these sizes); dimensions the caller
        # marked dynamic (a re-capture for new sizes) or named in ``dynamic_shapes`` (the
        # batch, by default) stay symbolic.
        return torch._dynamo.export(share_copy(model), dynamic_shapes=dynamic_shapes,
                                    assume_static_by_default=True)(*args, **kwargs).graph_module


@contextlib.contextmanager
def _release_export_state() -> Iterator[None]:
    """Drop what an export leaves in process-wide tables. dynamo's backend table
    (``eval_frame.cached_backends``) gets the export's capturing compiler, a closure holding
    the export's graph, fake tensors and shape environment for the life of the process (3.5 MB
    per transform of the zoo GPT-2, with the caches below). The export's cache entries, the only
    users of the entry, live on a private code object that dies with it (_private_top_frame).
    torch.export's tracer keeps a map from fake tensors to the placeholders of the last graph
    it traced (``proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``, emptied when the next
    trace starts); a non-strict capture keeps that graph, so the map would keep the transformed
    graph, and the model's weights with it, alive until the next export in the process.
    dynamo's guards register a ``weakref.finalize`` on every object they match by identity
    (the model's modules and parameters, torch functions) to invalidate their cache entry
    when it dies; each keeps the export's guards alive as long as the model (about 0.5 MB per
    transform of the zoo GPT-2). The entry they would invalidate is gone with the private top
    frame, so the export's own finalizers are detached."""
    from torch.fx.experimental import proxy_tensor

    table = getattr(torch._dynamo.eval_frame, "cached_backends", None)
    before = set(table) if isinstance(table, dict) else None
    finalizers = set(_finalizers())
    try:
        yield
    finally:
        if before is not None:
            for key in [k for k in table if k not in before]:
                del table[key]
        for finalizer in [f for f in _finalizers() if f not in finalizers]:
            _detach_guard_finalizer(finalizer)
        placeholders = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
        if isinstance(placeholders, dict):
            placeholders.clear()
        _clear_shape_caches()


def _finalizers() -> list[weakref.finalize]:
    """The process's pending ``weakref.finalize`` objects (none where Python keeps them
    elsewhere)."""
    registry = getattr(weakref.finalize, "_registry", None)
    return list(registry) if isinstance(registry, dict) else []


def _detach_guard_finalizer(finalizer: weakref.finalize) -> None:
    """Detach ``finalizer`` if it invalidates dynamo guards (``CheckFunctionManager.invalidate``,
    bound through ``functools.partial``); leave any other alone."""
    from torch._dynamo.guards import CheckFunctionManager

    pending = finalizer.peek()
    callback = getattr(pending[1], "func", None) if pending is not None else None
    if isinstance(getattr(callback, "__self__", None), CheckFunctionManager):
        finalizer.detach()


def _clear_shape_caches() -> None:
    """Empty the process-wide caches an export fills: the ``lru_cache``s on ``ShapeEnv``'s
    methods (keyed by the ShapeEnv, so each keeps every export's shape environment, fake
    tensors and guard stack traces alive) and fake tensors' dispatch cache. Both are caches
    of pure functions: emptying them costs the next compile a recomputation, never a result."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for value in vars(ShapeEnv).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()
    clear = getattr(FakeTensorMode, "cache_clear", None)
    if callable(clear):
        clear()


@contextlib.contextmanager
def _keep_dim_marks(inputs: object) -> Iterator[None]:
    """Leave the caller's tensors as they were: an export with ``dynamic_shapes`` marks them
    (``_dynamo_weak_dynamic_indices``), and a later capture of the same tensors, even a static
    one, would make those dimensions dynamic."""
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    saved = [{k: copy.copy(v) for k, v in vars(t).items() if k.startswith("_dynamo")
              or k == "_has_dynamo_dim_marking"} for t in tensors]
    try:
        yield
    finally:
        for t, old in zip(tensors, saved):
            for k in [k for k in vars(t) if k.startswith("_dynamo")
                      or k == "_has_dynamo_dim_marking"]:
                if k not in old:
                    delattr(t, k)
            for k, v in old.items():
                setattr(t, k, v)


@contextlib.contextmanager
def _no_backend_choice(dynamic_shapes: object) -> Iterator[None]:
    """With dynamic sizes, capture as torch.export does, with the CPU/GPU convolution backends
    (mkldnn, nnpack, cudnn) off: choosing one reads the batch size (mkldnn below 16), so a conv
    fixed a dynamic batch to [2, 15]. The graph names no backend; kernels choose at run time."""
    if dynamic_shapes is None:
        yield
        return
    flags = [b.set_flags(False) for b in (torch.backends.mkldnn, torch.backends.nnpack,
                                          torch.backends.cudnn)]
    try:
        yield
    finally:
        for b, old in zip((torch.backends.mkldnn, torch.backends.nnpack, torch.backends.cudnn),
                          flags):
            b.set_flags(*old)


def _raise_if_own(model: nn.Module, exc: BaseException) -> None:
    """A failure raised by amprewrite's own code around the export (the structural copy, the
    quiet loggers) is amprewrite's, not dynamo's: say so. Errors amprewrite raises on purpose
    pass through."""
    if isinstance(exc, AmpRewriteError):
        raise exc
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and os.path.abspath(frames[-1].filename).startswith(_OWN_DIR):
        raise CaptureError(_own_failure(model, exc)) from exc


def _raise_if_plain_export_works(model: nn.Module, args: tuple, kwargs: dict,
                                 error: BaseException) -> None:
    """Before blaming dynamo, export a deep copy of the model exactly as a user would
    (``torch._dynamo.export(model)(*args)``). If that works, the failure is amprewrite's. The
    export's caches and guards are released as after a capture."""
    try:
        with (warnings.catch_warnings(), _quiet_loggers(), _no_recompile_limit(),
              _private_top_frame(), _release_export_state(), sources_die_with_code()):
            warnings.simplefilter("ignore")
            torch._dynamo.export(copy.deepcopy(model), assume_static_by_default=True)(
                *args, **kwargs)
    except Exception:
        return
    raise CaptureError(_own_failure(model, error)) from error


def _own_failure(model: nn.Module, exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return (
        f"amprewrite could not capture {type(model).__name__}: {type(exc).__name__}: "
        f"{first.rstrip('.')}. This is a bug in amprewrite, not in the model or in torch dynamo: "
        "torch._dynamo.export captures the same model on these inputs. Please report it with "
        "the model's class; meanwhile, transform without example_inputs (symbolic tracing) or "
        "compile with torch.compile's default backend under torch.autocast."
    )


def _capture_advice(text: str, out: object) -> str:
    """What to do about a capture dynamo refused, from its message and the eager output."""
    caches = sorted({type(v).__name__ for v in _leaves(out)
                     if type(v).__module__.startswith("transformers")
                     and type(v).__name__.endswith("Cache")})
    if caches:
        return (f"It returns a transformers {caches[0]} (use_cache=True, the model's default), "
                "which amprewrite returns from the graph through transformers.exporters' pytree "
                "registration of caches, here not enough. Add 'use_cache': False to the keyword "
                "inputs ({'input_ids': ids, 'use_cache': False}), or set "
                "model.config.use_cache = False before transforming; for generate(), "
                "amprewrite.for_generation(model) keeps the cache outside the graph.")
    lowered = text.lower()
    if "data-dependent" in lowered or "data dependent" in lowered:
        return ("Its control flow or output shapes depend on tensor values (a detection model's "
                "boxes, a branch on x.sum() > 0), which one graph cannot hold: "
                "torch.compile(model, backend='amprewrite') splits the model at those points and "
                "transforms every graph; or write the branch with torch.where or torch.cond.")
    if "pytree" in lowered or "output" in lowered:
        return ("It returns a type dynamo cannot return from a graph: register it with "
                "torch.utils._pytree.register_pytree_node, or return tensors, tuples or dicts.")
    return ("It has a construct dynamo cannot capture as one graph: rewrite the construct "
            "dynamo names, or use torch.compile(model, backend='amprewrite'), which splits the "
            "model at graph breaks and transforms every graph.")


def _leaves(value: object, depth: int = 0) -> list[object]:
    """The objects in a model output (through tuples, lists, dicts and dataclass fields)."""
    if depth > 20:
        return []
    if isinstance(value, Mapping):
        children = list(value.values())
    elif isinstance(value, (tuple, list)):
        children = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return [value]
    return [leaf for child in children for leaf in _leaves(child, depth + 1)]


def fails_without_amprewrite(model: nn.Module, kwargs: dict, failure: str) -> CaptureError:
    """The error for example inputs the fp32 model itself fails on (``failure``: why, as
    :func:`eager_failure` says it)."""
    call = "model(**example_inputs)" if kwargs else "model(*example_inputs)"
    return CaptureError(f"{type(model).__name__} fails on the given example_inputs even without "
                        f"amprewrite: {failure}. Fix the model or the inputs; {call} must run in "
                        "fp32.")


def eager_failure(model: nn.Module, example_inputs: object) -> CaptureError | None:
    """:func:`fails_without_amprewrite`'s error when the fp32 model fails on
    ``example_inputs`` (run on a copy: no state changes), else None. A capture runs the model
    on fake tensors, which do not check values: an embedding index out of range fails only at
    the first real run, in the passes."""
    args, kwargs = split_inputs(example_inputs)
    failure, _ = _eager_run(model, args, kwargs)
    return None if failure is None else fails_without_amprewrite(model, kwargs, failure)


def _eager_run(model: nn.Module, args: tuple, kwargs: dict) -> tuple[str | None, object]:
    """Run the model eagerly on a copy (no state changes): (why it fails or None, output)."""
    try:
        with torch.no_grad():
            return None, copy.deepcopy(model)(*args, **kwargs)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}", None


def _register_output_dataclasses(out: object) -> bool:
    """Register the dataclasses in a model output with torch's pytree (what torch.export asks
    users to do by hand), so dynamo can return them. True when one was newly registered."""
    found: list[type] = []

    def walk(value: object, depth: int = 0) -> None:
        if depth > 20:
            return
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if type(value) not in pytree.SUPPORTED_NODES and type(value) not in found:
                found.append(type(value))
            children = [getattr(value, f.name) for f in dataclasses.fields(value)]
        elif isinstance(value, Mapping):
            children = list(value.values())
        elif isinstance(value, (tuple, list)):
            children = list(value)
        else:
            return
        for child in children:
            walk(child, depth + 1)

    walk(out)
    for cls in found:
        pytree.register_dataclass(cls)
        REGISTERED_OUTPUTS[cls] = 0  # released with the last graph returning it
    return bool(found)


def _register_hf_caches(model: nn.Module) -> None:
    """Register transformers' cache classes (``DynamicCache``, ``EncoderDecoderCache``, every
    ``Cache`` subclass and the model's own ``*Cache`` classes) with torch's pytree, so the graph
    can return the cache a model returns with ``use_cache=True``, its default. The registration
    is transformers' own (``transformers.exporters``, what its ``DynamoExporter`` does before
    ``torch.export``), and it stays, as transformers leaves it: transformers registers only what
    is not registered yet, so a program its exporter made while amprewrite's registration held
    would lose its cache type when amprewrite released it (``ep.module()(...)`` then raised
    ``KeyError: DynamicCache``). Nothing happens for a model without transformers modules, or
    with a transformers that has no ``exporters`` (before 5.2x; its caches then fail capture,
    with advice)."""
    if "transformers" not in sys.modules:
        return
    owners = {type(m).__module__: m for m in model.modules()
              if type(m).__module__.startswith("transformers.")}
    if not owners:
        return
    try:
        from transformers.exporters import exporter_dynamo
    except ImportError:
        return
    for module in owners.values():  # each modeling file's own cache classes
        exporter_dynamo.register_cache_pytrees_for_model(module)
    # Their unflatten finds each class by its dotted path with importlib, which dynamo refuses
    # to trace: torch.compile(gm, fullgraph=True) of a graph returning a cache failed there.
    # The path names the same class at every call, so dynamo may call it while tracing.
    to_class = getattr(exporter_dynamo, "_path_to_class", None)
    if callable(to_class):
        import torch._dynamo

        torch._dynamo.assume_constant_result(to_class)


# Containers torch's pytree knows itself (namedtuples and dataclasses aside).
_TORCH_CONTAINERS = (tuple, list, dict, collections.OrderedDict, collections.defaultdict,
                     collections.deque, type(None))


def _foreign_spec_types(model: nn.Module) -> list[type]:
    """The types other than torch's containers, dataclasses and namedtuples in the input or
    output spec of a GraphModule's pytree codegen (``ep.module()`` of a program whose model
    takes or returns a transformers cache): its forward calls their flatten functions, which
    are arbitrary Python (transformers' import classes by name, which dynamo refuses to trace)."""
    info = getattr(getattr(getattr(model, "graph", None), "_codegen", None), "pytree_info", None)
    found: list[type] = []
    todo = [s for s in (getattr(info, "in_spec", None), getattr(info, "out_spec", None)) if s]
    while todo:
        spec = todo.pop()
        cls = spec.type
        if (cls is not None and cls not in _TORCH_CONTAINERS and not dataclasses.is_dataclass(cls)
                and not pytree.is_namedtuple_class(cls) and cls not in found):
            found.append(cls)
        todo += [spec.child(i) for i in range(spec.num_children)]
    return found


def _operand_dtypes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Dynamo's fake kernels accept ``linear(int_tensor, float_weight)``; eager PyTorch does not.
    Say so at transform time instead of at the first call. Only the two data operands are
    compared (input and weight, a and b): later tensor arguments may be integer by design (a
    grouped matmul's group offsets)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        family = family_of(node)
        if family is None or not family.needs_float:
            continue
        infos = [M.info(a) for a in node.args if isinstance(a, fx.Node)]
        dtypes = [i.dtype for i in infos if i.kind == "tensor" and i.dtype is not None][:2]
        if any(d.is_floating_point for d in dtypes) and any(not d.is_floating_point
                                                             for d in dtypes):
            path = node.meta.get(M.MODULE_PATH) or "the model"
            raise CaptureError(
                f"{type(model).__name__} cannot run on the given example_inputs: {family.name} "
                f"in {path} receives tensors of dtypes {', '.join(map(str, dtypes))}, and "
                "PyTorch needs them to match. Check the dtypes of example_inputs (token ids "
                "go to embeddings, features must be floating point); model(*example_inputs) "
                "must run in fp32."
            )


def annotate_dynamo_graph(graph: fx.Graph) -> None:
    """Module paths and ValueInfos (see :mod:`amprewrite.graph.meta`) from dynamo's own node
    meta."""
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        entries = list(stack.values())
        node.meta[M.MODULE_PATH] = M.clean_module_path(entries[-1][0]) if entries else ""
        node.meta[M.MODULE_TYPES] = tuple(e[1] for e in entries if isinstance(e[1], type))
        if node.op != "output":
            node.meta[M.ORIG] = M.info_from_value(
                M.fake_value(node))


def _quiet_loggers():
    """Silence dynamo's internal logging (shape warnings, fake-tensor tracebacks of a failing
    op); real failures still raise and are reported as one CaptureError."""
    return quiet_loggers("torch.fx.experimental.symbolic_shapes", "torch._dynamo",
                         "torch._subclasses.fake_tensor", level=50)


def _inline_recomputed(graph: fx.Graph, owner: fx.GraphModule) -> None:
    """Put the body of each ``runtime.recompute`` call (recompute_islands) back in its place."""
    for call in list(graph.nodes):
        if call.op != "call_function" or call.target is not runtime.recompute:
            continue
        ref, *args = call.args
        body = owner.get_submodule(str(ref.target))
        env: dict[fx.Node, object] = {}
        placeholders = iter(args)
        with graph.inserting_before(call):
            for node in body.graph.nodes:
                if node.op == "placeholder":
                    env[node] = next(placeholders)
                elif node.op == "output":
                    out = fx.node.map_arg(node.args[0], env.__getitem__)
                else:
                    env[node] = graph.node_copy(node, env.__getitem__)
        if isinstance(out, tuple):  # several outputs: the call's getitem users read them
            for user in list(call.users):
                user.replace_all_uses_with(out[user.args[1]])
                graph.erase_node(user)
        else:
            call.replace_all_uses_with(out)
        graph.erase_node(call)
        if not ref.users:
            graph.erase_node(ref)


def _with_fresh_names(graph: fx.Graph) -> fx.Graph:
    """``graph`` copied node for node (names and meta kept) into a graph whose namespace holds
    only the names in use. fx never frees an erased node's name, so without this the casts of
    a second transform would be ``to_6``, ``to_7``, ... where the first named them ``to``."""
    fresh = fx.Graph(tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    fresh._codegen = graph._codegen
    old_output = next(iter(graph.find_nodes(op="output")))
    out = fresh.graph_copy(graph, {})
    fresh.output(out, type_expr=old_output.type).meta = copy.copy(old_output.meta)
    return fresh


def _recapture(gm: fx.GraphModule) -> Capture:
    """The graph amprewrite captured for an already transformed GraphModule: its own graph (no
    re-trace, node names kept) without the casts amprewrite inserted, so transforming twice
    gives the graph transforming once gives."""
    policy = gm.meta.get(POLICY_KEY)
    if policy is not None and policy.params == "low":
        raise PolicyError(
            "this GraphModule was transformed with params='low', so some of its weights are "
            "already rounded to low precision. Transform the original fp32 model instead."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own treespec deprecation on deepcopy
        graph = copy.deepcopy(gm.graph)
    _inline_recomputed(graph, gm)
    for node in list(graph.nodes):
        if M.CAST in node.meta:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph = _with_fresh_names(graph)
    for node in graph.nodes:
        M.reset(node)
    cls = DynamoGraphModule if isinstance(gm, DynamoGraphModule) else fx.GraphModule
    new = rebuild(gm, graph, lambda target: get_attr(gm, target), cls)
    training = getattr(gm, "_amp_captured_training", None)
    if isinstance(new, DynamoGraphModule):
        new._amp_captured_training = training
        new._amp_inputs = gm._amp_inputs
    return Capture(new, gm.meta[REPORT_KEY].capture, training)


@contextlib.contextmanager
def _registrations_held() -> Iterator[None]:
    """Keep every pytree registration amprewrite made for the length of a capture, so a graph
    collected meanwhile cannot take away one the capture is using; afterwards, release those
    no live graph returns (caches registered for a model that returned none of them)."""
    held = tuple(REGISTERED_OUTPUTS)
    for cls in held:
        REGISTERED_OUTPUTS[cls] += 1
    try:
        yield
    finally:
        added = tuple(c for c in REGISTERED_OUTPUTS if c not in held)
        for cls in added:
            REGISTERED_OUTPUTS[cls] += 1
        _release_registrations(held + added)


def capture(model: nn.Module, example_inputs: object = None, dynamic_shapes: object = BATCH,
            method: str = "dynamo") -> Capture:
    """Capture ``model``: symbolic trace without example inputs; with them, ``method``
    ``"dynamo"`` (dynamo export) or ``"export"`` (non-strict torch.export); ``dynamic_shapes``
    as :func:`amprewrite.transform` takes it."""
    with sources_die_with_code(), _registrations_held():
        if isinstance(model, fx.GraphModule) and REPORT_KEY in model.meta:
            return _recapture(model)
        if example_inputs is None:
            return Capture(_symbolic(model), "symbolic_trace", None)
        args, kwargs = split_inputs(example_inputs)
        if method == "dynamo" and _foreign_spec_types(model):
            # Its forward flattens and unflattens them in Python that dynamo cannot trace;
            # non-strict export runs that Python as it is (the graph is ATen-level either way).
            method = "export"
        return Capture(_with_inputs(model, args, kwargs, dynamic_shapes, method), method,
                       model.training)
