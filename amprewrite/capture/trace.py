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

import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import operator
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from ..errors import CaptureError, ModelError, PolicyError
from ..graph import meta as M
from ..graph import runtime
from ..graph.graphmodule import (
    REGISTERED_OUTPUTS,
    DynamoGraphModule,
    add_input_check,
    sources_die_with_code,
)
from ..graph.modules import buffer_clone_copy, get_attr, has_attr, rebuild, share_copy, tensor_names
from ..graph.shapes import BATCH, InputGuard, capture_spec, flat_inputs, split_inputs
from ..precision.ops import family_of
from ..precision.policy import Policy, check_node_selectors, check_selectors
from ..precision.report import CAPTURE_TOOL, POLICY_KEY, REPORT_KEY
from ..progress import status
from .dynamo_state import (
    custom_functions,
    foreign_spec_types,
    keep_dim_marks,
    no_backend_choice,
    no_recompile_limit,
    private_top_frame,
    quiet_capture_loggers,
    register_hf_caches,
    register_output_dataclasses,
    registrations_held,
    release,
    release_export_state,
)
from .failures import (
    capture_advice,
    eager_failure,
    eager_run,
    fails_without_amprewrite,
    raise_if_own,
    raise_if_plain_export_works,
    symbolic_cause,
    user_frame,
)

__all__ = ["CAPTURE_TOOL", "Capture", "annotate_dynamo_graph", "capture", "capture_model",
           "check_model", "eager_failure", "import_compiler", "model_device"]



