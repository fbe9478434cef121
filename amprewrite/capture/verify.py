"""Verification: run the fp32 model, autocast and a transformed graph on equal terms.

:func:`verify_graph` is the check ``amprewrite.transform`` runs on its example inputs;
:func:`compare` the per-node comparison behind it and behind :func:`amprewrite.check_numerics`.
The runs start from one random state, draw dropout masks as fp32 does, and restore every buffer
after each run (:class:`_Replay`). This module sits below :mod:`amprewrite.api`: it runs
graphs, it never transforms one.

>>> rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) < 0.2
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import VerificationError
from ..graph import meta as M
from ..graph.modules import buffer_clone_copy, get_attr
from ..graph.shapes import split_inputs
from ..precision.ops import MASK_DRAWS, Precision
from ..precision.policy import Policy
from ..progress import status
from .trace import capture, captured_again

__all__ = ["TRAIN_MODE_CHECK", "AdviceSearch", "CheckResult", "NodeError", "compare",
           "culprit_node", "float_leaves", "rel_err", "replayed", "selector_for", "verify_bound",
           "verify_graph"]

# How the report says that the check ran in train mode (passes/verify_output.py); a transformed
# ExportedProgram with no mode-dependent op drops it (capture/exported.py), as there the note
# beside it says train and eval compute the same.
TRAIN_MODE_CHECK = " in train mode (same random draws in every run, buffers restored)"


@dataclass(frozen=True)
class NodeError:
    """How far one node's output is from the fp32 model's value of the same node."""

    node: str
    module_path: str
    family: str | None
    precision: str
    rel_err: float | None  # None: no fp32 counterpart (a cast amprewrite inserted)
    finite: bool
    source: str | None


@dataclass
class CheckResult:
    """What :func:`check_numerics` found."""

    output_error: float
    finite: bool
    nodes: list[NodeError] = field(default_factory=list)  # worst first
    first_nonfinite: NodeError | None = None
    # How many floating-point outputs were compared; 0: nothing to compare (integer outputs).
    outputs: int = -1

    def passed(self, rtol: float) -> bool:
        return self.finite and self.output_error <= rtol


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.values[n.name] = out.detach()
        return out


def _record(gm: fx.GraphModule, inputs: object) -> dict[str, torch.Tensor]:
    args, kwargs = split_inputs(inputs)
    rec = _Recorder(gm)
    with torch.no_grad():  # keyword inputs bound to the graph's placeholders by name
        rec.run(*inspect.signature(gm.forward).bind(*args, **kwargs).args)
    return rec.values


# --- running the fp32 model, autocast and the graph on equal terms ---------------------------
_LOW = (torch.bfloat16, torch.float16)


class _DropoutMasksInFp32(TorchDispatchMode):
    """Draw every dropout mask as fp32 draws it, whatever the tensor's dtype.

    The ops are ``bernoulli_`` (what CPU dropout and its 1d/2d/3d, alpha and feature-alpha
    variants run on a noise tensor of the input's dtype, and what hand-written drop-path code
    calls), ``bernoulli`` and ``native_dropout`` (CUDA's fused dropout, which lays its draws out
    by vector width, a function of the dtype). Their low-precision float arguments are upcast
    and the results rounded back, so each consumes the generator exactly as in fp32, and the
    k-th mask of every run, fp32 or low, is the same: a mask is 0/1 (exact in any dtype), and
    ``native_dropout``'s output is then the fp32 product rounded once, as its low kernel
    computes it. On CPU today's kernels already draw equal masks across dtypes (measured), so
    there this only guards against kernels that do not.

    Other random ops (``rand``, ``randn``, ``normal_``) run untouched: rounding an fp32 uniform
    draw can give 1.0, which a bf16 ``rand`` never returns, so their low-precision draws stay
    their own. Every run starts from the same generator state (:class:`_Replay`), so such an op
    draws the same numbers wherever it runs in the same dtype, as an explicit
    ``dtype=torch.float32`` factory does in every run.
    """

    # A higher-order op (FlexAttention's flex_attention, torchtitan's attention) reaches
    # __torch_dispatch__ and runs as it is, the mode set aside for it (torch pops it): its
    # subgraphs (score and mask functions) draw no dropout masks.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile may run under this mode: it is off while dynamo compiles and on while
        the compiled code runs (FlexAttention's eager call compiles its op; a mode that says
        nothing makes dynamo refuse: "non-infra torch dispatch mode present")."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator) or (
                func.overloadpacket not in MASK_DRAWS):
            return func(*args, **kwargs)
        return _in_fp32(func, args, kwargs)




def _in_fp32(func, args: tuple, kwargs: dict) -> object:
    """``func`` (a mask op) run on fp32 copies of its low-precision arguments, its result in the
    first argument's dtype (what the op returns, or writes for ``bernoulli_``)."""
    first = args[0] if args else None
    if not (isinstance(first, torch.Tensor) and first.dtype in _LOW):
        return func(*args, **kwargs)
    up_args = [a.float() if isinstance(a, torch.Tensor) and a.dtype in _LOW else a
               for a in args]
    out = func(*up_args, **kwargs)
    if func.overloadpacket is torch.ops.aten.bernoulli_:  # in place: write the draws back
        return first.copy_(up_args[0])
    # native_dropout's (output, bool mask) and bernoulli's draws: floats back to the dtype.
    return pytree.tree_map(lambda v: v.to(first.dtype) if isinstance(v, torch.Tensor)
                           and v.dtype == torch.float32 else v, out)


