"""Capture a model into a ``torch.fx.GraphModule``.

Without example inputs the model is traced symbolically (``torch.fx.symbolic_trace``); with them
it is captured by dynamo (``torch._dynamo.export``), which handles real-world models and unrolls
Python loops. Either way the result:

- names parameters and buffers by their original qualified names (``gm.state_dict()`` keys equal
  the model's) and shares the caller's tensors, never copies them;
- never shares a module object with the caller: leaf modules the graph calls are shallow copies
  that share parameters, so ``gm.train()`` cannot flip the caller's modules;
- records the original module path of every node in ``node.meta`` (see :mod:`amprewrite.meta`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import time
import traceback
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

from . import meta as M
from .errors import CaptureError, ModelError, ModeSwitchError, PolicyError, ShapeError
from .ops import family_of
from .report import POLICY_KEY, REPORT_KEY
from .shapes import InputCheck, InputGuard, flat_inputs, positional_leaves

__all__ = ["Capture", "DynamoGraphModule", "annotate_dynamo_graph", "capture"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)


class DynamoGraphModule(fx.GraphModule):
    """A GraphModule captured by dynamo, which bakes the train/eval mode, the input sizes and
    the non-tensor arguments into the graph.

    Switching it to the other mode raises instead of silently running the captured one. Each
    call checks its inputs against the capture's guards (:mod:`amprewrite.shapes`); inputs the
    graph was not captured for run on a graph transformed for them (made once, then cached),
    or raise :class:`~amprewrite.errors.ShapeError`.
    """

    _amp_captured_training: bool | None = None
    _amp_inputs: InputGuard | None = None
    # (model, policy) to transform again for new inputs; None: raise instead.
    _amp_source: tuple | None = None
    _amp_variants: tuple[fx.GraphModule, ...] = ()

    # The graph's code without pytree work and without its input check (see _FastCall).
    _amp_fast: _FastCall | None = None

    def __call__(self, *args, **kwargs):
        # Plain eager code (no dynamo frame callback; a builtin, so calling it starts no frame
        # dynamo could trace): the dispatcher runs as plain Python (its disable wrapper costs
        # ~5 us a call) and the common call takes the fast path. Under torch.compile every
        # Python function called from here would be traced: the disabled dispatcher, then
        # the GraphModule's ordinary call.
        if _FRAME_CALLBACK is not None and _FRAME_CALLBACK() is None:
            target = _select_eager(self, args, kwargs)
            fast = target._amp_fast
            if fast is not None and not kwargs and len(args) == fast.n and not _hooked(target):
                return fast(target, args)
        else:
            target = _select(self, args, kwargs)
        if target is self:
            return super().__call__(*args, **kwargs)
        return target(*args, **kwargs)

    def recompile(self):
        code = super().recompile()
        self._amp_fast = _FastCall.make(self)
        return code

    def train(self, mode: bool = True):
        captured = self._amp_captured_training
        if captured is not None and bool(mode) != captured:
            want, have = ("train", "eval") if mode else ("eval", "train")
            raise ModeSwitchError(
                f"this graph was captured by dynamo in {have} mode, which fixes BatchNorm and "
                f"Dropout behaviour inside the graph, so it cannot switch to {want} mode. Call "
                f"amprewrite.transform again on model.{want}() to get a {want}-mode graph, or "
                "transform without example_inputs (symbolic tracing keeps the mode switchable)."
            )
        return super().train(mode)


class _FastCall:
    """A captured graph's code for the common call -- as many plain positional inputs as
    captured, no keywords, no hooks -- once the dispatcher has checked the inputs.

    fx generates a dynamo graph's ``forward`` with a pytree flatten of the inputs, the input
    check (needed when ``forward`` is called or compiled directly, and repeated work once the
    dispatcher has checked) and a pytree unflatten of the outputs, all reached through
    ``nn.Module.__call__``. This is the same graph generated without the three
    (``fx.graph.CodeGen``), its flat outputs rebuilt by the captured output spec. (The larger
    cost of the old call, binding the arguments to the signature, is gone from
    :func:`~amprewrite.shapes.flat_inputs`.)
    """

    def __init__(self, fn, n: int, out_spec: pytree.TreeSpec):
        self.fn, self.n, self.out_spec = fn, n, out_spec
        children = [out_spec.child(i) for i in range(out_spec.num_children)]
        self.kind = ("leaf" if out_spec.is_leaf() else "tuple"
                     if out_spec.type is tuple and all(c.is_leaf() for c in children)
                     else "tree")

    def __call__(self, gm: fx.GraphModule, args: tuple):
        out = self.fn(gm, *args)
        if self.kind == "leaf":
            return out[0]
        if self.kind == "tuple":
            return tuple(out)
        return pytree.tree_unflatten(out, self.out_spec)

    @classmethod
    def make(cls, gm: fx.GraphModule) -> _FastCall | None:
        graph = gm.graph
        codegen = graph._codegen
        info = getattr(codegen, "pytree_info", None)
        if info is None or info.out_spec is None:
            return None
        n = positional_leaves(info.in_spec)
        if n < 0:
            return None
        checks = [f"    {node.name} = self.{INPUT_CHECK}("
                  for node in graph.find_nodes(op="call_module", target=INPUT_CHECK)]
        graph._codegen = fx.graph.CodeGen()
        try:
            code = graph.python_code(root_module="self")
            src = "\n".join(line for line in code.src.splitlines()
                            if not line.startswith(tuple(checks)) or not checks)
            fn = fx.graph_module._forward_from_src(src, code.globals)
        except Exception:  # a torch whose fx differs: the ordinary call still works
            return None
        finally:
            graph._codegen = codegen
        return cls(fn, n, info.out_spec)


def _hooked(m: nn.Module) -> bool:
    from torch.nn.modules import module as _m

    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or _m._global_forward_hooks
                or _m._global_forward_pre_hooks or _m._global_backward_hooks
                or _m._global_backward_pre_hooks)


def _select(gm: DynamoGraphModule, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The graph to run these inputs on: ``gm``, a cached variant, or a new one."""
    guard = gm._amp_inputs
    if guard is None:
        return gm
    flat = flat_inputs(gm, args, kwargs)
    if guard.accepts(flat):
        return gm
    for variant in gm._amp_variants:
        if variant._amp_inputs is None or variant._amp_inputs.accepts(flat_inputs(variant, args,
                                                                                  kwargs)):
            return variant
    why = guard.explain(flat)
    if gm._amp_source is None:
        raise ShapeError(
            f"{type(gm).__name__} was called with inputs it was not captured for: {why}. "
            "Running it anyway could fail inside the graph or return a result for the captured "
            "inputs. Transform the model again with example_inputs of this shape (or with "
            "on_new_shape='transform', the default, to let amprewrite do so when called)."
        )
    model, policy = gm._amp_source
    if isinstance(model, weakref.ref):  # params="low": the graph does not keep the fp32 model
        model = model()
        if model is None:
            raise ShapeError(
                f"{type(gm).__name__} was called with inputs it was not captured for: {why}. "
                "It was transformed with params='low' and holds only low-precision weights; "
                "the fp32 model it would be transformed from again has been freed. Keep the "
                "fp32 model alive to have new shapes transformed automatically, or transform "
                "with example_inputs of the shapes you will call it with."
            )
    if policy.on_new_shape == "error":
        raise ShapeError(
            f"{type(gm).__name__} was called with inputs it was not captured for: {why}. "
            "It was transformed with on_new_shape='error'. Transform again with "
            "example_inputs of the shapes you will call it with, or pass "
            "on_new_shape='transform' to transform once per new shape class automatically."
        )
    variant = _transform_for(gm, model, policy, args, kwargs, flat, why)
    gm._amp_variants = (*gm._amp_variants, variant)
    return variant



