"""What inputs a dynamo-captured graph was captured for, checked on every call.

Dynamo specialises a graph to its example inputs: sizes it saw (all of them, in a static
capture; size-1 dimensions even in a dynamic one), and non-tensor arguments (``scale=3.0``,
``use_cache=False``), which it bakes in as constants. Called with anything else, the graph
may fail deep inside or -- worse -- return a result for the inputs it was captured with.

:class:`InputGuard` holds dynamo's own shape guards for the graph's inputs (compiled once to a
Python function; about a microsecond a call) and the captured constants. A transformed graph
checks its inputs with it before it runs: on a miss it is transformed again for the new inputs
(see ``DynamoGraphModule``), or raises :class:`~amprewrite.errors.ShapeError` naming the input,
the captured size and the size received.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from ..errors import PolicyError, SignatureError
from .meta import fake_value

__all__ = ["BATCH", "SEQ", "InputCheck", "InputGuard", "bind_call", "capture_spec",
           "flat_inputs", "positional_leaves", "sequence_limit", "split_inputs"]

BATCH = "batch"
"""``transform(dynamic_shapes=...)``'s default: dimension 0 of every tensor input dynamic where
the model allows it (``torch.export.Dim.AUTO``), every other dimension static."""

_TENSOR = object()  # marks a tensor leaf in ``constants``


SEQ = 1
"""The sequence dimension: dimension 1 of a ``[batch, seq, ...]`` input (token ids, masks,
positions, embeddings), made dynamic by ``deploy.export(dynamic_seq=True)``."""


def capture_spec(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: object,
                 dims: Sequence[int] = (0,), seq_max: int | None = None
                 ) -> tuple[object, dict[str, object]]:
    """The ``dynamic_shapes`` to capture ``model(*args, **kwargs)`` with (torch.export's form:
    a dict by argument name or a tuple by position), and the arguments by name.

    ``dynamic_shapes`` is :data:`BATCH` (dimension 0 of each tensor of size >= 2 is
    ``Dim.AUTO``: dynamic unless the model fixes it), ``None`` (all static, as torch.export
    reads None) or torch.export's own spec, returned as given. ``dims``: the dimensions the
    :data:`BATCH` spec makes ``Dim.AUTO`` where a tensor has them at size >= 2 (dynamo
    specialises 0 and 1): ``(0,)``, the batch; ``(0, SEQ)`` the sequence too. Dimensions
    marked with ``torch._dynamo.mark_dynamic`` (a capture for new sizes) are added as
    ``Dim.AUTO`` to the batch spec, since dynamo reads no marks when it is given a spec.
    ``seq_max``: the longest sequence the model takes (its position table's size), the upper
    bound of the :data:`SEQ` dimensions' ``Dim.AUTO``.
    """
    from torch.export import Dim

    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    if not (isinstance(dynamic_shapes, str) and dynamic_shapes == BATCH):
        if isinstance(dynamic_shapes, dict) and set(dynamic_shapes) - set(bound):
            raise PolicyError(
                f"dynamic_shapes has keys {sorted(dynamic_shapes)}, but a dict of "
                "dynamic_shapes is keyed by the names of the arguments forward is called with "
                f"({type(model).__name__}.forward{inspect.signature(model.forward)} takes "
                f"these example_inputs as {list(bound)}), as torch.export reads it. Key it by "
                f"those names (e.g. {{{next(iter(bound))!r}: {{0: Dim('batch')}}}}), or pass a "
                "tuple in the order of the positional inputs.")
        return dynamic_shapes, dict(bound)

    def auto(value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return None
        marked = set(getattr(value, "_dynamo_dynamic_indices", ()))
        marked.update(d for d in dims if value.dim() > d and value.shape[d] >= 2)
        return {d: Dim.AUTO(max=seq_max) if d == SEQ and seq_max else Dim.AUTO
                for d in sorted(marked)} or None

    spec = {name: pytree.tree_map(auto, value) for name, value in bound.items()}
    if not any(isinstance(leaf, dict) for leaf in pytree.tree_leaves(
            spec, is_leaf=lambda v: isinstance(v, dict) and all(isinstance(k, int) for k in v))):
        return None, dict(bound)  # nothing can be dynamic: a static capture, as before
    return spec, dict(bound)


# Where a model says the longest sequence it takes: transformers' configs (GPT-2's
# n_positions, most others' max_position_embeddings), nanoGPT's block_size, torchtitan's
# max_seq_len.
_SEQ_LIMITS = ("n_positions", "max_position_embeddings", "n_ctx", "block_size", "max_seq_len")


def sequence_limit(model: nn.Module) -> tuple[int | None, str | None]:
    """The longest sequence ``model`` takes, and where that was read (for a note), or
    ``(None, None)``: its config's limit, else the size of a position-embedding table (an
    ``nn.Embedding`` whose name says ``pos``). Past it a model fails (GPT-2's position table
    raises IndexError), so it is the upper bound of a dynamic sequence.

    >>> net = nn.Module()
    >>> net.pos_emb = nn.Embedding(64, 8)
    >>> sequence_limit(net)
    (64, 'position table pos_emb (nn.Embedding(64, ...))')
    """
    config = getattr(model, "config", None)
    for attr in _SEQ_LIMITS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
            return value, f"config.{attr}"
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and "pos" in name.rsplit(".", 1)[-1].lower():
            return (module.num_embeddings,
                    f"position table {name} (nn.Embedding({module.num_embeddings}, ...))")
    return None, None


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[object]:
    """The call's inputs flattened in the order of ``gm``'s placeholders."""
    fast = getattr(gm, "_amp_fast", None)  # set when the graph takes n positional leaves
    if fast is not None and not kwargs and len(args) == fast.n:
        return list(args)  # the common call: as many plain positional inputs as captured
    bound = bind_call(gm, args, kwargs)
    bound.apply_defaults()
    values = list(bound.arguments.values())
    spec = gm.graph._codegen.pytree_info.in_spec
    n_pos = spec.child(0).num_children
    keys = spec.child(1).context
    by_name = dict(bound.arguments)
    kw = {k: by_name[k] for k in keys}
    return fx_pytree.tree_flatten_spec((values[:n_pos], kw), spec)


def bind_call(gm: fx.GraphModule, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The call's arguments bound to ``gm``'s signature: the inputs it was captured with.

    A call that does not fit raises :class:`~amprewrite.errors.SignatureError` (a
    ``TypeError``) naming the inputs the graph was captured with and how to add one, where
    ``inspect`` would say only "got an unexpected keyword argument 'attention_mask'".
    """
    signature = inspect.signature(gm.forward)
    try:
        return signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise SignatureError(_unfit_call(gm, signature, args, kwargs, exc)) from None


