"""The ``torch.compile`` backend ``"amprewrite"``: the same passes on dynamo's graph.

::

    compiled = torch.compile(model, backend="amprewrite")
    compiled = torch.compile(model, backend="amprewrite", options={"dtype": "fp16"})
    compiled = torch.compile(model, backend=amprewrite.backend(dtype=torch.float16, inner="eager"))

The backend is found without importing amprewrite (the ``torch_dynamo_backends`` entry point)
and is also registered on ``import amprewrite`` (``amprewrite/__init__.py``, without importing
torch or this module). Dynamo hands it a graph whose parameters are graph inputs:
they are cast in the graph, never copied, so the optimizer keeps training the fp32 weights.
Precision lives in the graph, not in autocast's thread-local state, so the compiled model
behaves the same in any thread (``nn.DataParallel``) or process (DDP).
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import fx, nn

from ..api import transform_graph
from ..capture.trace import annotate_dynamo_graph
from ..errors import PolicyError
from ..graph import meta as M
from ..graph.modules import get_attr
from ..graph.runtime import no_enclosing_autocast
from ..precision.policy import Policy, check_selectors
from ..precision.ranges import declared_fp32, narrower_than_fp32
from .block_plans import GraphPlan, across_ranks, communicates, spmd_call, this_rank
from .sharding import gathered_dtype

__all__ = ["amprewrite_backend", "backend"]

_POLICY_FIELDS = {f.name for f in dataclasses.fields(Policy)}
# Policy fields the backend takes only at their defaults (it is handed dynamo's graph and
# parameters as graph inputs): not offered as valid options.
_TRANSFORM_ONLY = {"capture"}
Inner = str | Callable[..., Callable]


def _policy(options: Mapping[str, object]) -> tuple[Policy, Inner]:
    opts = dict(options)
    inner = opts.pop("inner", "inductor")
    unknown = sorted(set(opts) - _POLICY_FIELDS)
    if unknown:
        valid = sorted((_POLICY_FIELDS - _TRANSFORM_ONLY) | {"inner"})
        close = {u: difflib.get_close_matches(u, valid, n=1) for u in unknown}
        hint = "; ".join(f"{u!r}: did you mean {m[0]!r}?" for u, m in close.items() if m)
        raise PolicyError(
            f"unknown amprewrite backend option(s) {unknown}"
            f"{f' ({hint})' if hint else ''}; valid: {valid} (capture is an option of "
            "amprewrite.transform only)."
        )
    if opts.get("capture", "dynamo") != "dynamo":
        raise PolicyError(
            "the torch.compile backend is handed the graph dynamo captured, so capture= has no "
            "meaning here; capture='export' is an option of amprewrite.transform(model, "
            "example_inputs=..., capture='export').")
    for key in ("keep_fp32", "allow_low"):
        if isinstance(opts.get(key), (list, set)):
            opts[key] = tuple(opts[key])
    return Policy(**opts), inner


def _inner_backend(inner: Inner) -> Callable:
    if callable(inner):
        return inner
    if isinstance(inner, str):
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(inner)
    raise PolicyError(f"inner must be a backend name ('inductor', 'aot_eager', 'eager') or a "
                      f"callable, got {inner!r}.")


def _compiled_module() -> nn.Module | None:
    """The module whose ``forward`` dynamo is compiling (its frame's first argument), if any."""
    try:  # dynamo internals: without them the graph's own module paths are used
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code, values = tx.f_code, tx.f_locals
    except Exception:
        return None
    first = values.get(code.co_varnames[0]) if code.co_argcount else None
    if isinstance(first, nn.Module):  # forward(self, ...)
        return first
    # torch.compile(module) compiles a wrapper whose closure holds the module (``fn``).
    found = {id(v): v for v in values.values() if isinstance(v, nn.Module)}
    return next(iter(found.values())) if len(found) == 1 else None


def _check_options(gm: fx.GraphModule, policy: Policy) -> None:
    """Check ``keep_fp32``/``allow_low`` as :func:`amprewrite.transform` does: against the
    compiled module's ``named_modules()`` (and the module paths dynamo recorded in the graph)."""
    paths = {""}
    for node in gm.graph.nodes:
        path = node.meta.get(M.MODULE_PATH, "")
        while path:  # a module and its ancestors
            paths.add(path)
            path = path.rpartition(".")[0]
    root = _compiled_module()
    if root is not None:
        paths.update(name for name, _ in root.named_modules())
    check_selectors(policy, sorted(paths),
                    type(root).__name__ if root is not None else "the compiled function")


def _compile(gm: fx.GraphModule, example_inputs: list, policy: Policy, inner: Inner,
             dtype_given: bool):
    # A compile inside an enclosing autocast (a trainer's) records ranges, checks float8 and
    # traces the inner backend in fp32's state: the graph's own guard keeps autocast off when
    # it runs, and an inner compiler tracing it must not bake autocast's casts in either.
    with no_enclosing_autocast():
        return _compile_planned(gm, example_inputs, policy, inner, dtype_given)


def _compile_planned(gm: fx.GraphModule, example_inputs: list, policy: Policy, inner: Inner,
                     dtype_given: bool):
    annotate_dynamo_graph(gm.graph)
    _check_options(gm, policy)
    root = _compiled_module()  # None outside a dynamo frame, or for a plain function
    sharded = gathered_dtype(root) if root is not None else None
    if not dtype_given and sharded is not None:
        # amprewrite.fully_shard(dtype=...) (or its mp_policy's param_dtype, torchtitan's
        # mixed_precision_param) said the dtype: once is enough.
        policy, dtype_given = dataclasses.replace(policy, dtype=sharded), True
    if policy.params == "low":
        _store_low_in_place(root, policy)
        policy = dataclasses.replace(policy, params="fp32")  # the graph has nothing to store
    policy = _agree_with_parameters(example_inputs, policy, dtype_given)
    if policy.device is None:
        devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
        policy = dataclasses.replace(policy, device=devices[0] if devices else None)
    declared = _declared(gm, example_inputs, root, policy.dtype) if root is not None else None
    # The example inputs are the call's real tensors: their ranges (and float8's checks) are
    # the values' facts. Under dynamic shapes dynamo passes each symbolic size as a SymInt next
    # to the real tensors: its hint is this call's size, so the graph runs on this call.
    values = tuple(_hint(v) for v in example_inputs)
    # Real values to record ranges on: no fake tensor and no symbolic size among them (other
    # objects, such as a DeviceMesh under tensor parallel, are passed through as they are).
    concrete = not any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and _fake(v))
                       for v in values)
    compile_inner = _inner_backend(inner)
    # Values are widened across ranks only on calls every rank makes: a rank-0 evaluation must
    # not wait at a collective for ranks that are not compiling (spmd_call). A graph that holds
    # collectives (tensor parallel) runs on every rank in any mode, and its ranks must send
    # each collective in one dtype: it always agrees (communicates).
    reduce = (across_ranks if spmd_call(root) or communicates(gm, example_inputs)
              else this_rank)

    def plan(graph: fx.GraphModule, inputs: tuple, prior: dict | None,
             fp8_prior: dict | None) -> fx.GraphModule:
        return transform_graph(graph, policy, example_inputs=inputs if concrete else None,
                               declared=declared, prior=prior, reduce=reduce,
                               fp8_prior=fp8_prior)

    # Values decide the plan in fp16 (ranges) and with fp8 (each linear's float8 error): there
    # the plan is checked on every block that reuses the graph, and after an overflow. A saved
    # plan (options={"plan": ...}) decides instead: nothing to check, every block runs it.
    watch = concrete and policy.plan is None and (
        narrower_than_fp32(policy.dtype) or policy.fp8 is not None)
    return GraphPlan(gm, example_inputs, values, policy.dtype, plan, compile_inner, watch,
                     fp8=watch and policy.fp8 is not None, reduce=reduce)


