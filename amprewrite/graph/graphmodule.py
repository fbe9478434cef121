"""The GraphModule a dynamo capture returns, at run time: input checks, shape dispatch, the
fast call, the fixed train/eval mode.

A :class:`DynamoGraphModule` checks each call's inputs against the capture's guards
(:mod:`amprewrite.graph.shapes`). Inputs it was not captured for run on a graph transformed for
them, made once by the re-transform callback the transform gave it (``_amp_source``), then cached;
or raise :class:`~amprewrite.errors.ShapeError`. This module knows nothing of how a graph is
transformed: it imports no pass and not :mod:`amprewrite.api`.

torch dynamo is imported on first use, when a DynamoGraphModule is made (a capture has imported
it by then anyway), so ``import amprewrite`` stays cheap.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import CaptureError, ModeSwitchError, RetransformWarning, ShapeError
from . import meta as M
from .modules import hooked
from .shapes import SEQ, InputCheck, InputGuard, flat_inputs, positional_leaves, sequence_limit

__all__ = ["INPUT_CHECK", "REGISTERED_OUTPUTS", "DynamoGraphModule", "Retransform",
           "add_input_check", "sources_die_with_code"]

# (model, policy, example_inputs) -> a transformed graph for those inputs (api.transform_with).
Retransform = Callable[[object, object, object], fx.GraphModule]

class DynamoGraphModule(fx.GraphModule):
    """A GraphModule captured by dynamo, which bakes the train/eval mode, the input sizes and
    the non-tensor arguments into the graph.

    Switching it to the other mode raises instead of silently running the captured one. Each
    call checks its inputs against the capture's guards (:mod:`amprewrite.graph.shapes`); inputs the
    graph was not captured for run on a graph transformed for them (made once, then cached),
    or raise :class:`~amprewrite.errors.ShapeError`.
    """

    _amp_captured_training: bool | None = None
    _amp_inputs: InputGuard | None = None
    # (model or weakref to it, policy, retransform) to transform again for new inputs; None:
    # raise instead.
    _amp_source: tuple | None = None
    _amp_variants: tuple[fx.GraphModule, ...] = ()

    # The graph's code without pytree work and without its input check (see _FastCall).
    _amp_fast: _FastCall | None = None

    def __init__(self, *args, **kwargs):
        _dynamo_hooks()  # made by a capture, a deepcopy or an unpickling alike
        super().__init__(*args, **kwargs)
        _hold_registrations(self)

    def __deepcopy__(self, memo):
        copy = super().__deepcopy__(memo)  # fx builds it with GraphModule.__init__
        _hold_registrations(copy)
        return copy

    def __call__(self, *args, **kwargs):
        # Plain eager code (no dynamo frame callback; a builtin, so calling it starts no frame
        # dynamo could trace): the dispatcher runs as plain Python (its disable wrapper costs
        # ~5 us a call) and the common call takes the fast path. Under torch.compile every
        # Python function called from here would be traced: the disabled dispatcher, then
        # the GraphModule's ordinary call.
        if _FRAME_CALLBACK is not None and _FRAME_CALLBACK() is None:
            target = _select(self, args, kwargs)
            fast = target._amp_fast
            if fast is not None and not kwargs and len(args) == fast.n and not hooked(target):
                return fast(target, args)
        else:
            target = _SELECT_TRACED(self, args, kwargs)
        if target is self:
            return super().__call__(*args, **kwargs)
        return target(*args, **kwargs)

    def recompile(self):
        with sources_die_with_code():
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
                f"amprewrite.transform again on model.{want}() to get "
                f"{'an' if want == 'eval' else 'a'} {want}-mode graph, or "
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
    :func:`~amprewrite.graph.shapes.flat_inputs`.)
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
    model, policy, retransform = gm._amp_source
    outside = guard.out_of_range(flat)
    if outside is not None and isinstance(getattr(policy, "dynamic_shapes", None),
                                          (dict, tuple, list)):
        raise ShapeError(
            f"{type(gm).__name__} was called with inputs outside the sizes it was transformed "
            f"for: {outside}, from transform(dynamic_shapes=...). A graph exported from it "
            "serves those sizes only. Transform with a wider torch.export.Dim range (min=, "
            "max=) to call it with these inputs."
        )
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
    variant = _transform_for(gm, model, policy, retransform, args, kwargs, flat, why)
    gm._amp_variants = (*gm._amp_variants, variant)
    return variant



def _transform_for(gm, model, policy, retransform: Retransform, args, kwargs, flat,
                   why) -> fx.GraphModule:
    """Transform ``model`` again for new inputs; dimensions that changed become dynamic, so one
    new graph serves every size of them (torch.compile's automatic dynamic shapes)."""
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
            variant = retransform(model, policy, example)
        except CaptureError as exc:
            if "Constraints violated" not in str(exc):
                raise
            # The model fixes those sizes (an unrolled per-sample loop fixes the batch): a
            # graph for exactly these inputs.
            example = pytree.tree_map(lambda v: v.clone() if id(v) in marked_ids else v,
                                      example)
            variant = retransform(model, policy, example)
    except CaptureError as exc:
        raise ShapeError(
            f"{type(gm).__name__} was called with inputs it was not captured for: {why}. "
            f"Transforming the model again for them failed: {exc}"
        ) from None
    seconds = time.perf_counter() - start
    _log.info("amprewrite: transformed %s again for new inputs (%s) in %.1f s",
              type(model).__name__, why, seconds)
    if not gm._amp_variants:  # the first new shape: said once per graph
        warnings.warn(_retransformed(gm, variant, model, why, seconds, dynamic, flat),
                      RetransformWarning,
                      stacklevel=_caller_level())
    return variant


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside amprewrite and torch (the call of the
    graph: fx's and nn.Module's call wrappers and the dispatcher lie between)."""
    # with the separator: torchvision's or torchao's files are not torch's
    inside = tuple(os.path.dirname(path) + os.sep
                   for path in (os.path.dirname(__file__), torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _retransformed(gm: DynamoGraphModule, variant: fx.GraphModule, model: object, why: str,
                   seconds: float, dynamic: dict[int, list[int]], flat: list[object]) -> str:
    """What :class:`~amprewrite.errors.RetransformWarning` says: what happened, what it
    cost, and what makes one transform serve these inputs (``dynamic_shapes=``, bounded by
    the model's longest sequence, where a dimension changed; else what to change)."""
    inputs = gm._amp_inputs.inputs
    grown = {i: [d for d in dims if inputs[i].sizes[d] is not None]
             for i, dims in dynamic.items()}  # static in this graph, another size now
    grown = {i: dims for i, dims in grown.items() if dims}
    tiny = [(inputs[i].name, d, inputs[i].sizes[d]) for i, dims in grown.items() for d in dims
            if inputs[i].sizes[d] < 2]
    guard = getattr(variant, "_amp_inputs", None)
    fixed = guard is not None and grown and not any(
        guard.inputs[i].sizes is not None and guard.inputs[i].sizes[d] is None
        for i, dims in grown.items() for d in dims if len(guard.inputs[i].sizes or ()) > d)
    if fixed and not tiny:
        avoid = ("the model fixes those sizes (dynamo could not keep them dynamic: a "
                 "per-sample loop, a size the code checks), so each new size is transformed "
                 "again: give example_inputs of the shapes you call it with")
    elif not grown:
        avoid = _no_dynamic_helps(gm._amp_inputs, flat)
    elif tiny:
        name, d, size = tiny[0]
        avoid = (f"capture with example inputs of size 2 or more in dimension {d} of {name!r} "
                 f"(it was captured at size {size}, which dynamo fixes; dynamic_shapes='batch', "
                 "the default, then keeps the batch dynamic)")
    else:
        avoid = "pass those dimensions as dynamic, " + _dynamic_advice(model, inputs, dynamic)
    return (
        f"amprewrite: {type(model).__name__}'s graph was called with inputs it was not "
        f"transformed for ({why}), so the model was captured and transformed again for them, "
        f"which took {seconds:.1f} s. The new graph is kept for such inputs; another new shape "
        "(other dimensions, other non-tensor arguments) is transformed again too, up to "
        f"{_MAX_VARIANTS} times, then ShapeError. To transform once, {avoid}; "
        "on_new_shape='error' raises ShapeError instead of transforming. (Said once per graph: "
        "amprewrite.errors.RetransformWarning.)")


def _no_dynamic_helps(guard: InputGuard, flat: list[object]) -> str:
    """What avoids a re-transform where no static size grew: a size 0 or 1 (which dynamo
    fixes), a dynamic size past its range, else a changed non-tensor argument."""
    for inp, value in zip(guard.inputs, flat):
        if inp.sizes is None or not isinstance(value, torch.Tensor) or (
                value.dim() != len(inp.sizes)):
            continue
        for d, (want, size) in enumerate(zip(inp.sizes, value.shape)):
            if size < 2 and want != size:
                return (f"call it with sizes of 2 or more in dimension {d} of {inp.name!r}: "
                        "dynamo fixes a size of 0 or 1, in a graph of its own, which no "
                        "dynamic_shapes= covers")
    if guard.out_of_range(flat) is not None:
        return ("keep that size within the range the graph was captured for (a bound the "
                "model's code sets, as the report's shapes: note says, or dynamic_shapes= "
                "gave): a size past it takes a graph of its own")
    return ("a non-tensor argument changed, and dynamo bakes those into the graph: pass "
            "that value as a tensor, or call the graph with the value it was transformed with")


def _dynamic_advice(model: object, inputs: list, dynamic: dict[int, list[int]]) -> str:
    """``amprewrite.transform(..., dynamic_shapes={...})`` for these dimensions, the sequence
    (dimension 1) bounded by the model's longest (:func:`~amprewrite.graph.shapes.sequence_limit`),
    or a general pointer where an input has no name to key it by."""
    limit, source = sequence_limit(model) if isinstance(model, torch.nn.Module) else (None, None)
    spec = {}
    for i, dims in sorted(dynamic.items()):
        if not inputs[i].name.isidentifier():  # a leaf of a nested input
            return "amprewrite.transform(..., dynamic_shapes=...) (docs/guide.md, \"Input shapes\")"
        spec[inputs[i].name] = ", ".join(
            f"{d}: Dim.AUTO(max={limit})" if d == SEQ and limit else f"{d}: Dim.AUTO"
            for d in dims)
    shown = ", ".join(f"{name!r}: {{{dims}}}" for name, dims in spec.items())
    bound = f"; the bound is the model's {source}" if limit and any(
        SEQ in dims for dims in dynamic.values()) else ""
    return (f"amprewrite.transform(..., dynamic_shapes={{{shown}}}) (from torch.export "
            f"import Dim{bound}), or give example_inputs of the shapes you call it with")


_MAX_VARIANTS = 8
_log = logging.getLogger("amprewrite")


# Dynamo never traces the dispatcher: under torch.compile it runs eagerly (and may transform
# for new inputs), and dynamo traces the chosen graph's forward, whose first node checks the
# inputs, as it does for nn.Module.__call__ and forward. (Traced, its one code object shared by
# every transformed graph would also exhaust dynamo's recompile limit.)
_SELECT_TRACED = _select  # replaced by torch._dynamo.disable(_select) in _dynamo_hooks
_HOOKED = False

# None when dynamo traces no frame (plain eager code); absent in some torch versions.
_FRAME_CALLBACK = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)


def _dynamo_hooks() -> None:
    """Tell dynamo to skip the dispatcher (and everything it calls: guards, a re-transform)."""
    global _SELECT_TRACED, _HOOKED
    if _HOOKED:
        return
    import torch._dynamo

    torch._dynamo.eval_frame.skip_code(DynamoGraphModule.__call__.__code__)
    _SELECT_TRACED = torch._dynamo.disable(_select)
    _HOOKED = True


def add_input_check(gm: DynamoGraphModule) -> None:
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


_SOURCES_DEPTH = 0


@contextlib.contextmanager
def sources_die_with_code() -> Iterator[None]:
    """Inside the block, the source of each function fx generates is forgotten when the
    function dies.

    fx keeps the source of every ``forward`` it generates (every ``recompile``, every
    capture) in a process-wide table (``fx.graph_module._loader.eval_cache``, read through
    ``linecache`` for tracebacks) and never drops it: 10 sources, 150 kB, per transform of
    the zoo GPT-2, though all but two belong to replaced or freed graphs. A live function
    keeps its source, so tracebacks and ``inspect.getsource`` still show it.
    """
    global _SOURCES_DEPTH
    from torch.fx import graph_module

    if _SOURCES_DEPTH:  # nested: the outer block's wrapper is in place
        yield
        return
    original = graph_module._method_from_src

    def method_from_src(*args, **kwargs):
        fn = original(*args, **kwargs)
        key = fn.__code__.co_filename
        if key.startswith("<eval_with_key>"):  # a key of fx's own, never a real file's name
            weakref.finalize(fn, _forget_source, key).atexit = False
        return fn

    graph_module._method_from_src = method_from_src
    _SOURCES_DEPTH += 1
    try:
        yield
    finally:
        _SOURCES_DEPTH -= 1
        graph_module._method_from_src = original


def _forget_source(key: str) -> None:
    from torch.fx import graph_module

    graph_module._loader.eval_cache.pop(key, None)
    linecache.cache.pop(key, None)


# Output dataclasses amprewrite registered with pytree -> how many live graphs return them. The
# registration is scoped to those graphs: it goes when the last one does (each graph holds its
# own in DynamoGraphModule.__init__, so copies do too).
REGISTERED_OUTPUTS: dict[type, int] = {}


def _hold_registrations(gm: fx.GraphModule) -> None:
    """Keep the pytree registrations ``gm``'s outputs need while ``gm`` lives."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(info, "out_spec", None)
    types: set[type] = set()
    todo = [spec] if spec is not None else []
    while todo:
        node = todo.pop()
        types.add(node.type)
        todo += [node.child(i) for i in range(node.num_children)]
    held = tuple(t for t in types if t in REGISTERED_OUTPUTS)
    for t in held:
        REGISTERED_OUTPUTS[t] += 1
    if held:
        weakref.finalize(gm, _release_registrations, held)


def _release_registrations(types: tuple[type, ...]) -> None:
    deregister = getattr(pytree, "_deregister_pytree_node", None)
    for t in types:
        REGISTERED_OUTPUTS[t] -= 1
        if REGISTERED_OUTPUTS[t] <= 0:
            del REGISTERED_OUTPUTS[t]
            if deregister is not None:
                deregister(t)