def _unfit_call(gm: fx.GraphModule, signature: inspect.Signature, args: tuple, kwargs: dict,
                exc: TypeError) -> str:
    """Why the call does not fit the captured inputs, and what to do, in one paragraph."""
    params = [p for p in signature.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    captured = [p.name for p in params]
    shown = ", ".join(captured) if captured else "no inputs"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    extra_kw = [k for k in kwargs if k not in captured]
    extra_pos = len(args) - len(positional)
    head = f"the transformed graph was captured with the inputs ({shown}) and no others"
    if extra_kw or extra_pos > 0:
        names = _model_names(gm, args, kwargs)
        new = names[len(captured):] if names else []
        if extra_kw:
            what = f"the keyword input{'s' * (len(extra_kw) > 1)} {', '.join(extra_kw)}"
        else:
            what = (f"{len(args)} positional inputs"
                    + (f" (the extra ones are the model's {', '.join(new)})" if new else ""))
        if names or extra_kw:
            keys = ", ".join(f"'{n}': {n}" for n in (names or [*captured, *extra_kw]))
            example = f"as a dict of keyword inputs: example_inputs={{{keys}}}"
        else:  # positional inputs the model's forward does not name (or no model to ask)
            example = (f"as a tuple of every positional input: example_inputs=("
                       f"{', '.join(captured)}, ...)")
        return (f"{head}, and was called with {what}: {exc}. A graph captured by dynamo "
                "takes the inputs it was captured with, each argument of forward it was not "
                "captured with fixed to its default in the graph. To pass more, transform the "
                f"model with them in example_inputs, e.g. {example}; then call the graph with "
                "the same inputs.")
    return (f"{head}; this call does not give them as captured: {exc}. Pass every input it "
            f"was captured with ({shown}), by position or by name; to call it without one, "
            "transform the model with example_inputs that leave it out.")


def _model_names(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[str] | None:
    """The names the transformed model's forward gives the call's arguments, in its order,
    where the graph still knows its model and the call fits that model's forward."""
    source = getattr(gm, "_amp_source", None)
    model = source[0] if source else None
    if callable(model) and not isinstance(model, nn.Module):  # a weakref (params="low")
        model = model()
    if not isinstance(model, nn.Module):
        return None
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    names = []
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:  # forward(..., **kwargs): the keywords given
            names += list(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            return None  # positional inputs forward does not name
        else:
            names.append(name)
    return names


def positional_leaves(spec: pytree.TreeSpec) -> int:
    """n when the graph takes exactly n positional leaves and no keywords, else -1 (then the
    call's arguments are bound to the signature: about 30 us a call)."""
    pos, kw = spec.child(0), spec.child(1)
    leaves = all(pos.child(i).is_leaf() for i in range(pos.num_children))
    return pos.num_children if leaves and kw.num_children == 0 else -1


@dataclass
class _Input:
    name: str
    sizes: tuple[int | None, ...] | None  # None = dynamic; the whole tuple None: not a tensor
    ranges: tuple[tuple[int, float], ...]
    # per dimension: the model's source line whose guard bounds a dynamic size, or None
    bounded_by: tuple[str | None, ...] = ()


class InputGuard:
    """Accepts the inputs a graph is valid for (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, example_flat: Sequence[object]):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = _leaf_names(gm)
        self.inputs: list[_Input] = []
        self.constants: list[object] = []
        fakes, where = [], []
        shape_env = None
        for i, (node, example) in enumerate(zip(placeholders, example_flat)):
            fake = fake_value(node)
            name = names[i] if i < len(names) else node.name
            if isinstance(fake, torch.Tensor) and hasattr(fake, "fake_mode"):
                shape_env = shape_env or fake.fake_mode.shape_env
                fakes.append(fake)
                where.append(i)
                self.constants.append(_TENSOR)
                self.inputs.append(_Input(name, *_dims(fake)))
            elif isinstance(example, torch.Tensor):
                self.constants.append(_TENSOR)  # a tensor the graph does not read
                self.inputs.append(_Input(name, None, ()))
            else:
                self.constants.append(example)  # baked into the graph as a constant
                self.inputs.append(_Input(name, None, ()))
        self._where = where
        self._check = _compile(shape_env, fakes)
        # A static capture's guards are its sizes: compare them directly (the common case).
        self._static = None
        if all(None not in self.inputs[i].sizes for i in where):
            self._static = [(i, torch.Size(self.inputs[i].sizes)) for i in where]
        self._constants = any(c is not _TENSOR for c in self.constants)

    def accepts(self, flat: Sequence[object]) -> bool:
        """Do these flattened inputs satisfy every guard of the capture?"""
        if len(flat) != len(self.constants):
            return False
        if self._static is not None and not self._constants:
            for i, size in self._static:
                value = flat[i]
                if not isinstance(value, torch.Tensor) or value.shape != size:
                    return False
            return True
        for value, const in zip(flat, self.constants):
            if const is _TENSOR:
                continue
            if isinstance(value, torch.Tensor) or not _same(value, const):
                return False
        for i in self._where:
            value = flat[i]
            if not isinstance(value, torch.Tensor) or value.dim() != len(self.inputs[i].sizes):
                return False
        return bool(self._check({f"t{j}": flat[i] for j, i in enumerate(self._where)}))

    def changed_dims(self, flat: Sequence[object], only_dynamic: bool = False
                     ) -> dict[int, list[int]]:
        """Per tensor input (by flat index): the dimensions to make dynamic in a re-capture for
        ``flat``: those that were dynamic, and (unless ``only_dynamic``) those whose size
        changed; never a size 0 or 1, which dynamo specialises."""
        out: dict[int, list[int]] = {}
        for i, (inp, value) in enumerate(zip(self.inputs, flat)):
            if inp.sizes is None or not isinstance(value, torch.Tensor):
                continue
            if value.dim() != len(inp.sizes):
                continue
            dims = [d for d, (want, size) in enumerate(zip(inp.sizes, value.shape))
                    if (want is None or (want != size and not only_dynamic)) and size > 1]
            if dims:
                out[i] = dims
        return out

    def out_of_range(self, flat: Sequence[object]) -> str | None:
        """Why these inputs fall outside a dynamic dimension's range, for a size of at least 2
        (0 and 1, which dynamo never makes dynamic, take a graph of their own); else None."""
        for inp, value in zip(self.inputs, flat):
            if inp.sizes is None or not isinstance(value, torch.Tensor):
                continue
            if value.dim() != len(inp.sizes):
                continue
            for d, (want, (lo, hi), size) in enumerate(zip(inp.sizes, inp.ranges, value.shape)):
                if want is None and size >= 2 and not lo <= size <= hi:
                    return (f"input '{inp.name}' dimension {d} has size {size}, outside the range "
                            f"[{lo}, {_bound(hi)}] it was captured for ({_show(inp)})")
        return None

    def dynamic_dims(self) -> list[str]:
        """The dynamic dimensions with their ranges (``input_ids[0] in [2, inf]``)."""
        return [f"{inp.name}[{d}] in [{lo}, {_bound(hi)}]"
                for inp in self.inputs if inp.sizes is not None
                for d, (want, (lo, hi)) in enumerate(zip(inp.sizes, inp.ranges)) if want is None]

    def bounded_by(self, dim: int) -> str | None:
        """Where the model's code bounds dimension ``dim`` of a dynamic input (its source
        line, as the report shows it), or None."""
        return next((inp.bounded_by[dim] for inp in self.inputs
                     if len(inp.bounded_by) > dim and inp.bounded_by[dim] is not None), None)

    def describe(self) -> str:
        """The dynamic dimensions, in words (for the report), with where the model's own code
        bounds one (diffusers' ``Upsample2D`` branches on ``batch >= 64``, so the batch of
        its UNets and VAEs stops at 63)."""
        dims = self.dynamic_dims()
        if not dims:
            return "every input size is static"
        why: dict[tuple[str, float], list[str]] = {}  # (source line, bound) -> dimensions
        for inp in self.inputs:
            for d, line in enumerate(inp.bounded_by):
                if line is not None:
                    why.setdefault((line, inp.ranges[d][1]), []).append(f"{inp.name}[{d}]")
        said = "".join(
            f"; {', '.join(names)} {'stops' if len(names) == 1 else 'stop'} at {_bound(hi)} "
            f"because the model's code branches on it, {line}: a larger size takes the other "
            "branch, on a graph transformed again for it" for (line, hi), names in why.items())
        return "dynamic sizes: " + ", ".join(dims) + said + "; every other input size is static"

    def explain(self, flat: Sequence[object]) -> str:
        """Which input differs from what the graph was captured for, in words."""
        for inp, value, const in zip(self.inputs, flat, self.constants):
            if const is not _TENSOR:
                if isinstance(value, torch.Tensor) or not _same(value, const):
                    return (f"input '{inp.name}' was captured as the constant {const!r} (dynamo "
                            f"bakes non-tensor arguments into the graph) and is now {value!r}")
                continue
            if inp.sizes is None:
                continue
            if not isinstance(value, torch.Tensor):
                return f"input '{inp.name}' was a tensor when captured and is now {value!r}"
            got = tuple(value.shape)
            if len(got) != len(inp.sizes):
                return (f"input '{inp.name}' was captured with {len(inp.sizes)} dimensions "
                        f"{_show(inp)} and has {len(got)}: {got}")
            for d, (want, (lo, hi), size) in enumerate(zip(inp.sizes, inp.ranges, got)):
                if want is not None and size != want:
                    return (f"input '{inp.name}' dimension {d} was captured with size {want}, "
                            f"fixed in the graph ({_show(inp)}), and has size {size}")
                if want is None and not lo <= size <= hi:
                    return (f"input '{inp.name}' dimension {d} was captured as a dynamic size "
                            f"in [{lo}, {_bound(hi)}] ({_show(inp)}) and has size {size}")
        return ("the inputs break a relation between sizes the graph relies on (for example two "
                "dimensions that must be equal): captured " + ", ".join(
                    f"{i.name} {_show(i)}" for i in self.inputs if i.sizes is not None))


class InputCheck(nn.Module):
    """The first node of a captured graph: raises ShapeError for inputs it was not captured for.

    Plain size comparisons, so dynamo traces it under ``torch.compile`` (also with
    ``fullgraph=True``) and guards on the outcome.
    """

    _is_impure = True  # has no users; dead-code elimination must keep it

    def __init__(self, guard: InputGuard):
        super().__init__()
        self.guard = guard

    def forward(self, *flat: object) -> None:
        if not self.guard.accepts(flat):
            from ..errors import ShapeError

            raise ShapeError(
                f"this graph was called with inputs it was not captured for: "
                f"{self.guard.explain(flat)}. Running it anyway could fail inside the graph or "
                "return a result for the captured inputs. Uncompiled, the GraphModule "
                "transforms itself for new inputs; under torch.compile it cannot: compile the "
                "model with backend='amprewrite' instead (its passes run on every graph dynamo "
                "makes), or transform with example_inputs of the shape you compile for."
            )


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    return type(a) is type(b) and isinstance(a, (int, float, bool, str)) and a == b


def _dims(fake: torch.Tensor) -> tuple[tuple[int | None, ...], tuple[tuple[int, float], ...],
                                       tuple[str | None, ...]]:
    sizes, ranges, bounded_by = [], [], []
    for s in fake.shape:
        if not isinstance(s, int) and s.node.expr.is_number:
            s = int(s.node.expr)  # made dynamic, then fixed by the model (a loop over it)
        if isinstance(s, int):
            sizes.append(s)
            ranges.append((s, s))
            bounded_by.append(None)
            continue
        sizes.append(None)
        node = s.node
        env = node.shape_env
        expr = node.expr
        vr = env.var_to_range.get(expr) if hasattr(env, "var_to_range") else None
        lo = int(vr.lower) if vr is not None else 0
        hi = float(vr.upper) if vr is not None and vr.upper.is_finite else float("inf")
        ranges.append((lo, hi))
        bounded_by.append(_guarded_at(env, expr) if hi != float("inf") else None)
    return tuple(sizes), tuple(ranges), tuple(bounded_by)


def _guarded_at(env: object, symbol: object) -> str | None:
    """The model's source line where dynamo guarded on ``symbol`` alone (a branch on a size,
    ``if hidden_states.shape[0] >= 64:``), as `` `code` (file:line in function)``; None where
    no guard says (a range the caller gave, or a torch without guard locations)."""
    for guard in getattr(env, "guards", ()):
        loc = getattr(getattr(guard, "sloc", None), "maybe_user_loc", None)
        if loc and getattr(guard.expr, "free_symbols", None) == {symbol}:
            code, _, where = loc.partition("  # ")
            return f"`{code.strip()}` ({where.strip()})" if where else f"`{code.strip()}`"
    return None


def _bound(hi: float) -> str:
    return "inf" if hi == float("inf") else str(int(hi))


def _show(inp: _Input) -> str:
    if inp.sizes is None:
        return "(not a tensor)"
    return "(" + ", ".join("*" if s is None else str(s) for s in inp.sizes) + ")"


def _compile(shape_env, fakes: list[torch.Tensor]):
    """Dynamo's guards on these fake inputs' sizes as one Python function. Stride and storage
    offset guards are left out: a contiguous copy of a sliced input should not recapture."""
    if shape_env is None or not fakes:
        return lambda L: True
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    sources = [LocalSource(f"t{j}") for j in range(len(fakes))]
    guards = shape_env.produce_guards(fakes, sources, ignore_static=False)
    kept = [g for g in guards if ".stride()" not in g and "storage_offset()" not in g]
    if not kept:
        return lambda L: True
    return eval("lambda L: " + " and ".join(f"({g})" for g in kept), dict(SYMPY_INTERP))


def _leaf_names(gm: fx.GraphModule) -> list[str]:
    """Readable names of the flattened inputs: ``input_ids``, ``batch['pixels']``."""
    spec = gm.graph._codegen.pytree_info.in_spec
    params = list(inspect.signature(gm.forward).parameters)
    n_pos = spec.child(0).num_children
    dummy = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    pos, kw = dummy
    names = [""] * spec.num_leaves
    roots = [(params[i] if i < len(params) else f"args[{i}]", v) for i, v in enumerate(pos)]
    roots += list(kw.items())
    for root, value in roots[: n_pos + len(kw)]:
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            names[leaf] = root + pytree.keystr(path)
    return names


def split_inputs(example_inputs: object) -> tuple[tuple, dict]:
    """(positional, keyword) inputs from a tuple/list, a dict of keyword inputs, or one value."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}