def _store_low_in_place(root: nn.Module | None, policy: Policy) -> None:
    """``options={"params": "low"}``: dynamo passes the parameters as graph inputs, so the
    backend cannot store them in the graph. At the first compile it stores the compiled
    module's weights that low ops read low in the module itself (``store_low``: linear,
    convolution, embedding weights; never ``keep_fp32``'s modules) before the inner compiler
    traces the graph with them: the plan's casts of those weights to the low dtype are then
    casts to the dtype they have (no-ops; inductor removes them), and the weights, their
    gradients and the optimizer's states are low. Dynamo guards a module's parameters by
    identity, not dtype, so the graph is not compiled again. Train it with
    :func:`amprewrite.optimizer`, made before or after the first call."""
    if root is None:
        raise PolicyError(
            "amprewrite backend: params='low' stores the compiled module's weights low in "
            "place, and this graph comes from no module (a function compiled with "
            "torch.compile): compile the nn.Module (torch.compile(model, ...) or "
            "model.compile(...)), or leave params at 'fp32'.")
    from .low_params import store_low

    store_low(root, policy.dtype, policy.keep_fp32)


def _agree_with_parameters(example_inputs: list, policy: Policy, dtype_given: bool) -> Policy:
    """The policy, its dtype agreeing with the parameters' where they arrive in one low dtype
    (FSDP2 gathering them in its ``param_dtype``, a model cast with ``.half()``): a backend
    left at its default dtype follows them, and says so; one given another dtype keeps it and
    warns that every weight is converted in the graph (a matmul in neither dtype's intent)."""
    low = {v.dtype for v in example_inputs
           if isinstance(v, nn.Parameter) and v.dtype in (torch.float16, torch.bfloat16)}
    if len(low) != 1 or low == {policy.dtype}:
        return policy
    (theirs,) = low
    ours, shown = policy.dtype, str(theirs).replace("torch.", "")
    where = ("the compiled module's parameters arrive in " + shown + " (FSDP2 gathers them in "
             "its param_dtype, or the model was cast)")
    if not dtype_given:
        warnings.warn(
            f"amprewrite backend: {where}, and the backend was given no dtype (default "
            f"{str(ours).replace('torch.', '')}): it plans {shown}, as they are. Pass "
            f"options={{'dtype': torch.{shown}}} (or amprewrite.backend(dtype=torch.{shown})) "
            "to say so and silence this.", stacklevel=2)
        return dataclasses.replace(policy, dtype=theirs)
    warnings.warn(
        f"amprewrite backend: {where}, but the backend plans "
        f"{str(ours).replace('torch.', '')} (its dtype option): each weight is converted to "
        f"it in the graph and no matmul runs in {shown}. Give fully_shard (or the model) and "
        "the backend the same dtype, or leave the backend's dtype out.", stacklevel=2)
    return policy


