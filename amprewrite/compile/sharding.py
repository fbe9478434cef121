"""sharding: FSDP2's ``fully_shard`` by the precision plan.

FSDP2 all-gathers every parameter before a module's forward (and again in backward) and
reduce-scatters every gradient after it. With the plan's parameters kept fp32 and cast in the
graph, those collectives move fp32: twice the bytes of torchtitan's recipe
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). :func:`fully_shard` gathers in
the low dtype what the plan reads low and reduces every gradient in fp32 into fp32 shards.

FSDP2 holds one gather dtype per group (one ``fully_shard`` call), and its hooks run outside
compiled code (they are ``torch._dynamo.disable``\\ d: a group nested inside a compiled block
breaks its graph, and a checkpointed block then runs eagerly; tried on torch 2.13). So:

- **a compiled module** (``torch.compile(block, backend="amprewrite")`` or ``block.compile``) is
  one group, gathered low: the graph reads the low parameters as they come and upcasts those an
  FP32 op reads (norm scales). Those are rounded to the low dtype once per step, and their
  gradients before the fp32 reduction: the trade docs/guide.md states, measured in
  docs/benchmarks.md ("Sharding"). A parameter ``keep_fp32`` names or the model declares fp32
  (``_keep_in_fp32_modules``) makes the whole group fp32, with a warning.
- **float8** (``fp8=``, tensorwise): a compiled block's Linear weights the plan runs in
  float8 are gathered in e4m3 with one scale per weight and dequantized to the low dtype the
  graph reads (:class:`Float8Gathered`; docs/guide.md, "Distributed training").
- **a module that runs eagerly** (the root: embeddings, final norm, head) has no graph to cast:
  each Linear/Conv (LOW) and Embedding becomes its own group gathered low, FSDP casting its
  floating inputs low and its output back to fp32 (``cast_forward_inputs``, ``output_dtype``):
  the casts the plan puts around a LOW op, and the embedding rows cast up after the lookup as
  ``params="low"`` does. Everything else stays fp32 in the module's own group.

>>> from torch import nn
>>> net = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16))
>>> for p in sharding_plan(net, dtype="bf16").params.values():
...     print(p.name, str(p.dtype).replace("torch.", ""), repr(p.group))
0.weight bfloat16 '0'
1.weight float32 ''
1.bias float32 ''
2.weight bfloat16 '2'
2.bias bfloat16 '2'
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..precision.ops import Precision, family_for_module
from ..precision.policy import Policy, Selector
from ..precision.ranges import declared_fp32
from .low_params import check_params

__all__ = ["CommBytes", "Float8Gathered", "ParamShard", "ShardingPlan", "count_collectives",
           "count_comm", "dequantized", "float8_gathers", "fully_shard", "gathered_dtype",
           "sharding_plan"]

# Wrappers whose attribute name is not part of the model's own module paths.
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is sharded: the dtype FSDP gathers it in, the module whose
    ``fully_shard`` group holds it (``""``: the module passed in), and why."""

    name: str
    dtype: torch.dtype
    group: str
    reason: str
    float8: bool = False  # gathered in float8 once the plan runs its linear in float8


@dataclass
class ShardingPlan:
    """The plan of one :func:`fully_shard` call. Gradients always reduce in fp32."""

    dtype: torch.dtype
    compiled: bool
    params: dict[str, ParamShard] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    leaf: bool = False  # the module itself is an eager LOW leaf (a Linear sharded on its own)

    def float8(self) -> list[str]:
        """The parameters gathered in float8 once the plan runs their linear in float8."""
        return [p.name for p in self.params.values() if p.float8]

    def groups(self) -> dict[str, torch.dtype]:
        """Group (module path, ``""`` for the module itself) -> the dtype it gathers in."""
        return {p.group: p.dtype for p in self.params.values()}

    def __str__(self) -> str:
        return "\n".join(f"{p.name}: {str(p.dtype).replace('torch.', '')}"
                         f"{' (float8 where the plan runs it in float8)' if p.float8 else ''} "
                         f"(group {p.group or '<module>'}): {p.reason}"
                         for p in self.params.values())