@dataclass
class Capture:
    """A captured graph and how it was obtained."""

    gm: fx.GraphModule
    method: str  # "symbolic_trace" or "dynamo"
    training: bool | None  # the mode dynamo baked in; None for symbolic graphs (mode follows gm)


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
        frame = user_frame(exc)
        where = ""
        if frame is not None:
            where = f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise CaptureError(
            f"amprewrite could not trace {type(model).__name__} symbolically{where}: "
            f"{type(exc).__name__}: {text}. {symbolic_cause(text)} Pass example_inputs=(...) "
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
    register_hf_caches(model)
    run = _export if method == "dynamo" else _export_nonstrict
    try:
        src = run(model, args, kwargs, spec)
    except Exception as exc:
        src, error = None, exc
        raise_if_own(model, exc)
    if src is None:
        failure, out = eager_run(model, args, kwargs)
        if failure is not None:
            raise fails_without_amprewrite(model, kwargs, failure) from None
        if register_output_dataclasses(out):
            try:
                src = run(model, args, kwargs, spec)
            except Exception as exc:
                error = exc
                raise_if_own(model, exc)
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
                raise_if_plain_export_works(model, args, kwargs, error)
            text = str(error).strip()
            first = text.splitlines()[0] if text else type(error).__name__
            tool = "dynamo" if method == "dynamo" else "torch.export (non-strict)"
            raise CaptureError(
                f"{tool} could not capture {type(model).__name__} with the given "
                f"example_inputs: {type(error).__name__}: {first} The model runs eagerly on "
                f"these inputs (the cause is outside amprewrite). {capture_advice(text, out)}"
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
    release(owner)
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
    with (warnings.catch_warnings(), quiet_capture_loggers(), no_backend_choice(dynamic_shapes),
          keep_dim_marks((args, kwargs)), release_export_state(), custom_functions() as seen):
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


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: object = None
            ) -> fx.GraphModule:
    with (warnings.catch_warnings(), quiet_capture_loggers(), no_recompile_limit(),
          private_top_frame(), no_backend_choice(dynamic_shapes),
          keep_dim_marks((args, kwargs)), release_export_state()):
        warnings.simplefilter("ignore")
        # A structural copy: assignments in forward (``self.count = self.count + 1``) land on
        # the copy, never on the caller's modules (dynamo would leave FakeTensors there).
        # Static by default (fast, and a graph for exactly these sizes); dimensions the caller
        # marked dynamic (a re-capture for new sizes) or named in ``dynamic_shapes`` (the
        # batch, by default) stay symbolic.
        return torch._dynamo.export(share_copy(model), dynamic_shapes=dynamic_shapes,
                                    assume_static_by_default=True)(*args, **kwargs).graph_module


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
    """Module paths and ValueInfos (see :mod:`amprewrite.graph.meta`) from dynamo's own
    node meta."""
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        entries = list(stack.values())
        node.meta[M.MODULE_PATH] = M.clean_module_path(entries[-1][0]) if entries else ""
        node.meta[M.MODULE_TYPES] = tuple(e[1] for e in entries if isinstance(e[1], type))
        if node.op != "output":
            node.meta[M.ORIG] = M.info_from_value(
                M.fake_value(node))


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
    # The autocast guard too (guard_autocast puts it back, first and last).
    guards = (runtime.autocast_on_again, runtime.autocast_off)
    for target in guards:
        for node in list(graph.find_nodes(op="call_function", target=target)):
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


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer; the CPU for a model with none."""
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("cpu")


def check_model(model: object) -> None:
    """Raise :class:`ModelError` for what cannot be transformed: not an ``nn.Module``, a
    TorchScript module, a DataParallel/DDP wrapper, no ``forward``, weights already all low,
    or uninitialised/meta tensors."""
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"amprewrite.transform expects a torch.nn.Module, got {type(model).__name__}. Wrap a "
            "plain function in an nn.Module whose forward calls it."
        )
    name = type(model).__name__
    if isinstance(model, torch.jit.ScriptModule):
        raise ModelError(
            f"{name} is a TorchScript module; amprewrite rewrites Python nn.Modules. Pass the "
            "original nn.Module (before torch.jit.script/trace)."
        )
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ModelError(
            f"{name} is a wrapper; transform the module it wraps (model.module) and wrap the "
            "returned GraphModule instead (DDP works with it, see docs/guide.md)."
        )
    if type(model).forward is nn.Module.forward:
        raise ModelError(f"{name} has no forward method; there is nothing to transform.")
    floats = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    transformed = REPORT_KEY in getattr(model, "meta", {})  # capture says what it can redo
    low = (torch.float16, torch.bfloat16)
    if floats and not transformed and all(t.dtype in low for t in floats):
        raise ModelError(
            f"{name}'s floating-point parameters and buffers are all {floats[0].dtype} "
            "already: amprewrite starts from an fp32 model and decides per op what runs in "
            "low precision; the precision of weights and BatchNorm statistics already rounded "
            "cannot be recovered. Transform the fp32 model (load it in fp32, or model.float())."
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta or isinstance(t, nn.parameter.UninitializedParameter):
            raise ModelError(
                f"{type(model).__name__} has an uninitialised or meta-device tensor '{name}'. "
                "Materialise the model first (load its weights, or run one forward for lazy "
                "modules, or model.to_empty(device=...) and initialise), then transform it."
            )


# What the progress line and the report's notes call each capture.


def import_compiler() -> float:
    """Import ``torch._inductor`` (and with it ``torch._dynamo``) if no one has: about 1 s,
    once per process, that torch spends the first time a capture records its nodes' stack
    traces (fx's ``create_node`` symbolizes them through it) or dynamo runs. Imported before
    the capture, so that the report times it apart (``timings["import torch._inductor"]``)
    instead of counting it as capture. The seconds it took (0.0 once imported)."""
    if "torch._inductor" in sys.modules:
        return 0.0
    start = time.perf_counter()
    status("importing torch._inductor and torch._dynamo (once per process)")
    import torch._inductor  # noqa: F401

    return time.perf_counter() - start


def capture_model(model: nn.Module, example_inputs: object, policy: Policy
                  ) -> tuple[Capture, Policy]:
    """The capture stage of :func:`amprewrite.transform`: check that ``model`` can be captured
    and that ``policy``'s selectors name its modules, give the policy the model's device where
    it has none, capture, and check the ``node:`` selectors against the graph."""
    check_model(model)
    check_selectors(policy, (name for name, _ in model.named_modules()), type(model).__name__)
    if policy.device is None:
        policy = dataclasses.replace(policy, device=model_device(model))
    status("capturing the graph with " + (CAPTURE_TOOL[policy.capture]
                                           if example_inputs is not None
                                           else "torch.fx.symbolic_trace"))
    captured = capture(model, example_inputs, policy.dynamic_shapes, policy.capture)
    check_node_selectors(policy, captured.gm)
    return captured, policy


# Within keep_captured(): (id(model), id(example_inputs), the method asked for) -> what the
# capture made for them, before any pass (_Kept); the model and the inputs are held so that
# their ids name them while the entry lives. For calls that capture one model several times:
# check_numerics (the transform's capture, then its fp32 reference), find_fp32_nodes and
# ``check --fix`` (a transform each round), ``dump`` and ``explore`` (the graph before, then
# the transform).
_CAPTURED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("amp_captured",
                                                                       default=None)


@dataclass(frozen=True)
class _Kept:
    model: nn.Module
    inputs: object
    gm: fx.GraphModule  # a copy of the graph as captured, over the capture's modules
    source: fx.GraphModule  # the capture itself: holds the pytree registrations it needs
    dynamic_shapes: object
    training: bool
    method: str  # the method that captured it ("export" where dynamo was asked but cannot)


@contextlib.contextmanager
def keep_captured():
    """Within it, each capture on example inputs keeps a copy of its graph as captured,
    before any pass, and a capture of the same model on the same inputs object (the same
    method, dynamic shapes and train/eval mode) starts from that copy instead of capturing
    again: :func:`amprewrite.transform` with another policy, and the fp32 reference of
    :func:`captured_again`. For a 2-layer T5 a capture is ~5 s of CPU. Nested blocks share the
    outermost one's captures. Only for calls that do not change the model between captures
    (its weights may change: the graph reads the model's own tensors)."""
    if _CAPTURED.get() is not None:
        yield
        return
    token = _CAPTURED.set({})
    try:
        yield
    finally:
        _CAPTURED.reset(token)


def captured_again(model: nn.Module, example_inputs: object, method: str = "dynamo"
                   ) -> fx.GraphModule | None:
    """The graph that ``capture(model, example_inputs, method=method)`` made inside
    :func:`keep_captured` for these very objects, as it was captured (a GraphModule of its own
    over the same tensors, the same node names); None where there was none."""
    kept = (_CAPTURED.get() or {}).get((id(model), id(example_inputs), method))
    return None if kept is None else kept.gm


def _keep(model: nn.Module, example_inputs: object, method: str, gm: fx.GraphModule,
          dynamic_shapes: object, used: str) -> None:
    kept = _CAPTURED.get()
    if kept is None or any(_holds_tensors(gm.get_submodule(str(n.target)))
                           for n in gm.graph.nodes if n.op == "call_module"):
        return  # a pass may change a called submodule in place: that graph is captured again
    # The copy's own Graph (nodes, their meta dicts) and module tree, the same tensors: the
    # passes change the original's graph and attributes, never a tensor in place.
    kept[(id(model), id(example_inputs), method)] = _Kept(
        model, example_inputs, fx.GraphModule(gm, _graph_copy(gm.graph)), gm, dynamic_shapes,
        model.training, used)


def _graph_copy(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph(tracer_cls=graph._tracer_cls)
    copy.output(copy.graph_copy(graph, {}))
    copy._codegen = graph._codegen  # the pytree specs in and out, as they are (no copy)
    return copy


def _same(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # tensors or other values without a truth value: not the same
        return False


def _captured_before(model: nn.Module, example_inputs: object, method: str,
                     dynamic_shapes: object) -> Capture | None:
    """A new capture of ``model`` made from the copy :func:`keep_captured` kept of an earlier
    one, as :func:`_recapture` makes one from a transformed graph: a GraphModule of its own
    over a copy of the graph, reading the model's tensors; None where nothing was kept."""
    kept = (_CAPTURED.get() or {}).get((id(model), id(example_inputs), method))
    if (kept is None or kept.training != model.training
            or not _same(kept.dynamic_shapes, dynamic_shapes)):
        return None
    status("reusing the graph captured for these inputs")
    new = rebuild(model, _graph_copy(kept.gm.graph), lambda target: get_attr(kept.gm, target),
                  DynamoGraphModule)
    new._amp_captured_training = kept.training
    new._amp_inputs = kept.source._amp_inputs
    return Capture(new, kept.method, kept.training)


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def capture(model: nn.Module, example_inputs: object = None, dynamic_shapes: object = BATCH,
            method: str = "dynamo") -> Capture:
    """Capture ``model``: symbolic trace without example inputs; with them, ``method``
    ``"dynamo"`` (dynamo export) or ``"export"`` (non-strict torch.export); ``dynamic_shapes``
    as :func:`amprewrite.transform` takes it."""
    with sources_die_with_code(), registrations_held():
        if isinstance(model, fx.GraphModule) and REPORT_KEY in model.meta:
            return _recapture(model)
        if example_inputs is None:
            return Capture(_symbolic(model), "symbolic_trace", None)
        again = _captured_before(model, example_inputs, method, dynamic_shapes)
        if again is not None:
            return again
        args, kwargs = split_inputs(example_inputs)
        asked = method
        if method == "dynamo" and foreign_spec_types(model):
            # Its forward flattens and unflattens them in Python that dynamo cannot trace;
            # non-strict export runs that Python as it is (the graph is ATen-level either way).
            method = "export"
        gm = _with_inputs(model, args, kwargs, dynamic_shapes, method)
        _keep(model, example_inputs, asked, gm, dynamic_shapes, method)
        return Capture(gm, method, model.training)
