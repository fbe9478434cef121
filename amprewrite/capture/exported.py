"""ExportedProgram in, ExportedProgram out.

``amprewrite.transform(ep, dtype)`` of a ``torch.export.ExportedProgram`` transforms the program's
module (``ep.module()``, an ATen-level GraphModule) like any model, then exports the result again
with the dynamic dimensions of ``ep``, so the program it returns takes the sizes ``ep`` takes and
``torch.export.save``/``load`` and AOTInductor accept it (docs/guide.md, "Deploying"):

- **inputs**: ``example_inputs`` if given, else the inputs ``ep`` was exported with
  (``ep.example_inputs``, kept by ``torch.export.save``/``load``); a program without any gets
  zero-filled inputs of its example sizes, enough to capture and export (an exported graph has
  no branches on values) but not to verify on;
- **dynamic shapes**: every input dimension ``ep`` holds as a symbol becomes a
  ``torch.export.Dim`` with that symbol's range from ``ep.range_constraints`` (``2 * s0`` a
  derived ``Dim``; a bound of torch's ``int_oo`` is no bound); the capture and the export again
  both use that spec;
- **mode**: a program holds the mode it was exported in as its ops' flags (``aten.dropout``'s
  ``train``, ``aten.batch_norm``'s ``training``); :func:`exported_mode` reads them, and the
  module is transformed in that mode (in train mode, as ``ep.module()`` comes, where no op
  says: train and eval then compute the same);
- **transformers' programs** (``transformers.exporters.DynamoExporter``) return a cache, whose
  pytree functions dynamo cannot trace: :func:`amprewrite.capture.trace.capture` captures such a
  module with non-strict export.

The registry classifies ATen ops by their base name (``aten::linear`` is ``F.linear``'s family),
so the program gets the decisions the ``nn.Module`` gets.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import NotVerifiedWarning
from ..graph.shapes import BATCH, split_inputs
from ..precision.policy import Policy
from ..precision.report import POLICY_KEY, REPORT_KEY, report
from ..progress import status
from .verify import TRAIN_MODE_CHECK

__all__ = [
    "ProgramInputs",
    "export_again",
    "exported_mode",
    "is_exported_program",
    "program_inputs",
    "transform_program",
]


@dataclass
class ProgramInputs:
    """What a transform of an ExportedProgram runs on, and the sizes it serves."""

    module: fx.GraphModule  # ep.module(): the program as a module of ATen ops
    args: tuple
    kwargs: dict
    # torch.export's dynamic_shapes by argument name (None: every size static)
    dynamic_shapes: dict | None
    real: bool  # False: zero-filled inputs made from the program's example sizes

    @property
    def example_inputs(self) -> tuple | dict:
        """The inputs in the form ``transform`` takes: a tuple, or a dict by argument name."""
        if not self.kwargs:
            return self.args
        return dict(inspect.signature(self.module.forward).bind(*self.args,
                                                                 **self.kwargs).arguments)


def is_exported_program(obj: object) -> bool:
    return isinstance(obj, torch.export.ExportedProgram)


# Mode flags of ATen ops, by schema argument name; ops that are one mode by name.
_MODE_ARGS = ("train", "training")
_EVAL_OPS = ("_native_batch_norm_legit_no_training",)


def exported_mode(graph: fx.Graph) -> bool | None:
    """The mode an ATen graph was exported in, as its ops' flags say: True (train), False
    (eval), None where no op says (no dropout or batch norm: both modes compute the same).

    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout()).eval()
    >>> exported_mode(torch.export.export(m, (torch.randn(1, 2),)).graph)
    False
    """
    seen: set[bool] = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        if schema.name.split("::")[-1] in _EVAL_OPS:
            seen.add(False)
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.name in _MODE_ARGS:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, bool):
                    seen.add(value)
    return True in seen if seen else None


def program_inputs(ep: torch.export.ExportedProgram, example_inputs: object = None
                   ) -> ProgramInputs:
    """The module of ``ep``, the inputs to transform it on and its dynamic dimensions."""
    module = ep.module()
    if exported_mode(ep.graph) is False:
        # ep.module() comes in train mode whatever the program was exported in, and refuses
        # eval() (its ops hold the mode): the flag alone, for the capture, verification and
        # report.
        for sub in module.modules():
            sub.training = False
    # Its one pre-hook refuses a call that splits the inputs into positional and keyword ones
    # otherwise than the export did; transform passes them all by name (a dict), which the
    # module's own code flattens the same way. The transformed graph checks its inputs itself.
    module._forward_pre_hooks.clear()
    module._forward_pre_hooks_with_kwargs.clear()
    # export asserts the dtype every ``.to()`` saw (fp32); in the mixed-precision graph those
    # values may be stored low, and each assert would cost an fp32 copy to keep it true. The
    # export again asserts what the new graph's own conversions see.
    for node in module.graph.find_nodes(op="call_function",
                                        target=torch.ops.aten._assert_tensor_metadata.default):
        module.graph.erase_node(node)
    module.recompile()
    dynamic = _dynamic_shapes(ep, module)
    real = example_inputs is not None or ep.example_inputs is not None
    if example_inputs is None:
        args, kwargs = ep.example_inputs if real else _made_inputs(ep)
    else:
        args, kwargs = split_inputs(example_inputs)
    return ProgramInputs(module, tuple(args), dict(kwargs), dynamic, real)


def export_again(gm: fx.GraphModule, inputs: ProgramInputs, dynamic_shapes: object
                 ) -> torch.export.ExportedProgram:
    """The transformed graph as an ExportedProgram, exported on ``inputs`` with
    ``dynamic_shapes``; ``amprewrite.report`` reads the transform's report from it."""
    ep = torch.export.export(gm, inputs.args, inputs.kwargs, dynamic_shapes=dynamic_shapes,
                             strict=False)
    for key in (REPORT_KEY, POLICY_KEY):
        if key in gm.meta:
            ep.graph_module.meta[key] = gm.meta[key]
    return ep