# Dynamo never traces the dispatcher: under torch.compile it runs eagerly (and may transform
# for new inputs), and dynamo traces the chosen graph's forward, whose first node checks the
# inputs, as it does for nn.Module.__call__ and forward. (Traced, its one code object shared by
# every transformed graph would also exhaust dynamo's recompile limit.)
torch._dynamo.eval_frame.skip_code(DynamoGraphModule.__call__.__code__)
_select_eager = _select
_select = torch._dynamo.disable(_select)  # and nothing it calls (guards, a re-transform)

# None when dynamo traces no frame (plain eager code); absent in some torch versions.
_FRAME_CALLBACK = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)


def _transform_for(gm, model, policy, args, kwargs, flat, why) -> fx.GraphModule:
    """Transform ``model`` again for new inputs; dimensions that changed become dynamic, so one
    new graph serves every size of them (torch.compile's automatic dynamic shapes)."""
    from .api import transform_with

    if len(gm._amp_variants) >= _MAX_VARIANTS:
        raise ShapeError(
            f"{type(gm).__name__} was called with inputs it was not captured for ({why}) and "
            f"has been transformed for {_MAX_VARIANTS} other input shapes already; amprewrite "
            "stops there, as torch.compile does. Pass example_inputs with the shapes you use, "
            "or check that the call's non-tensor arguments do not change on every call."
        )
    dynamic = gm._amp_inputs.changed_dims(flat)
    for earlier in gm._amp_variants:  # and what earlier variants made dynamic
        for i, dims in earlier._amp_inputs.changed_dims(flat, only_dynamic=True).items():
            dynamic[i] = sorted({*dynamic.get(i, ()), *dims})
    marked = {}
    for i, dims in dynamic.items():
        t = flat[i].clone()
        for d in dims:
            torch._dynamo.mark_dynamic(t, d)
        marked[id(flat[i])] = t
    args, kwargs = pytree.tree_map(lambda v: marked.get(id(v), v), (args, kwargs))
    marked_ids = {id(t) for t in marked.values()}
    example = kwargs if not args else (args if not kwargs else None)
    if example is None:  # both: bind everything by name
        example = dict(inspect.signature(gm.forward).bind(*args, **kwargs).arguments)
    start = time.perf_counter()
    try:
        try:
            variant = transform_with(model, policy, example)
        except CaptureError as exc:
            if "Constraints violated" not in str(exc):
                raise
            # The model fixes those sizes (an unrolled per-sample loop fixes the batch): a
            # graph for exactly these inputs.
            example = pytree.tree_map(lambda v: v.clone() if id(v) in marked_ids else v,
                                      example)
            variant = transform_with(model, policy, example)
    except CaptureError as exc:
        raise ShapeError(
            f"{type(gm).__name__} was called with inputs it was not captured for: {why}. "
            f"Transforming the model again for them failed: {exc}"
        ) from None
    _log.info("amprewrite: transformed %s again for new inputs (%s) in %.1f s",
              type(model).__name__, why, time.perf_counter() - start)
    return variant