def _hint(v: object) -> object:
    """A SymInt's size on this call (its hint), else ``v``."""
    if isinstance(v, torch.SymInt):
        hint = getattr(v.node, "hint", None)
        return v if hint is None else int(hint)
    return v


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.is_meta


def _declared(gm: fx.GraphModule, example_inputs: list, root: nn.Module, low: torch.dtype
              ) -> dict[str, tuple[str, str]]:
    """The graph's names (placeholder or get_attr targets) of the parameters ``root`` declares
    fp32, found by identity: dynamo passes parameters as inputs, or reads them as attributes."""
    names = declared_fp32(root, low)
    if not names:
        return {}
    tensors = {**dict(root.named_parameters(remove_duplicate=False)),
               **dict(root.named_buffers(remove_duplicate=False))}
    by_id = {id(tensors[name]): (attr, name) for name, attr in names.items()}
    out: dict[str, tuple[str, str]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if id(value) in by_id:
            out[str(node.target)] = by_id[id(value)]
    for node in gm.graph.find_nodes(op="get_attr"):
        value = get_attr(gm, str(node.target), None)
        if id(value) in by_id:
            out[str(node.target)] = by_id[id(value)]
    return out


def amprewrite_backend(gm: fx.GraphModule, example_inputs: list, options: Mapping | None = None,
                       mode: str | None = None):
    """The registered backend: ``torch.compile(m, backend="amprewrite", options={...})``.

    ``options`` takes the keywords of :func:`amprewrite.transform` (``dtype``, ``keep_fp32``,
    ``allow_low``, ``keep_io_dtype``, ``upsample``, ``device``, ``plan``, ``strict``) and
    ``inner``, the backend that compiles the rewritten graph (default ``"inductor"``). With
    ``plan`` (a file from :func:`amprewrite.save_plan` of a model compiled the same way) each
    graph takes the saved decisions of the graph it matches, and is not re-planned for other
    blocks or after an overflow (docs/guide.md, "Plans").
    """
    del mode  # torch.compile passes mode= to every backend; it is inductor's concern
    policy, inner = _policy(options or {})
    return _compile(gm, example_inputs, policy, inner, "dtype" in (options or {}))


def backend(inner: Inner = "inductor", **policy: object) -> Callable:
    """A backend callable for ``torch.compile(model, backend=...)`` with any inner backend;
    the same settings give the same callable, so blocks compiled one by one share their graph.

    >>> import torch, amprewrite
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> compiled = torch.compile(model, backend=amprewrite.backend(dtype="fp16", inner="eager"))
    >>> compiled(torch.randn(2, 4)).dtype
    torch.float32
    """
    settings, inner = _policy({**policy, "inner": inner})
    try:
        fp8 = settings.fp8  # a dict of float8 options: compared as its items
        fp8 = tuple(sorted(fp8.items())) if isinstance(fp8, Mapping) else fp8
        # Calibration batches are data a Policy does not compare: never shared.
        key = None if settings.calibration else (
            dataclasses.replace(settings, fp8=None), fp8, inner, "dtype" in policy)
        made = _BACKENDS.get(key) if key is not None else None
    except (TypeError, RuntimeError):  # an option that cannot be hashed or compared
        made, key = None, None
    if made is not None:
        return made

    def compile_with_amprewrite(gm: fx.GraphModule, example_inputs: list):
        return _compile(gm, example_inputs, settings, inner, "dtype" in policy)

    if key is not None:
        _BACKENDS[key] = compile_with_amprewrite
    return compile_with_amprewrite


# backend()'s callables by their settings. Dynamo keeps a compiled graph for the backend
# callable it was made with, and compiles again for another: a loop that compiled each block
# with its own amprewrite.backend(...) compiled a graph per block (one plan each, where the
# blocks of one class share one) and, past torch._dynamo.config.recompile_limit, left the
# other blocks uncompiled. The same settings now give the same callable.
_BACKENDS: dict[tuple[Policy, object, object, bool], Callable] = {}