def _user_inputs(ep: torch.export.ExportedProgram) -> list[object]:
    """The program's flat user inputs: fake tensors, SymInts or constants, in call order."""
    kinds = torch.export.graph_signature.InputKind
    values = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind != kinds.USER_INPUT:
            continue
        name = getattr(spec.arg, "name", None)
        out.append(values.get(name) if name in values else getattr(spec.arg, "value", None))
    return out


def _dynamic_shapes(ep: torch.export.ExportedProgram, module: fx.GraphModule) -> dict | None:
    """``{argument: {dim: Dim}}`` for every input dimension ``ep`` holds as a symbol."""
    import sympy  # here, not at the top: it costs `import amprewrite` 0.3-0.6 s

    dims: dict[sympy.Symbol, torch.export.Dim] = {}

    def dim_of(size: torch.SymInt) -> object:
        expr = size.node.expr
        if expr.is_number:
            return None
        if len(expr.free_symbols) != 1:
            return torch.export.Dim.DYNAMIC  # torch.export infers its relation again
        (sym,) = expr.free_symbols
        if sym not in dims:
            vr = ep.range_constraints.get(sym)
            lo = _finite(vr.lower) if vr is not None else None
            hi = _finite(vr.upper) if vr is not None else None
            dims[sym] = torch.export.Dim(_user_name(size, sym), min=lo or 0, max=hi)
        root = dims[sym]
        scale, offset = expr.coeff(sym), expr.subs(sym, 0)
        if expr == sym:
            return root
        if (sympy.expand(scale * sym + offset - expr) == 0 and scale.is_Integer
                and offset.is_Integer):
            return root * int(scale) + int(offset)
        return torch.export.Dim.DYNAMIC

    leaves = []
    for value in _user_inputs(ep):
        spec = None
        if isinstance(value, torch.Tensor):
            spec = {i: d for i, s in enumerate(value.shape) if isinstance(s, torch.SymInt)
                    and (d := dim_of(s)) is not None} or None
        leaves.append(spec)
    if not dims:
        return None
    args, kwargs = _shapes_tree(ep.call_spec.in_spec, iter(leaves))
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


def _user_name(size: torch.SymInt, sym: object) -> str:
    """The name the exporter gave ``sym`` (``Dim("batch")`` -> ``"batch"``), so that notes and
    errors speak of the user's dimensions; the symbol's own name (``s77``) where the program
    no longer knows it (one loaded by ``torch.export.load``, or a ``Dim.AUTO`` dimension)."""
    env = getattr(size.node, "shape_env", None)
    names = getattr(env, "source_name_to_debug_name", None) or {}
    for source in (getattr(env, "var_to_sources", None) or {}).get(sym, ()):
        key = source.name() if callable(source.name) else source.name  # a method before 2.9
        name = names.get(key)
        if isinstance(name, str) and name.isidentifier():
            return name
    return str(sym)