_MAX_VARIANTS = 8
_log = logging.getLogger("amprewrite")


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


def _buffer_clone_copy(module: nn.Module) -> nn.Module:
    """A structural copy (see :func:`share_copy`) whose buffers are clones: tracing runs forward
    for real on buffers, and an in-place update there must not reach the caller's model."""
    new = share_copy(module)
    for mod in new.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = b.clone()
    return new


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
    traced = _buffer_clone_copy(model)
    try:
        graph = tracer.trace(traced)
    except Exception as exc:
        frame = _user_frame(exc)
        where = ""
        if frame is not None:
            where = f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
        raise CaptureError(
            f"amprewrite could not trace {type(model).__name__} symbolically{where}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "torch.fx.symbolic_trace cannot follow Python control flow on tensor shapes or "
            "values. Pass example_inputs=(...) to amprewrite.transform so the model is captured "
            "with torch dynamo, which handles shape-dependent control flow and loops (branches "
            "on tensor values need torch.where or torch.cond in the model)."
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
    return _rebuild(model, graph, lambda target: _get(model, target) if _has(model, target)
                    else _get(traced, target), fx.GraphModule)


def _dynamo(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise CaptureError(
            f"example_inputs do not match {type(model).__name__}.forward"
            f"{inspect.signature(model.forward)}: {exc}. Pass a tuple of positional inputs "
            "(or a dict of keyword inputs) that the model can be called with."
        ) from None
    try:
        exported = _export(model, args, kwargs)
    except Exception as exc:
        exported, error = None, exc
        _raise_if_own(model, exc)
    if exported is None:
        failure, out = _eager_run(model, args, kwargs)
        if failure is not None:
            raise CaptureError(
                f"{type(model).__name__} fails on the given example_inputs even without "
                f"amprewrite: {failure}. Fix the model or the inputs; model(*example_inputs) must "
                "run in fp32."
            ) from None
        if _register_output_dataclasses(out):
            try:
                exported = _export(model, args, kwargs)
            except Exception as exc:
                error = exc
                _raise_if_own(model, exc)
        if exported is None:
            _raise_if_plain_export_works(model, args, kwargs, error)
            text = str(error).strip()
            first = text.splitlines()[0] if text else type(error).__name__
            raise CaptureError(
                f"dynamo could not capture {type(model).__name__} with the given example_inputs: "
                f"{type(error).__name__}: {first} The model runs eagerly on these inputs, so it "
                "has a graph break or an output type that torch dynamo cannot capture as one graph "
                "(the cause is outside amprewrite): rewrite the construct dynamo names, or "
                "register a custom output type with torch.utils._pytree.register_pytree_node."
            ) from None
    src = exported.graph_module
    graph = src.graph
    annotate_dynamo_graph(graph)
    names = _tensor_names(model)
    for node in graph.nodes:
        if node.op == "get_attr":
            obj = _get(src, str(node.target))
            if isinstance(obj, torch.Tensor) and id(obj) in names:
                node.target = names[id(obj)]
    gm = _rebuild(model, graph, lambda target: _get(src, target), DynamoGraphModule)
    _release(src)
    gm._amp_captured_training = model.training
    gm._amp_inputs = InputGuard(gm, flat_inputs(gm, args, kwargs))
    _add_input_check(gm)
    _operand_dtypes(gm, model)
    return gm


def _release(src: fx.GraphModule) -> None:
    """Drop the exported module's references to the model's tensors. dynamo's cache entry for
    the export (on a code object only the export ran) keeps that module alive; with its
    tensors, dropping the fp32 model after ``params="low"`` would free nothing."""
    for mod in src.modules():
        mod._parameters.clear()
        mod._buffers.clear()
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor):
                delattr(mod, name)


def _add_input_check(gm: DynamoGraphModule) -> None:
    """Make the guard the graph's first node: eager calls, torch.compile and exported graphs
    all check their inputs."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    gm.add_submodule(INPUT_CHECK, InputCheck(gm._amp_inputs))
    with graph.inserting_after(placeholders[-1] if placeholders else None):
        node = graph.call_module(INPUT_CHECK, tuple(placeholders))
    node.meta[M.ORIG] = M.OTHER
    node.meta[M.MODULE_PATH] = ""
    node.meta[M.MODULE_TYPES] = ()
    gm.recompile()


INPUT_CHECK = "amp_input_check"


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

    def wrap_inline(fn):
        inner = shared(fn)
        code = inner.__code__
        inner.__code__ = code.replace(co_varnames=code.co_varnames)  # a distinct code object
        return inner

    utils.wrap_inline = wrap_inline
    try:
        yield
    finally:
        utils.wrap_inline = shared


def _export(model: nn.Module, args: tuple, kwargs: dict):
    with (warnings.catch_warnings(), _quiet_loggers(), _no_recompile_limit(),
          _private_top_frame()):
        warnings.simplefilter("ignore")
        # A structural copy: assignments in forward (``self.count = self.count + 1``) land on
        # the copy, never on the caller's modules (dynamo would leave FakeTensors there).
        # Static by default (fast, and a graph for exactly these sizes); dimensions the caller
        # marked dynamic (a re-capture for new sizes) stay symbolic.
        return torch._dynamo.export(share_copy(model), assume_static_by_default=True)(
            *args, **kwargs)


def _raise_if_own(model: nn.Module, exc: BaseException) -> None:
    """A failure raised by amprewrite's own code around the export (the structural copy, the
    quiet loggers) is amprewrite's, not dynamo's: say so."""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and os.path.abspath(frames[-1].filename).startswith(_OWN_DIR):
        raise CaptureError(_own_failure(model, exc)) from exc


def _raise_if_plain_export_works(model: nn.Module, args: tuple, kwargs: dict,
                                 error: BaseException) -> None:
    """Before blaming dynamo, export a deep copy of the model exactly as a user would
    (``torch._dynamo.export(model)(*args)``). If that works, the failure is amprewrite's."""
    try:
        with warnings.catch_warnings(), _quiet_loggers(), _no_recompile_limit():
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
        f"amprewrite could not capture {type(model).__name__}: {type(exc).__name__}: {first} "
        "This is a bug in amprewrite, not in the model or in torch dynamo: "
        "torch._dynamo.export captures the same model on these inputs. Please report it with "
        "the model's class; meanwhile, transform without example_inputs (symbolic tracing) or "
        "compile with torch.compile's default backend under torch.autocast."
    )


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
    return bool(found)


