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

import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .errors import PolicyError
from .ops import Precision, family_for_module
from .policy import Policy, Selector
from .ranges import declared_fp32

__all__ = ["CommBytes", "ParamShard", "ShardingPlan", "count_comm", "fully_shard",
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


@dataclass
class ShardingPlan:
    """The plan of one :func:`fully_shard` call. Gradients always reduce in fp32."""

    dtype: torch.dtype
    compiled: bool
    params: dict[str, ParamShard] = field(default_factory=dict)

    def groups(self) -> dict[str, torch.dtype]:
        """Group (module path, ``""`` for the module itself) -> the dtype it gathers in."""
        return {p.group: p.dtype for p in self.params.values()}

    def __str__(self) -> str:
        return "\n".join(f"{p.name}: {str(p.dtype).replace('torch.', '')} "
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


def sharding_plan(module: nn.Module, dtype: torch.dtype | str = torch.bfloat16,
                  keep_fp32: Iterable[Selector] = (),
                  ignored_params: set[nn.Parameter] | None = None) -> ShardingPlan:
    """What :func:`fully_shard` would do with ``module``'s parameters (the ones not sharded by
    an earlier call on a submodule), without sharding anything. See the module docstring."""
    policy = Policy(dtype=dtype, keep_fp32=tuple(keep_fp32))
    low, ignored = policy.dtype, ignored_params or set()
    compiled = _is_compiled(module)
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
                plan.params[name] = ParamShard(name, low, "",
                                               f"{what} in the compiled graph{how}")
            elif leaf:
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
    if compiled and pinned:  # one group, one dtype: the pinned parameters decide
        plan.params = {k: ParamShard(k, torch.float32, "", p.reason if k in pinned else
                                     f"fp32: the compiled module is one group and "
                                     f"{', '.join(pinned)} must stay fp32")
                       for k, p in plan.params.items()}
    return plan


def _policy(param_dtype: torch.dtype | None, leaf: bool) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if leaf:  # the casts the plan puts around a LOW op, in FSDP's hooks
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32, cast_forward_inputs=True)
    # The graph casts (compiled) or there is nothing to cast (fp32): inputs as they come.
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)


def fully_shard(module: nn.Module, *, dtype: torch.dtype | str = torch.bfloat16,
                keep_fp32: Iterable[Selector] = (), **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` that gathers in ``dtype`` the parameters the
    precision plan reads low, and reduces gradients in fp32 into fp32 shards.

    Takes ``fully_shard``'s keywords (``mesh``, ``reshard_after_forward``,
    ``shard_placement_fn``, ``offload_policy``, ``ignored_params``); ``mp_policy`` is the
    plan's and refused. Call it where torchtitan calls ``fully_shard``: per block after
    ``torch.compile(block, backend="amprewrite")`` (or ``block.compile(...)``), then on the
    root. :func:`sharding_plan` says what it does with each parameter.

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

    if "mp_policy" in kwargs:
        raise PolicyError(
            "amprewrite.fully_shard sets FSDP2's MixedPrecisionPolicy from the precision plan "
            "(low gathers where low ops read, fp32 reductions); pass dtype= and keep_fp32= "
            "instead of mp_policy, or call torch.distributed.fsdp.fully_shard directly.")
    plan = sharding_plan(module, dtype, keep_fp32, kwargs.get("ignored_params"))
    leaves = {p.group for p in plan.params.values() if p.group}
    # A leaf is never FSDP's root: left to FSDP it would reshard after forward and gather again
    # in backward, which the module's own group (the root's: not resharded) does not.
    leaf_kwargs = {"reshard_after_forward": False, **kwargs}
    for path in sorted(leaves):
        torch_fully_shard(module.get_submodule(path), mp_policy=_policy(plan.dtype, True),
                          **leaf_kwargs)
    rest = {p.dtype for p in plan.params.values() if not p.group}
    if plan.compiled and torch.float32 in rest:
        warnings.warn(f"amprewrite.fully_shard gathers this compiled module in fp32: "
                      f"{next(p.reason for p in plan.params.values() if not p.group)}",
                      stacklevel=2)
    low = plan.dtype if rest == {plan.dtype} else None
    return torch_fully_shard(module, mp_policy=_policy(low, False), **kwargs)


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
