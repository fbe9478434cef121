"""What a capture sets up and releases in process-wide state: dynamo's recompile limit,
caches, guards and finalizers, the backend table, dimension marks, custom autograd Functions,
and the pytree registrations of output dataclasses and transformers' caches (scoped to the
graphs that return them). Each is a context manager or a function the capture calls; none of
them touches the graph.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import sys
import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..graph import meta as M
from ..graph.graphmodule import (
    REGISTERED_OUTPUTS,
    _release_registrations,
)
from ..progress import quiet_loggers as quiet


@contextlib.contextmanager
def custom_functions() -> Iterator[set[type]]:
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


def release(src: fx.GraphModule) -> None:
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


def no_recompile_limit() -> contextlib.AbstractContextManager:
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
def private_top_frame() -> Iterator[None]:
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


@contextlib.contextmanager
def release_export_state() -> Iterator[None]:
    """Drop what an export leaves in process-wide tables. dynamo's backend table
    (``eval_frame.cached_backends``) gets the export's capturing compiler, a closure holding
    the export's graph, fake tensors and shape environment for the life of the process (3.5 MB
    per transform of the zoo GPT-2, with the caches below). The export's cache entries, the only
    users of the entry, live on a private code object that dies with it (private_top_frame).
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
def keep_dim_marks(inputs: object) -> Iterator[None]:
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
def no_backend_choice(dynamic_shapes: object) -> Iterator[None]:
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


def register_output_dataclasses(out: object) -> bool:
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


def register_hf_caches(model: nn.Module) -> None:
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


def foreign_spec_types(model: nn.Module) -> list[type]:
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


def quiet_capture_loggers():
    """Silence dynamo's internal logging (shape warnings, fake-tensor tracebacks of a failing
    op); real failures still raise and are reported as one CaptureError."""
    return quiet("torch.fx.experimental.symbolic_shapes", "torch._dynamo",
                 "torch._subclasses.fake_tensor", level=50)


@contextlib.contextmanager
def registrations_held() -> Iterator[None]:
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