def _clean(path: str) -> str:
    for w in _WRAPPERS:
        path = path.replace(w, "")
    return path


def _is_compiled(module: nn.Module) -> bool:
    return (isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            or getattr(module, "_compiled_call_impl", None) is not None)


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _managed(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(path, submodule) of the modules whose own parameters this call shards: not inside a
    group sharded before (FSDP2's rule)."""
    def walk(path: str, m: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        yield path, m
        for name, child in m.named_children():
            if not _is_sharded(child):
                yield from walk(f"{path}.{name}" if path else name, child)
    yield from walk("", module)


def _kept(selectors: Sequence[Selector], path: str, m: nn.Module) -> bool:
    fam = family_for_module(type(m))
    for s in selectors:
        if isinstance(s, type):
            if isinstance(m, s):
                return True
        elif path == s or path.startswith(s + ".") or (fam is not None and fam.name == s):
            return True
    return False


def _declared(module: nn.Module, low: torch.dtype) -> dict[str, str]:
    """Parameter names (relative to ``module``) that ``module`` or a submodule declares fp32."""
    out: dict[str, str] = {}
    for path, sub in module.named_modules():
        for name, attr in declared_fp32(sub, low).items():
            out.setdefault(f"{path}.{name}" if path else name, attr)
    return out


def _float8_candidate(m: nn.Module, n: str, p: torch.Tensor) -> str | None:
    """Why the weight ``n`` of ``m`` cannot be gathered in float8, or None when it can (once
    the plan runs its linear in float8): a 2-D Linear weight, K and N divisible by 16."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(m, nn.Linear) and n == "weight" and p.dim() == 2):
        return "not a Linear's weight"
    if isinstance(p, DTensor):
        return "a tensor-parallel weight (float8 gathers of DTensor weights are not built)"
    if p.shape[0] % 16 or p.shape[1] % 16:
        return "float8 GEMMs need K and N divisible by 16"
    return None


def sharding_plan(module: nn.Module, dtype: torch.dtype | str = torch.bfloat16,
                  keep_fp32: Iterable[Selector] = (),
                  ignored_params: set[nn.Parameter] | None = None,
                  fp8: object = None, compiled: bool | None = None) -> ShardingPlan:
    """What :func:`fully_shard` does with ``module``'s parameters, without sharding anything.
    See the module docstring. ``compiled``: whether ``module`` runs in an amprewrite graph
    (None: what ``module`` says, a ``torch.compile`` wrapper or ``module.compile``; see
    :func:`fully_shard`).

    Groups sharded already are listed as they were sharded: a submodule sharded by an earlier
    :func:`fully_shard` call with that call's plan (its groups named by their path from
    ``module``), and ``module`` itself, once sharded, with its own call's plan; the other
    arguments describe only what is not sharded yet."""
    plan = _recorded(module)
    if plan is None:
        plan = _plan(module, dtype, keep_fp32, ignored_params, fp8, compiled)
    plan = dataclasses.replace(plan, params=dict(plan.params), notes=list(plan.notes))
    for path, child in _sharded_inside(module):
        recorded = sharding_plan(child) if _recorded(child) is not None else None
        for p in (recorded.params.values() if recorded is not None else ()):
            name = f"{path}.{p.name}"
            group = f"{path}.{p.group}" if p.group else path
            plan.params[name] = dataclasses.replace(p, name=name, group=group)
        if recorded is None:  # torch's own fully_shard: its group, in its policy's dtype
            for n, p in child.named_parameters():
                name = f"{path}.{_clean(n)}"
                plan.params[name] = ParamShard(name, p.dtype, path,
                                               "sharded by torch's fully_shard, not "
                                               "amprewrite's: gathered in its mp_policy's "
                                               "param_dtype")
    return plan


# The attribute where fully_shard keeps the plan of the call that sharded a module.
_RECORDED = "_amp_sharding_plan"


def gathered_dtype(module: nn.Module) -> torch.dtype | None:
    """The low dtype :func:`fully_shard` gathers ``module`` in (its ``dtype``, or its
    ``mp_policy``'s ``param_dtype``), or None where it did not shard ``module``. The backend
    plans in it when it is given no ``dtype`` of its own, so the dtype is said once.

    >>> gathered_dtype(nn.Linear(2, 2)) is None
    True
    """
    plan = _recorded(module)
    return plan.dtype if plan is not None else None


def _recorded(module: nn.Module) -> ShardingPlan | None:
    """The plan of the fully_shard call that sharded ``module`` (None: no such call)."""
    return module.__dict__.get(_RECORDED)


def _sharded_inside(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(path, submodule) of the outermost submodules sharded by an earlier call, each as its
    call saw it: an eager leaf group that call made is listed by that call's plan."""
    def walk(path: str, m: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        for name, child in m.named_children():
            at = f"{path}.{name}" if path else name
            if _is_sharded(child) and (_recorded(child) is not None
                                       or not _made_by(module, at)):
                yield _clean(at), child
            else:
                yield from walk(at, child)
    yield from walk("", module)


def _made_by(module: nn.Module, path: str) -> bool:
    """Whether the group at ``path`` is a leaf group of ``module``'s own recorded call."""
    recorded = _recorded(module)
    return recorded is not None and any(p.group == path for p in recorded.params.values())


def _plan(module: nn.Module, dtype: torch.dtype | str, keep_fp32: Iterable[Selector],
          ignored_params: set[nn.Parameter] | None, fp8: object,
          compiled: bool | None) -> ShardingPlan:
    """The plan of one fully_shard call on ``module``: its parameters not sharded before."""
    policy = Policy(dtype=dtype, keep_fp32=tuple(keep_fp32), fp8=fp8)
    low, ignored = policy.dtype, ignored_params or set()
    float8 = policy.fp8 is not None and policy.fp8.recipe == "tensorwise"
    compiled = _is_compiled(module) if compiled is None else compiled
    declared = _declared(module, low)
    plan = ShardingPlan(dtype=low, compiled=compiled)
    pinned: list[str] = []
    for path, m in _managed(module):
        clean = _clean(path)
        fam = family_for_module(type(m))
        own = [(n, p) for n, p in m.named_parameters(recurse=False) if p not in ignored]
        if not own:
            continue
        names = {n: f"{clean}.{n}" if clean else n for n, _ in own}
        attrs = sorted({declared[k] for k in names.values() if k in declared})
        why_fp32 = ("keep_fp32 names it" if _kept(policy.keep_fp32, clean, m) else
                    f"declared fp32 by {attrs[0]}" if attrs else
                    "not a floating parameter" if not all(p.is_floating_point() for _, p in own)
                    else None)
        leaf = fam is not None and (fam.precision == Precision.LOW or fam.name == "embedding")
        for n, p in own:
            name = names[n]
            if why_fp32:
                plan.params[name] = ParamShard(name, p.dtype, "", why_fp32)
                pinned.append(name)
            elif compiled:
                what = (f"read by {fam.name} ({fam.precision.value})" if fam is not None
                        else f"read by {type(m).__name__}'s ops")
                how = "" if leaf else ", which upcasts it where an FP32 op reads it"
                why_not = _float8_candidate(m, n, p) if float8 else None
                if float8 and why_not is None:
                    how += ("; in float8 (tensorwise) from the first forward after the plan "
                            "runs its linear in float8")
                plan.params[name] = ParamShard(name, low, "",
                                               f"{what} in the compiled graph{how}",
                                               float8 and why_not is None)
            elif leaf:
                plan.leaf = plan.leaf or path == ""
                how = ("rows cast up to fp32 after the lookup (output_dtype)"
                       if fam.name == "embedding" else
                       "inputs cast low, output cast up to fp32 by FSDP (cast_forward_inputs, "
                       "output_dtype)")
                plan.params[name] = ParamShard(name, low, path,
                                               f"read by {fam.name} ({fam.precision.value}), "
                                               f"its own group: {how}")
            else:
                what = fam.name if fam is not None else type(m).__name__
                plan.params[name] = ParamShard(name, torch.float32, "",
                                               f"read by {what} in eager code: fp32")
    if policy.fp8 is not None and not float8:
        plan.notes.append(f"fp8 recipe {policy.fp8.recipe!r}: weights gathered in "
                          f"{str(low).replace('torch.', '')} (float8 gathers are tensorwise "
                          "only, as torchao's)")
    if compiled and pinned:  # one group, one dtype: the pinned parameters decide
        plan.params = {k: ParamShard(k, torch.float32, "", p.reason if k in pinned else
                                     f"fp32: the compiled module is one group and "
                                     f"{', '.join(pinned)} must stay fp32")
                       for k, p in plan.params.items()}
    return plan


class _GatherState:
    """What one weight's shards gather in: the low dtype until the plan serving its block runs
    its linear in float8, float8 from the next forward on. Shared by the shard and the copies
    FSDP2 makes of it (padding)."""

    def __init__(self, name: str, scales: _Scales):
        self.name, self.scales = name, scales  # scales: shared by the weights of one group
        self.fsdp_param: Any = None  # torch's FSDPParam for this weight, set by fully_shard
        self.float8 = False
        self.version = -1

    def shard(self) -> torch.Tensor:
        """This rank's fp32 shard of the weight, as the optimizer last left it."""
        return self.fsdp_param._sharded_local_tensor._tensor

    def update(self) -> None:
        """Follow the plans (on a change: a plan made, remade or assigned). Never in backward:
        a backward gather, a checkpointed block's recompute among them, reads what forward
        read. Every rank sees the same plans (their float8 errors are widened across ranks)
        at the same call, so every rank switches at the same gather."""
        from . import block_plans as plans

        version = plans.plans_version()
        if version == self.version or torch._C._current_graph_task_id() != -1:
            return
        self.version = version
        unsharded = getattr(self.fsdp_param, "_unsharded_param", None)
        want = unsharded is not None and id(unsharded) in plans.float8_parameters()
        if want != self.float8:
            self.float8 = want
            # FSDP2 allocates a parameter's gather buffers once, in the first gather's dtype:
            # emptied, they are allocated again in the new one (torch 2.13's FSDPParam).
            self.fsdp_param.all_gather_outputs = []


class _Scales:
    """The float8 scales of one ``fully_shard`` group's weights (torchao's dynamic tensorwise
    scale of each whole weight), made with one all-reduce for them all when a weight changed
    since (the optimizer's in-place step bumps its version): once a step, as torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``, with no call to make; backward's gathers and
    a checkpointed block's recompute reuse the forward's."""

    def __init__(self, group: Any):
        self.group = group  # the ranks holding pieces of the weights (None: every rank)
        self.states: list[_GatherState] = []
        self.versions: tuple[int, ...] = ()
        self.scales: dict[int, torch.Tensor] = {}

    def of(self, state: _GatherState) -> torch.Tensor:
        import torch.distributed as dist

        from ..precision import float8 as f8

        shards = [s.shard() for s in self.states]
        versions = tuple(t._version for t in shards)
        if versions != self.versions or id(state) not in self.scales:
            amax = torch.stack([t.abs().max() if t.numel() else t.new_zeros(())
                                for t in shards]).to(torch.float32)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            self.scales = {id(s): f8.scale_of(a) for s, a in zip(self.states, amax)}
            self.versions = versions
        return self.scales[id(state)]


_aten = torch.ops.aten
# The ops FSDP2 pads, slices and moves a shard with: their outputs stay float8-gathered shards.
_KEEP_WRAPPED = frozenset({
    _aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
    _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten.detach.default,
    _aten._pin_memory.default, _aten.split.Tensor, _aten.clone.default})


class Float8Gathered(torch.Tensor):
    """The fp32 shard of a weight that FSDP2 gathers in float8 once the plan runs its linear in
    float8 (FSDP2's ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` extension; torchao's
    ``WeightWithDynamicFloat8CastTensor`` is the model). Before: gathered in the group's low
    dtype like any parameter. After: each rank sends its shard in e4m3 with one scale for the
    whole weight (its amax across the ranks holding it; one all-reduce a step for all the
    group's weights, :class:`_Scales`), and the gathered weight is
    dequantized into the low dtype the graph reads; the graph's float8 linear casts it back to
    the same e4m3 values (tests/training/test_sharding.py), with a scale within 2**-8 of the
    gathered one. Every other op sees the fp32 shard (the optimizer, the gradient)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, state: _GatherState) -> Float8Gathered:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, state: _GatherState):
        self._tensor, self._state = tensor, state

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        import torch.utils._pytree as pytree

        states: list[_GatherState] = []

        def unwrap(t: Float8Gathered) -> torch.Tensor:
            states.append(t._state)
            return t._tensor

        args, kwargs = pytree.tree_map_only(Float8Gathered, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: Float8Gathered(t, states[0]), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._state

    @staticmethod
    def __tensor_unflatten__(inner, state, outer_size, outer_stride):
        return Float8Gathered(inner["_tensor"], state)

    def __reduce_ex__(self, protocol):  # saved (torch.save, state_dict) as the fp32 shard
        return self._tensor.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"Float8Gathered({self._state.name}, float8={self._state.float8}, {self._tensor})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        from ..precision import float8 as f8

        self._state.update()
        low = mp_policy.param_dtype or self._tensor.dtype
        shard = self._tensor
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every shard to this many rows
        if shard.shape[0] < rows:
            shard = torch.cat([shard, shard.new_zeros(rows - shard.shape[0], *shard.shape[1:])])
        if not self._state.float8:
            return (shard.to(low),), None
        scale = self._state.scales.of(self._state)
        return (f8.to_e4m3(shard, scale),), scale

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        value = data if metadata is None else dequantized(data, metadata, param_dtype)
        if out is not None:
            from torch.distributed.tensor import DTensor

            target = out._local_tensor if isinstance(out, DTensor) else out
            # Written in place of the last gather, as FSDP2 writes its own gathers: no version
            # bump (autograd saved the weight for backward, where it is gathered again).
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
                target.copy_(value)
            return None
        unsharded = value.to(param_dtype, copy=True)
        return unsharded, (unsharded,)


def dequantized(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float8 weight gathered with its ``scale``, in ``dtype``: what the graph reads.

    >>> from amprewrite.precision import float8 as f8
    >>> w = torch.tensor([[0.5, -0.25], [0.125, 0.01]])
    >>> s = f8.scale_of(w.abs().max())
    >>> dequantized(f8.to_e4m3(w, s), s, torch.bfloat16)  # 0.01: e4m3 keeps 3 mantissa bits
    tensor([[ 0.5000, -0.2500],
            [ 0.1250,  0.0101]], dtype=torch.bfloat16)
    """
    return (data.to(torch.float32) / scale).to(dtype)


def float8_gathers(module: nn.Module) -> list[str]:
    """The parameters of ``module`` that :func:`fully_shard` gathers in float8 now (the plan
    runs their linear in float8)."""
    out = []
    for name, p in module.named_parameters():
        local = getattr(p, "_local_tensor", p)
        if isinstance(local, Float8Gathered) and local._state.float8:
            out.append(_clean(name))
    return out


def _wrap_float8(module: nn.Module, plan: ShardingPlan, mesh: Any) -> list[_GatherState]:
    """Each float8-candidate weight of ``plan`` made a :class:`Float8Gathered` parameter."""
    # The ranks holding pieces of a weight: FSDP's shard dimension (the last, with a replicate
    # dimension in front: its replicas hold the same values); every rank without a mesh.
    scales = _Scales(None if mesh is None else mesh.get_group(mesh.ndim - 1))
    states = []
    by_clean = {_clean(n): n for n, _ in module.named_parameters()}
    for name in plan.float8():
        raw = by_clean[name]
        owner, _, attr = raw.rpartition(".")
        sub = module.get_submodule(owner)
        old = getattr(sub, attr)
        state = _GatherState(name, scales)
        setattr(sub, attr, nn.Parameter(Float8Gathered(old.detach(), state),
                                        requires_grad=old.requires_grad))
        states.append(state)
    scales.states = states
    return states


def _policy(param_dtype: torch.dtype | None, leaf: bool,
            reduce_dtype: torch.dtype = torch.float32) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if leaf:  # the casts the plan puts around a LOW op, in FSDP's hooks
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                    output_dtype=torch.float32, cast_forward_inputs=True)
    # The graph casts (compiled) or there is nothing to cast (fp32): inputs as they come.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                cast_forward_inputs=False)


_LOW_DTYPES = (torch.bfloat16, torch.float16)


def fully_shard(module: nn.Module | list[nn.Module], *, dtype: torch.dtype | str | None = None,
                keep_fp32: Iterable[Selector] = (), fp8: object = None,
                compiled: bool | None = None, params: str = "fp32",
                **kwargs: Any) -> nn.Module | list[nn.Module]:
    """``torch.distributed.fsdp.fully_shard`` that gathers in ``dtype`` the parameters the
    precision plan reads low, and reduces gradients in fp32 into fp32 shards.

    Takes ``fully_shard``'s arguments (``mesh``, ``reshard_after_forward``,
    ``shard_placement_fn``, ``offload_policy``, ``ignored_params``, ``mp_policy``), so a call
    written for torch's (torchtitan's) works unchanged. ``dtype`` is the plan's low dtype
    (default bf16; else ``mp_policy.param_dtype`` where that is bf16 or fp16): the policy's
    ``param_dtype`` becomes the dtype of the parameters the plan reads low, its
    ``reduce_dtype`` is kept (fp32 where it is None), and the casts of inputs and outputs are
    the plan's (``output_dtype``, ``cast_forward_inputs`` of the policy are not used). An
    ``mp_policy`` without a low ``param_dtype`` (fp32 training) is handed to torch's
    ``fully_shard`` as it is. A list of modules is sharded one module at a time (FSDP2 would
    make them one group, which holds one dtype). ``fp8`` (the backend's ``fp8`` option,
    tensorwise): a compiled block's
    Linear weights are :class:`Float8Gathered`, gathered in float8 from the first forward after
    the plan runs their linear in float8 (:func:`float8_gathers` names them).

    Call it where torchtitan calls ``fully_shard``: per block after
    ``torch.compile(block, backend="amprewrite")`` (or ``block.compile(...)``), then on the
    root. :func:`sharding_plan` says what it does with each parameter. A block compiled as
    torch's FSDP2 tutorial does, ``layers[i] = torch.compile(block, backend="amprewrite")``
    and then ``fully_shard(block)`` on the block itself, does not know its wrapper: pass
    ``compiled=True`` (the block runs in an amprewrite graph; what shards the wrapper does).
    A module sharded as eager code (each Linear its own group, kept gathered until backward)
    that then runs in a compiled graph warns at its first compiled forward.

    In a process group (``torchrun``; tests/training/test_sharding.py runs it on gloo)::

        for name, block in list(model.model.layers.named_children()):
            block = torch.compile(checkpoint_wrapper(block), backend="amprewrite")
            amprewrite.fully_shard(block, dtype=torch.bfloat16)   # one group, gathered bf16
            model.model.layers.register_module(name, block)
        amprewrite.fully_shard(model)   # embedding and head: own bf16 groups; final norm fp32

    Without one, the plan it would follow:

    >>> from torch import nn
    >>> plan = sharding_plan(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), dtype="bf16")
    >>> plan.groups()
    {'0': torch.bfloat16, '': torch.float32}
    >>> plan.params["1.weight"].reason
    'read by layer_norm in eager code: fp32'
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if isinstance(module, (list, tuple)):
        return [fully_shard(m, dtype=dtype, keep_fp32=keep_fp32, fp8=fp8, compiled=compiled,
                            params=params, **kwargs) for m in module]
    given = kwargs.pop("mp_policy", None)
    reduce_dtype = torch.float32
    if given is not None:
        if given.param_dtype not in _LOW_DTYPES and dtype is None:
            # fp32 training (or a policy amprewrite has no plan for): torch's, as asked
            return torch_fully_shard(module, mp_policy=given, **kwargs)
        dtype = dtype if dtype is not None else given.param_dtype
        reduce_dtype = given.reduce_dtype or torch.float32
    if dtype is None:
        dtype = torch.bfloat16
    plan = _plan(module, dtype, keep_fp32, kwargs.get("ignored_params"), fp8, compiled)
    if check_params(params, "amprewrite.fully_shard") == "low":
        _store_gathered_low(module, plan)
    kind = type(module).__name__  # before FSDP2 renames the class (FSDPLlamaDecoderLayer)
    for note in plan.notes:
        warnings.warn(f"amprewrite.fully_shard: {note}", stacklevel=2)
    states = _wrap_float8(module, plan, kwargs.get("mesh")) if plan.float8() else []
    leaves = {p.group for p in plan.params.values() if p.group}
    # A leaf is never FSDP's root: left to FSDP it would reshard after forward and gather again
    # in backward, which the module's own group (the root's: not resharded) does not.
    leaf_kwargs = {"reshard_after_forward": False, **kwargs}
    for path in sorted(leaves):
        torch_fully_shard(module.get_submodule(path),
                          mp_policy=_policy(plan.dtype, True, reduce_dtype), **leaf_kwargs)
    rest = {p.dtype for p in plan.params.values() if not p.group}
    if plan.compiled and torch.float32 in rest:
        warnings.warn(f"amprewrite.fully_shard gathers this compiled module in fp32: "
                      f"{next(p.reason for p in plan.params.values() if not p.group)}",
                      stacklevel=2)
    low = plan.dtype if rest == {plan.dtype} else None
    # A Linear or Embedding sharded on its own (torchtitan shards [norm, head] as a list) is a
    # leaf too: FSDP's hooks make its casts.
    sharded = torch_fully_shard(module, mp_policy=_policy(low, plan.leaf and low is not None,
                                                          reduce_dtype), **kwargs)
    # sharding_plan(module) lists what this call did; gathered_dtype(module) is its dtype, on
    # the module a torch.compile wrapper compiles too (the backend finds that one).
    for m in (module, getattr(module, "_orig_mod", None)):
        if m is not None:
            m.__dict__[_RECORDED] = plan
    if leaves and not plan.compiled:
        module.register_forward_pre_hook(_warn_if_compiled(kind))
    if states:
        by_state = {}
        from .block_plans import fsdp_params

        for fsdp_param in fsdp_params(module):
            local = getattr(fsdp_param, "_sharded_local_tensor", None)
            if isinstance(local, Float8Gathered):
                by_state[id(local._state)] = fsdp_param
        for state in states:
            state.fsdp_param = by_state[id(state)]
        sharded.set_custom_all_gather(_byte_gather())  # gloo has no float8 dtype
    return sharded


def _store_gathered_low(module: nn.Module, plan: ShardingPlan) -> None:
    """params='low': the parameters the plan gathers low are stored low before FSDP2 shards
    them, so their shards, gradients and amprewrite.optimizer's states are low and the
    all-gather needs no cast; gradients are still reduce-scattered in the policy's
    ``reduce_dtype`` (fp32) and cast to the shard's dtype after."""
    for name, entry in plan.params.items():
        p = module.get_parameter(name)
        if entry.dtype == plan.dtype and p.dtype == torch.float32 and not hasattr(p, "to_local"):
            p.data = p.data.to(plan.dtype)


def _warn_if_compiled(name: str) -> Any:
    """A forward pre-hook for a module sharded as eager code: its Linears are groups of their
    own, not resharded after forward, which is right for eager code (the root's embedding and
    head) and wrong in a compiled block (all its weights held gathered until backward, and
    backward gathers nothing: torchtitan's per-block groups reshard and gather again)."""
    warned = False

    def hook(module: nn.Module, args: Any) -> None:
        nonlocal warned
        # Dynamo traces this hook when the module runs inside torch.compile (a wrapper made
        # before fully_shard and kept elsewhere, or module.compile after it); eagerly it is off.
        if torch.compiler.is_compiling() and not warned:
            warned = True
            warnings.warn(
                f"amprewrite.fully_shard sharded this {name} as eager code (each Linear and "
                "Embedding its own group, kept gathered from forward to backward), but it "
                "runs inside torch.compile: every block's low-precision weights stay gathered "
                "until backward, the memory FSDP saves. Shard it as compiled: call "
                "amprewrite.fully_shard on the wrapper torch.compile returns, or after "
                "module.compile(backend=\"amprewrite\"), or pass compiled=True where the "
                "wrapper is kept elsewhere (layers[i] = torch.compile(block, ...); "
                "amprewrite.fully_shard(block, compiled=True)).", stacklevel=2)

    return hook


@dataclass
class CommBytes:
    """Bytes FSDP2's collectives moved on this rank: all-gather outputs (the unsharded,
    padded parameters) and reduce-scatter inputs (the unsharded gradients), by dtype."""

    all_gather: dict[torch.dtype, int] = field(default_factory=dict)
    reduce_scatter: dict[torch.dtype, int] = field(default_factory=dict)

    def total(self, kind: str) -> int:
        return sum(getattr(self, kind).values())


def _byte_gather() -> Any:
    """FSDP2's all-gather, with a float8 buffer moved as bytes: gloo refuses float8 dtypes
    ("RuntimeError: Invalid scalar type", torch 2.13), and an all-gather only copies bytes."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class ByteGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, *args, **kw):
            if output_tensor.is_floating_point() and output_tensor.element_size() == 1:
                output_tensor = output_tensor.view(torch.uint8)
                input_tensor = input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, *args, **kw)

    return ByteGather()


def _counting(kind: str, counts: CommBytes, default: Any) -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    base = AllGather if kind == "all_gather" else ReduceScatter

    class Counting(base):  # type: ignore[misc, valid-type]
        def allocate(self, size, *, dtype, device):
            return default.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, *args, **kw):
            t = output_tensor if kind == "all_gather" else input_tensor
            table = getattr(counts, kind)
            table[t.dtype] = table.get(t.dtype, 0) + t.numel() * t.element_size()
            return default(output_tensor, input_tensor, group, *args, **kw)

    return Counting()


@contextmanager
def count_comm(model: nn.Module) -> Iterator[CommBytes]:
    """Count the bytes of every FSDP2 all-gather and reduce-scatter under ``model`` while the
    block runs (FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``). A float8
    all-gather is counted as float8 and moved as bytes (gloo has no float8 dtype), during the
    block and after it."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    counts = CommBytes()
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_custom_all_gather(_counting("all_gather", counts, _byte_gather()))
        m.set_custom_reduce_scatter(_counting("reduce_scatter", counts, DefaultReduceScatter()))
    try:
        yield counts
    finally:
        for m in sharded:
            m.set_custom_all_gather(_byte_gather())
            m.set_custom_reduce_scatter(DefaultReduceScatter())


# The functional collectives DTensor's redistributions call (torch.distributed.tensor's
# placements call them through the module, so a wrapper there sees every one).
_FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
               "all_to_all_single_autograd")


@contextmanager
def count_collectives() -> Iterator[dict[tuple[str, torch.dtype], int]]:
    """Count the bytes handed to each functional collective on this rank while the block runs
    (what tensor parallel's DTensor redistributions send, forward and backward): by
    (collective, dtype), the input tensor's bytes. The graphs must run their DTensor ops as
    Python (the backend's ``inner="eager"``, or eager code): inductor's compiled collectives
    call the ops directly.

    >>> with count_collectives() as sent:
    ...     pass
    >>> sent
    {}
    """
    import torch.distributed._functional_collectives as funcol

    sent: dict[tuple[str, torch.dtype], int] = {}
    saved = {name: getattr(funcol, name) for name in _FUNCTIONAL if hasattr(funcol, name)}

    def counting(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            x = args[0] if args else kwargs.get("self")
            if isinstance(x, torch.Tensor):
                key = (name.removesuffix("_autograd"), x.dtype)
                sent[key] = sent.get(key, 0) + x.numel() * x.element_size()
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(funcol, name, counting(name, fn))
    try:
        yield sent
    finally:
        for name, fn in saved.items():
            setattr(funcol, name, fn)