class _Replay:
    """Runs callables from one random state, each leaving the modules' buffers as it found them.

    Before each run the CPU (and, once initialised, every CUDA) generator is set back to the
    state it had when the replay began, and dropout masks are drawn as fp32 draws them
    (:class:`_DropoutMasksInFp32`), so dropout zeroes the same elements in the fp32 model, under
    autocast and in the graph. After
    each run every buffer (BatchNorm's running statistics and ``num_batches_tracked``, a
    ``spectral_norm`` vector, a step counter) and every tensor constant a graph reads is given
    back its value and, where a forward reassigned it, its identity: the runs start equal, and
    the caller's model (whose buffers a ``params="fp32"`` graph shares) ends as it began. Each run
    gets its own clones of the input tensors, and runs under ``torch.no_grad``, so no gradient
    accumulates.
    """

    def __init__(self, *modules: nn.Module):
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = (torch.cuda.get_rng_state_all()
                          if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        self._slots: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id: (tensor, clone)
        for module in modules:
            for mod in module.modules():
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        self._slots.append((mod, name, buf))
                        self._keep(buf)
                if isinstance(mod, fx.GraphModule):  # constants held as plain attributes
                    for node in mod.graph.nodes:
                        if node.op == "get_attr":
                            value = get_attr(mod, str(node.target), None)
                            if isinstance(value, torch.Tensor) and not isinstance(
                                    value, nn.Parameter):
                                self._keep(value)

    def _keep(self, t: torch.Tensor) -> None:
        if id(t) not in self._saved:
            self._saved[id(t)] = (t, t.detach().clone())

    def reset_rng(self) -> None:
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)

    def restore(self) -> None:
        with torch.no_grad():
            for mod, name, buf in self._slots:
                if mod._buffers.get(name) is not buf:
                    mod._buffers[name] = buf
            for t, saved in self._saved.values():
                # Written back only where it changed: an untouched tensor keeps its version.
                if not torch.equal(t, saved):
                    t.copy_(saved)

    def __call__(self, fn: Callable[..., object], *args: object) -> object:
        """``fn(*args)`` on clones of the tensors in ``args``: a model that writes into its
        inputs (``x.add_(1)``) must neither change the caller's example inputs nor hand the
        next run inputs the previous one wrote."""
        self.reset_rng()
        try:
            with torch.no_grad(), _DropoutMasksInFp32():
                fresh = pytree.tree_map(
                    lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)
                return fn(*fresh)
        finally:
            self.restore()


@contextlib.contextmanager
def replayed(*modules: nn.Module) -> Iterator[_Replay]:
    """A :class:`_Replay` over ``modules``; on exit the generators are back where they were, so
    verifying consumes none of the caller's random numbers."""
    replay = _Replay(*modules)
    try:
        yield replay
    finally:
        replay.restore()
        replay.reset_rng()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|out - ref| / |ref|`` in float64; ``inf`` when ``out`` is not finite.

    >>> rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    0.0
    >>> rel_err(torch.tensor([float("nan")]), torch.tensor([1.0]))
    inf
    """
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _same_nonfinite(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Where ``value`` and ``ref`` hold the same non-finite value (both +inf, both -inf, both
    NaN): what fp32 itself computes there, not an error of the low-precision graph."""
    value, ref = value.detach().double(), ref.detach().double()
    return ((value == ref) & ~torch.isfinite(ref)) | (value.isnan() & ref.isnan())