def _shapes_tree(spec: pytree.TreeSpec, leaves: Iterator[object]) -> object:
    """The ``dynamic_shapes`` structure torch.export compares with inputs of structure ``spec``:
    containers, dataclasses and namedtuples of the children's specs, and for any other node (a
    transformers cache) the list of its children's, as torch.export flattens such a node one
    level. (Unflattening the specs into a cache hands a cache where a list is expected.)"""
    if spec.is_leaf():
        return next(leaves)
    if spec.type is type(None):
        return None
    children = [_shapes_tree(spec.child(i), leaves) for i in range(spec.num_children)]
    if (spec.type in (tuple, list, dict, collections.OrderedDict, collections.defaultdict)
            or dataclasses.is_dataclass(spec.type) or pytree.is_namedtuple_class(spec.type)):
        return pytree.SUPPORTED_NODES[spec.type].unflatten_fn(children, spec.context)
    return children


def _finite(bound: object) -> int | None:
    """A range bound as an int, or None when it is infinite. torch writes an unbounded size as
    its own ``int_oo``, a sympy number that calls itself finite (``is_finite`` is True) and that
    ``int()`` cannot convert; ``float()`` of it is ``inf``, as of sympy's ``oo``."""
    value = float(bound)
    return int(value) if math.isfinite(value) else None


def _made_inputs(ep: torch.export.ExportedProgram) -> tuple[tuple, dict]:
    """Zero-filled inputs of the program's example sizes (the size hint of a dynamic one, else
    the smallest size of its range above 1), for a program that keeps no example inputs."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    def size(s: object) -> int:
        if isinstance(s, int):
            return s
        vr = ep.range_constraints.get(s.node.expr)
        return optimization_hint(s, fallback=max(int(vr.lower) if vr is not None else 2, 2))

    def make(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return torch.zeros([size(s) for s in value.shape], dtype=value.dtype,
                               device=value.device)
        if isinstance(value, torch.SymInt):
            return size(value)
        return value

    return pytree.tree_unflatten([make(v) for v in _user_inputs(ep)], ep.call_spec.in_spec)


def transform_program(ep: torch.export.ExportedProgram, policy: Policy, example_inputs: object,
                      transform_with: Callable[..., fx.GraphModule], on_pass=None
                      ) -> torch.export.ExportedProgram:
    """ExportedProgram in, ExportedProgram out (:mod:`amprewrite.capture.exported`): the program's
    module transformed on its example inputs with its dynamic dimensions, exported again."""
    inputs = program_inputs(ep, example_inputs)
    if isinstance(policy.dynamic_shapes, str) and policy.dynamic_shapes == BATCH:
        policy = dataclasses.replace(policy, dynamic_shapes=inputs.dynamic_shapes)  # as ep's
    verify = policy.verify and inputs.real
    gm = transform_with(inputs.module, dataclasses.replace(policy, verify=verify),
                        inputs.example_inputs, on_pass)
    if exported_mode(ep.graph) is None:  # the module's mode says nothing: ep.module()'s default
        notes = report(gm).notes
        notes[:] = [("captured from an ExportedProgram with no mode-dependent op (dropout, "
                     "batch norm): train and eval compute the same"
                     if n.startswith("captured by ") else n.replace(TRAIN_MODE_CHECK, ""))
                    for n in notes]
    if policy.verify and not inputs.real:
        why = ("the ExportedProgram keeps no example inputs (ep.example_inputs is None), so it "
               "was captured and exported on zero-filled inputs of its example sizes and not "
               "verified; pass example_inputs=(...) to have it checked against fp32 and autocast")
        report(gm).notes.append(f"verify: not run: {why}")
        warnings.warn(NotVerifiedWarning(f"amprewrite.transform: {why} (or verify=False)."),
                      # user -> transform -> transform_with -> here
                      stacklevel=4)
    status("exporting the transformed graph")
    return export_again(gm, inputs, policy.dynamic_shapes)