def _operand_dtypes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Dynamo's fake kernels accept ``linear(int_tensor, float_weight)``; eager PyTorch does not.
    Say so at transform time instead of at the first call."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        family = family_of(node)
        if family is None or not family.needs_float:
            continue
        infos = [M.info(a) for a in node.args if isinstance(a, fx.Node)]
        dtypes = [i.dtype for i in infos if i.kind == "tensor" and i.dtype is not None]
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
    """Module paths and ValueInfos (see :mod:`amprewrite.meta`) from dynamo's own node meta."""
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        entries = list(stack.values())
        node.meta[M.MODULE_PATH] = M.clean_module_path(entries[-1][0]) if entries else ""
        node.meta[M.MODULE_TYPES] = tuple(e[1] for e in entries if isinstance(e[1], type))
        if node.op != "output":
            node.meta[M.ORIG] = M.info_from_value(
                node.meta.get("example_value", node.meta.get("val")))


@contextlib.contextmanager
def _quiet_loggers():
    """Silence dynamo's internal logging (shape warnings, fake-tensor tracebacks of a failing
    op); real failures still raise and are reported as one CaptureError."""
    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes",
                                              "torch._dynamo", "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _tensor_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), name)
    for name, t in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(t), name)
    return names


def _get(root: nn.Module, qualname: str) -> object:
    obj: object = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def share_copy(module: nn.Module) -> nn.Module:
    """A new module object with the same parameters and buffers (no tensor is copied).

    The copy is made from the instance dict, not with ``copy.copy``: that goes through the
    pickling protocol, which parametrized modules (``weight_norm``, ``spectral_norm``,
    ``register_parametrization``) refuse ("only supported through state_dict()"). Their
    parametrizations are submodules, so they are copied structurally like any other; the
    parametrized class (with its ``weight`` property) is kept.
    """
    new = object.__new__(type(module))
    d = new.__dict__
    d.update(module.__dict__)
    d["_parameters"] = dict(module._parameters)
    d["_buffers"] = dict(module._buffers)
    d["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    d["_modules"] = {k: None if v is None else share_copy(v) for k, v in module._modules.items()}
    return new


def set_attr(root: nn.Module, qualname: str, value: object, persistent: bool = True) -> None:
    """Install ``value`` at ``qualname`` under ``root``, creating container modules on the way."""
    *path, leaf = qualname.split(".")
    mod = root
    for part in path:
        child = getattr(mod, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        if leaf in mod._parameters:
            del mod._parameters[leaf]
        mod.register_buffer(leaf, value, persistent=persistent)
    elif isinstance(value, nn.Module):
        mod.add_module(leaf, value)
    else:
        setattr(mod, leaf, value)


def _has(root: nn.Module, qualname: str) -> bool:
    try:
        _get(root, qualname)
        return True
    except AttributeError:
        return False


def _rebuild(model: nn.Module, graph: fx.Graph, resolve, cls: type[fx.GraphModule]):
    """A GraphModule over ``graph`` holding the model's tensors under their original names."""
    root = nn.Module()
    for node in graph.nodes:
        if node.op == "call_module" and not _has(root, str(node.target)):
            set_attr(root, str(node.target), share_copy(resolve(str(node.target))))
    for node in graph.nodes:
        target = str(node.target)
        if node.op == "get_attr" and not _has(root, target):
            set_attr(root, target, _get(model, target) if _has(model, target) else resolve(target))
    gm = cls(root, graph, class_name=type(model).__name__)
    install_tensors(gm, model)
    gm.train(model.training)
    return gm


def install_tensors(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` every parameter and buffer of ``model`` under its original name (shared)."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if not _has(gm, name):
            set_attr(gm, name, p)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, b in mod._buffers.items():
            name = f"{mod_name}.{b_name}" if mod_name else b_name
            if b is not None and not _has(gm, name):
                set_attr(gm, name, b, persistent=b_name not in mod._non_persistent_buffers_set)


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
    for node in list(graph.nodes):
        if M.CAST in node.meta:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in graph.nodes:
        M.reset(node)
    cls = DynamoGraphModule if isinstance(gm, DynamoGraphModule) else fx.GraphModule
    new = _rebuild(gm, graph, lambda target: _get(gm, target), cls)
    training = getattr(gm, "_amp_captured_training", None)
    if isinstance(new, DynamoGraphModule):
        new._amp_captured_training = training
        new._amp_inputs = gm._amp_inputs
    return Capture(new, gm.meta[REPORT_KEY].capture, training)


def capture(model: nn.Module, example_inputs: object = None) -> Capture:
    """Capture ``model``: symbolic trace without example inputs, dynamo export with them."""
    if isinstance(model, fx.GraphModule) and REPORT_KEY in model.meta:
        result = _recapture(model)
    elif example_inputs is None:
        result = Capture(_symbolic(model), "symbolic_trace", None)
    else:
        args, kwargs = split_inputs(example_inputs)
        result = Capture(_dynamo(model, args, kwargs), "dynamo", model.training)
    return result