def _new_nonfinite(value: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``value`` is non-finite anywhere the fp32 ``ref`` does not hold that value."""
    return bool((~torch.isfinite(value) & ~_same_nonfinite(value, ref)).any())


def _node_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    """:func:`rel_err` of one node's value against fp32's, over the positions where fp32 is not
    the very same inf or NaN (those are not the graph's error); ``inf`` where the graph alone is
    non-finite."""
    same = _same_nonfinite(value, ref)
    if not bool(same.any()):
        return rel_err(value, ref)
    keep = ~same
    if not bool(torch.isfinite(value)[keep].all()):  # non-finite where fp32 is not
        return math.inf
    return rel_err(value.detach()[keep], ref.detach()[keep]) if bool(keep.any()) else 0.0


def float_leaves(value: object) -> list[torch.Tensor]:
    """The floating-point tensors in a model output (tensors, tuples, dicts, ModelOutput)."""
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return [t for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _call(fn, inputs: object) -> object:
    args, kwargs = split_inputs(inputs)
    return fn(*args, **kwargs)


def compare(model: nn.Module, gm: fx.GraphModule, example_inputs: object) -> CheckResult:
    """Run ``model`` in fp32 and the transformed ``gm`` on the same inputs; compare outputs and
    nodes (what :func:`amprewrite.check_numerics` reports).

    Nodes are matched by name between the fp32 captured graph and ``gm`` (amprewrite keeps the
    names it captured; the reference is captured the way ``gm`` was, ``capture=``). Every run
    starts from the same random state with random ops drawing as in fp32, so a model in train
    mode is compared with equal dropout masks; buffers (BatchNorm statistics) are restored after
    each run, so ``model`` ends as it began.
    """
    inputs = example_inputs
    # The reference captured as gm was (same names): gm's own capture inside keep_captured().
    method = getattr(gm.meta.get(M.POLICY_KEY), "capture", "dynamo")
    ref_gm = captured_again(model, inputs, method)
    if ref_gm is None:
        ref_gm = capture(model, inputs, method=method).gm
    with replayed(model, ref_gm, gm) as run:
        reference: dict[str, torch.Tensor] = run(_record, ref_gm, inputs)
        values: dict[str, torch.Tensor] = run(_record, gm, inputs)
        outs = float_leaves(run(_call, gm, inputs))
        refs = float_leaves(run(_call, model, inputs))
    finite = all(bool(torch.isfinite(o).all()) for o in outs)
    output_error = max((rel_err(o, r) for o, r in zip(outs, refs)), default=0.0)
    rows: list[NodeError] = []
    first_bad = None
    for node in gm.graph.nodes:
        if node.name not in values:
            continue
        value, ref = values[node.name], reference.get(node.name)
        kind = M.node_kind(node)
        is_finite = bool(torch.isfinite(value).all())
        comparable = ref is not None and ref.shape == value.shape and M.CAST not in node.meta
        row = NodeError(node.name, node.meta.get(M.MODULE_PATH, ""), node.meta.get(M.FAMILY),
                        kind, _node_err(value, ref) if comparable else None, is_finite,
                        M.source_line(node))
        rows.append(row)
        if first_bad is None and not is_finite:
            # A cast has no fp32 counterpart: it carries its source's value, so it is judged
            # against that (T5's log of a zero relative position is -inf in fp32 too).
            if ref is None or M.CAST in node.meta:
                ref = reference.get(_through_casts(node).name)
            if ref is None or ref.shape != value.shape or _new_nonfinite(value, ref):
                first_bad = row
    rows.sort(key=lambda r: -(r.rel_err if r.rel_err is not None else -1.0))
    return CheckResult(output_error, finite, rows, first_bad, len(outs))


# The built-in check's rule: the graph fails when its error exceeds autocast's by this factor
# plus this many unit roundoffs of the dtype (docs/guide.md, "The built-in check").
VERIFY_FACTOR = 4.0
VERIFY_ROUNDOFFS = 16
_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def verify_bound(autocast_error: float, dtype: torch.dtype) -> float:
    """The largest output error :func:`verify_graph` accepts, given autocast's."""
    floor = VERIFY_ROUNDOFFS * _UNIT[dtype]
    if not math.isfinite(autocast_error):
        return floor
    return VERIFY_FACTOR * autocast_error + floor


def verify_graph(model: nn.Module, gm: fx.GraphModule, example_inputs: object,
                 dtype: torch.dtype, looser: float = 1.0) -> dict[str, float]:
    """Run the fp32 model, autocast and ``gm`` once on ``example_inputs``; raise
    :class:`~amprewrite.errors.VerificationError` when ``gm`` is far from fp32 (see
    :func:`verify_bound`) or non-finite where fp32 and autocast are finite. Returns the errors.

    Works in train mode as in eval mode: the three runs start from the same random state and
    draw the same dropout masks (see :class:`_Replay`), and every buffer of the model, of its
    copy and of ``gm`` is restored after each run. The model runs on a structural copy with
    cloned buffers, so the caller's state is kept; ``gm`` (which by default shares the model's
    buffers) is restored. The generators end where they began.
    """
    device = next((t.device.type for t in [*model.parameters(), *model.buffers()]), "cpu")
    copy = buffer_clone_copy(model)
    with replayed(model, copy, gm) as run:
        refs = float_leaves(run(_call, copy, example_inputs))

        def under_autocast(inputs: object) -> object:
            with torch.autocast(device, dtype=dtype):
                return _call(copy, inputs)

        try:
            autos: list[torch.Tensor] | None = float_leaves(run(under_autocast, example_inputs))
        except Exception:  # autocast itself fails (an op without a low kernel): no reference
            autos = None
        outs = float_leaves(run(_call, gm, example_inputs))
    ours = max((rel_err(o, r) for o, r in zip(outs, refs)), default=0.0)
    theirs = (math.inf if autos is None
              else max((rel_err(a, r) for a, r in zip(autos, refs)), default=0.0))
    refs_finite = all(bool(torch.isfinite(r).all()) for r in refs)
    bound = verify_bound(theirs, dtype) * looser
    if not refs_finite or ours <= bound:
        return {"error": ours, "autocast_error": theirs}
    result = compare(model, gm, example_inputs)
    culprit = result.first_nonfinite
    if culprit is None:
        nodes = {r.node: r for r in result.nodes}
        culprit = next((nodes[n.name] for n in gm.graph.nodes if n.name in nodes
                        and (nodes[n.name].rel_err or 0.0) > bound), None)
    where = ""
    if culprit is not None:
        at = f" ({culprit.module_path})" if culprit.module_path else ""
        src = f" at {culprit.source}" if culprit.source else ""
        err = "non-finite" if not culprit.finite else f"error {culprit.rel_err:.3g}"
        where = (f" The first node that departs from fp32 is '{culprit.node}'{at}{src}, "
                 f"a {culprit.precision} node ({err}).")
    kept = {s[5:] for s in getattr(gm.meta.get(M.POLICY_KEY), "keep_fp32", ())
            if isinstance(s, str) and s.startswith("node:")}
    first = culprit_node(gm, result, kept)
    sel = selector_for(first) if first is not None else None
    keep = f"keep_fp32=[{sel!r}]" if sel is not None else "keep_fp32=[<module path>]"
    raise VerificationError(
        f"the transformed graph's output error against fp32 is {ours:.3g} on the example "
        f"inputs, where torch.autocast's is {theirs:.3g} (accepted: up to {bound:.3g}).{where}",
        f" Keep that part in fp32 ({keep}, or amprewrite.find_fp32_nodes finds a list), and "
        "please report the model if the node is not one you chose to run low; "
        "verify=False skips this check.", result=result, first=first
    )


def culprit_node(gm: fx.GraphModule, result: CheckResult, kept: set[str]) -> fx.Node | None:
    """The node of ``gm`` whose move to fp32 most likely helps: the first non-finite one (the
    readers of a cast that overflows), else the node that adds the most error on top of its
    inputs'. Never a cast, an FP32 node or a node named in ``kept``."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def movable(n: fx.Node) -> bool:
        return (n.meta.get(M.CLASS) not in (None, Precision.FP32, Precision.NONFLOAT)
                and M.CAST not in n.meta and n.name not in kept)

    if result.first_nonfinite is not None:
        start = nodes[result.first_nonfinite.node]
        # A cast that overflows: the consumers that wanted the low value must go fp32.
        todo = list(start.users) if M.CAST in start.meta else [start]
        for n in todo:
            if movable(n):
                return n
    errors = {r.node: r.rel_err for r in result.nodes if r.rel_err is not None}
    best, best_gain = None, 0.0
    for r in result.nodes:
        n = nodes.get(r.node)
        if n is None or r.rel_err is None or not movable(n):
            continue
        base = max((errors.get(_through_casts(a).name, 0.0) for a in n.all_input_nodes),
                   default=0.0)
        gain = r.rel_err - base
        if gain > best_gain:
            best, best_gain = n, gain
    return best


def _through_casts(n: fx.Node) -> fx.Node:
    while M.CAST in n.meta:
        n = n.args[0]
    return n


def selector_for(node: fx.Node) -> str | None:
    """The ``keep_fp32`` entry that names ``node`` in a new capture of the same model: its
    module's path, else ``"node:<name>"`` for a node capture made; None for a cast or a node
    a pass made outside any module (a new capture does not have it)."""
    if M.CAST in node.meta:
        return None
    path = node.meta.get(M.MODULE_PATH)
    if path:
        return path
    if M.MADE_BY in node.meta:
        return None
    return f"node:{node.name}"


# How many selectors the advice of a VerificationError may add before it gives up.
_ADVICE_ROUNDS = 8


class AdviceSearch:
    """Advice for a :class:`~amprewrite.errors.VerificationError` that works as printed:
    ``keep_fp32`` selectors, added one culprit at a time (its module's path, else its captured
    node's name; never a cast), until a transform with them passes the same check. The caller's
    selectors are kept; a culprit the caller passed in ``allow_low`` gets advice that says so
    instead. The transform drives it as a loop (:func:`amprewrite.api.transform_with`):

    >>> search = AdviceSearch(Policy())
    >>> search.policy.keep_fp32, search.passed() is None
    ((), True)

    ``search.policy`` is what to transform with next; after a ``VerificationError``,
    :meth:`failed` gives the error to raise, or None to transform again with the next
    ``search.policy``; after a transform that passed, :meth:`passed` gives the first error with
    the advice that made it pass (None: the first transform passed, return it).
    ``advise=False``: the first error is raised as it is.
    """

    def __init__(self, policy: Policy, advise: bool = True) -> None:
        self.policy = policy
        self._given, self._advise = policy, advise
        self._keep, self._added = list(policy.keep_fp32), []
        self._first: VerificationError | None = None

    @property
    def searching(self) -> bool:
        """Whether the next transform is a trial of advice (not the caller's own)."""
        return self._first is not None

    def failed(self, exc: VerificationError) -> VerificationError | None:
        if self._first is None:
            if not self._advise or exc.result is None:
                return exc
            self._first = exc
        first = self._first
        sel = selector_for(exc.first) if exc.first is not None else None
        if sel is not None and sel in self._given.allow_low:
            # The user asked for it low: advice to keep it fp32 would contradict them.
            advice = (f" It is in {sel!r}, which you passed in allow_low: run low, its values "
                      f"depart from fp32 as shown. Drop {sel!r} from allow_low to have it "
                      "computed in fp32, or pass verify=False to accept this error.")
            return VerificationError(first.finding, advice, result=first.result,
                                     first=first.first, keep_fp32=None)
        if sel is None or sel in self._keep or len(self._added) > _ADVICE_ROUNDS:
            return self._error(found=False)
        self._keep.append(sel)
        self._added.append(sel)
        status(f"finding advice that passes: transform {len(self._added)} with {self._added}",
               log=True)
        self.policy = dataclasses.replace(self._given, keep_fp32=tuple(self._keep))
        return None

    def passed(self) -> VerificationError | None:
        return None if self._first is None else self._error(found=True)

    def _error(self, found: bool) -> VerificationError:
        first, added = self._first, self._added
        if found:
            advice = (f" Transformed again with keep_fp32={added!r}, it passes this check: "
                      "pass that (it keeps those modules in fp32), and please report the model "
                      "if they are not ones you chose to run low; verify=False skips this check.")
        else:
            advice = (f" No keep_fp32 list of up to {_ADVICE_ROUNDS} modules or nodes found by "
                      "transforming again made it pass (tried: "
                      f"{added!r}); keep a larger module in fp32 (keep_fp32=[<module path>]), "
                      "or verify=False to skip this check.")
        return VerificationError(first.finding, advice, result=first.result, first=first.first,
                                 keep_fp32=list(added) if found else None)
