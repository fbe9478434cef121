"""Make an ONNX file written from an amprewrite graph lean, without changing what it computes.

``torch.onnx.export`` translates the transformed graph op by op: every weight the plan reads in
float16 is stored float32 and cast when the file runs, the shape arithmetic of each ``view``
comes as its own ``Constant``/``Cast``/``Concat`` nodes, and each node carries torch's stack
trace as metadata (1.5 MB of the 2.1 MB zoo GPT-2 file). :func:`lean` removes all of that with
rewrites that are exact, value for value:

- a ``Cast`` or ``CastLike`` of a constant (an initializer or a ``Constant`` node) becomes the
  cast constant: a float32 weight read only through casts to float16 is stored float16, the
  rounding the file would have made when it runs, made once when it is written. A weight also
  read in float32 (GPT-2's embedding, tied to its float16 head) stays float32 with its cast
  (but see ``tables`` below), and an initializer's cast to a wider float type stays a cast
  (storing the wider copy would grow the file);
- a cast to the type its input already has, an ``Identity``, and a widening round trip
  (``float16 -> float32 -> float16``: every float16 is a float32) read their input instead;
- two casts of one value to one type are one;
- then onnxscript's constant folding, common-subexpression elimination and dead-node removal,
  and those of its optimizer's pattern rewrites that replace a node by its input (``x + 0``,
  ``x * 1``, a ``Gemm``'s all-zero bias; not the others: one folds a batch norm kept in float32
  into the float16 Conv before it, see ``deploy._write_onnx``);
- node metadata and doc strings are dropped (torch's stack traces, not read by any runtime).

A lossy cast pair (``float32 -> float16 -> float32``) is a rounding the plan asked for and stays.

One rule is a rounding, not a rewrite, and runs only when asked (``lean(model, tables=True)``;
:func:`amprewrite.deploy.export.export` asks for it in a float16 ONNX file): a float32 initializer
read only as the table of lookups (``Gather``, ``GatherElements``, ``GatherND``: an embedding) and
by casts to float16 is stored float16, and each lookup's result is cast to float32 after it. A
lookup commutes with a cast, so the file computes exactly what it did with the table rounded to
float16 and widened: the rows it reads are rounded, nothing else. The plan keeps such a lookup
fp32 because it feeds the fp32 residual stream and norms (an exact op in fp32 needs no cast),
which stores a vocabulary table at twice the bytes; rounding the table adds one float16 rounding
to each embedding row (relative 2**-11 at most) and halves the file's largest tensor. A table
read by a float16 matmul too (GPT-2's embedding, tied to its head) is then stored once, float16.
Not when the file has no float16 cast (a bfloat16 or float32 file), nor for a table past
float16's range or more than :data:`amprewrite.precision.ranges.TINY_SHARE` of whose nonzero values
would be float16 subnormals.

One more runs only when asked (``lean(model, bias=True)``; :func:`amprewrite.deploy.export.export`
asks for it in a float16 ONNX file), and it removes a rounding: ``torch.onnx`` writes a float16
``linear`` as a ``MatMul`` and an ``Add`` of its bias, each rounded to float16, where PyTorch's
kernel (and cuBLAS's epilogue) adds the bias before its one rounding. Where the sum is only
widened to float32 after (a linear that feeds the fp32 residual stream), the widening moves
before the ``Add``, which then adds the float16 bias in float32: one rounding, as in the graph
the file was written from, and the same number of nodes.

And ``lean(model, softmax=True)`` (asked for in a float16 file too) computes a float16
``Softmax`` in float32, between a cast to float32 and one back: ``torch.onnx`` writes
``scaled_dot_product_attention`` as its math (``MatMul``, ``Softmax``, ``MatMul``), where
PyTorch's fused attention kernels keep the softmax in float32 inside; the plan computes a
softmax of its own in fp32 too (``ops.py``). onnxruntime's CPU provider has no float16 Softmax
kernel and expands it into five ops; float32's is one.

A file with control flow (If, Loop, Scan) gets only onnxscript's passes and the metadata drop:
its subgraphs read outer values by name, which the rewrites above do not follow.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["cast_count", "lean"]

# (from, through) pairs for which from -> through -> from is the identity: every value of
# `from` is exactly a value of `through`.
_WIDENING = {
    (TensorProto.FLOAT16, TensorProto.FLOAT), (TensorProto.FLOAT16, TensorProto.DOUBLE),
    (TensorProto.BFLOAT16, TensorProto.FLOAT), (TensorProto.BFLOAT16, TensorProto.DOUBLE),
    (TensorProto.FLOAT, TensorProto.DOUBLE),
}


# Cast targets folded at write time: numpy's astype gives onnxruntime's Cast bit for bit
# (float32 -> float16 checked on 3 million values: random bit patterns, every midpoint between
# neighbouring float16 values, subnormals, overflow). Not bfloat16 or float8: older runtimes
# truncate to bfloat16, and numpy has no float8 to check against.
_FOLDABLE = {
    TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BOOL,
    TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
    TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
}


def cast_count(model: onnx.ModelProto) -> int:
    """How many ``Cast`` and ``CastLike`` nodes the main graph has."""
    return sum(n.op_type in ("Cast", "CastLike") for n in model.graph.node)


def lean(model: onnx.ModelProto, tables: bool = False, bias: bool = False,
         softmax: bool = False) -> onnx.ModelProto:
    """``model`` with its constant casts folded, exact redundant casts and dead nodes removed
    and node metadata dropped; it computes the same values. ``model`` itself is not changed.

    ``tables=True`` also stores the float32 lookup tables of a float16 file float16 (see the
    module's docstring): the file then computes what ``model`` computes with those tables
    rounded to float16. ``bias=True`` adds the bias of a float16 ``MatMul`` whose sum is only
    widened after in float32 (see the module's docstring): one rounding fewer.
    ``softmax=True`` computes each float16 ``Softmax`` in float32, cast back after.

    >>> import numpy as np, onnx
    >>> from onnx import helper as h, TensorProto as T, numpy_helper
    >>> w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    >>> g = h.make_graph([h.make_node("Cast", ["w"], ["w16"], to=T.FLOAT16),
    ...                   h.make_node("MatMul", ["x", "w16"], ["y"])], "g",
    ...                  [h.make_tensor_value_info("x", T.FLOAT16, [2, 2])],
    ...                  [h.make_tensor_value_info("y", T.FLOAT16, [2, 2])], [w])
    >>> out = lean(h.make_model(g, opset_imports=[h.make_opsetid("", 20)]))
    >>> [n.op_type for n in out.graph.node], out.graph.initializer[0].data_type == T.FLOAT16
    (['MatMul'], True)
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    # Subgraphs (If, Loop, Scan) read outer values by name, which these passes do not follow:
    # such a file gets only onnxscript's passes, which do.
    flat = not any(_has_subgraph(n) for n in out.graph.node)
    if tables and flat:
        _store_tables_low(out.graph)
    for _ in range(4 if flat else 0):  # each round can expose more (a folded cast feeds a cast)
        before = len(out.graph.node), len(out.graph.initializer)
        _fold_constant_casts(out.graph)
        _bypass_exact(out.graph, _types(out))
        _dedupe_casts(out.graph)
        _drop_dead(out.graph)
        if (len(out.graph.node), len(out.graph.initializer)) == before:
            break
    if bias and flat:
        _widen_before_bias(out.graph, _types(out))
    if softmax and flat:
        _softmax_in_float32(out.graph, _types(out))
    out = _onnxscript_folds(out)
    if flat:
        _fold_constant_casts(out.graph)
        _bypass_exact(out.graph, _types(out))
        _drop_dead(out.graph)
    for node in out.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.shape_inference.infer_shapes(out, strict_mode=True)  # raises if a type went stale
    return out


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type the file declares or ONNX infers."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # an op ONNX cannot infer: the declared types are enough, fewer folds
        inferred = model
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*g.value_info, *g.input, *g.output] if v.type.HasField("tensor_type")}
    types.update((i.name, i.data_type) for i in g.initializer)
    for node in g.node:
        if node.op_type == "Cast":
            types[node.output[0]] = _attr(node, "to")
    return {k: v for k, v in types.items() if v}


def _attr(node: onnx.NodeProto, name: str) -> object:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    users: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            users[name].append(node)
    return users


def _fold_constant_casts(graph: onnx.GraphProto) -> None:
    """A Cast/CastLike of a Constant node, or of an initializer every reader of which casts it
    to one type, becomes the cast constant."""
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    inits = {i.name: i for i in graph.initializer}
    infos = {v.name: v for v in graph.value_info if v.type.HasField("tensor_type")}
    declared = {v.name: v.type.tensor_type.elem_type
                for v in [*graph.value_info, *graph.input, *graph.output]
                if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    kept = {i.name for i in graph.input} | {o.name for o in graph.output}
    users = _consumers(graph)
    renames: dict[str, str] = {}  # a removed weight cast's output -> the (now cast) weight
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        to = (_cast_target(node, declared, constants, inits)
              if node.op_type in ("Cast", "CastLike") and node.input else None)
        if node.output[0] in renames:
            continue
        if to not in _FOLDABLE:
            nodes.append(node)
            continue
        source = node.input[0]
        value = _attr(constants[source], "value") if source in constants else None
        if isinstance(value, onnx.TensorProto):
            cast = numpy_helper.to_array(value).astype(onnx.helper.tensor_dtype_to_np_dtype(to))
            nodes.append(onnx.helper.make_node(
                "Constant", [], [node.output[0]],
                value=numpy_helper.from_array(cast, node.output[0])))
            continue
        readers = users[source]
        if (source in inits and source not in kept
                and not _widens_float(inits[source].data_type, to)
                and all(r.op_type in ("Cast", "CastLike") and r.input[0] == source
                        and _cast_target(r, declared, constants, inits) == to for r in readers)):
            init = inits[source]
            array = numpy_helper.to_array(init).astype(onnx.helper.tensor_dtype_to_np_dtype(to))
            init.CopyFrom(numpy_helper.from_array(array, source))
            if source in infos:  # its declared type follows
                infos[source].type.tensor_type.elem_type = to
            renames.update((r.output[0], source) for r in readers)
            continue
        nodes.append(node)
    for node in nodes:
        for k, name in enumerate(node.input):
            node.input[k] = renames.get(name, name)
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes):
        copy.CopyFrom(node)
    outputs = {o.name for o in graph.output}
    # a graph output keeps its name
    copies += [onnx.helper.make_node("Identity", [new], [old])
               for old, new in renames.items() if old in outputs]
    del graph.node[:]
    graph.node.extend(copies)


_LOOKUPS = ("Gather", "GatherElements", "GatherND")


def _store_tables_low(graph: onnx.GraphProto) -> list[str]:
    """Float32 initializers read only as lookup tables and by casts to float16 become float16,
    with a cast to float32 after each lookup; returns their names. Not in a file without a
    cast to float16, nor for a table float16 would overflow or store mostly subnormal.

    Matches:      table(f32) -> Gather -> y(f32);  table(f32) -> Cast(to=f16) -> t16
    Rewrite to:   table(f16) -> Gather -> Cast(to=f32) -> y;  table(f16) -> Cast(to=f16) -> t16
    (the second cast, to the type it reads, is then bypassed by :func:`_bypass_exact`).
    """
    from ..precision.ranges import TINY_SHARE

    casts = [n for n in graph.node if n.op_type == "Cast"]
    if not any(_attr(n, "to") == TensorProto.FLOAT16 for n in casts):
        return []
    users = _consumers(graph)
    kept = {i.name for i in graph.input} | {o.name for o in graph.output}
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.initializer}
    infos = {v.name: v for v in graph.value_info if v.type.HasField("tensor_type")}
    tiny = float(np.finfo(np.float16).tiny)
    stored: list[str] = []
    after: dict[int, onnx.NodeProto] = {}  # id of a lookup -> the cast that follows it
    for init in graph.initializer:
        readers = users.get(init.name, [])
        lookups = [r for r in readers if r.op_type in _LOOKUPS and r.input[0] == init.name
                   and init.name not in r.input[1:]]
        if (init.data_type != TensorProto.FLOAT or init.name in kept or not lookups
                or not all(r in lookups or (r.op_type == "Cast" and _attr(r, "to")
                                            == TensorProto.FLOAT16) for r in readers)):
            continue
        table = numpy_helper.to_array(init)
        magnitude = np.abs(table[table != 0])
        if magnitude.size and (magnitude.max() > np.finfo(np.float16).max
                               or (magnitude < tiny).mean() > TINY_SHARE):
            continue
        init.CopyFrom(numpy_helper.from_array(table.astype(np.float16), init.name))
        if init.name in infos:
            infos[init.name].type.tensor_type.elem_type = TensorProto.FLOAT16
        for lookup in lookups:
            wide = lookup.output[0]
            low = _fresh(f"{wide}_f16", taken)
            lookup.output[0] = low
            after[id(lookup)] = onnx.helper.make_node("Cast", [low], [wide],
                                                      to=TensorProto.FLOAT)
        stored.append(init.name)
    nodes = [m for n in graph.node for m in ([n, after[id(n)]] if id(n) in after else [n])]
    _set_nodes(graph, nodes)
    return stored


def _widen_before_bias(graph: onnx.GraphProto, types: dict[str, int]) -> int:
    """Add a float16 MatMul's float16 bias in float32 where the sum is only widened after;
    returns how many. The float16 bias is widened exactly (a float32 copy of its values).

    Matches:      MatMul -> y(f16);  Add(y, b(f16 initializer)) -> s(f16);  Cast(s, to=f32) -> z
    Rewrite to:   MatMul -> y(f16);  Cast(y, to=f32) -> y32;  Add(y32, b(f32)) -> z
    (``y`` and ``s`` read by nothing else, ``s`` not an output of the graph).
    """
    users = _consumers(graph)
    made = {o for n in graph.node for o in n.output}
    inits = {i.name: i for i in graph.initializer}
    kept = {o.name for o in graph.output}
    taken = made | set(inits) | {i.name for i in graph.input}
    wide: dict[str, str] = {}  # float16 bias -> its float32 copy
    moved: dict[int, onnx.NodeProto] = {}  # index of an Add -> the Cast now before it
    index_of = {n.output[0]: i for i, n in enumerate(graph.node) if n.output}
    producers = {o: n for n in graph.node for o in n.output}
    stale: set[str] = set()
    for i, add in enumerate(graph.node):
        if add.op_type != "Add" or len(add.input) != 2 or add.output[0] in kept:
            continue
        for y, b in (add.input, add.input[::-1]):
            mm = producers.get(y)
            init = inits.get(b)
            after = users.get(add.output[0], [])
            if (mm is None or mm.op_type != "MatMul" or init is None
                    or init.data_type != TensorProto.FLOAT16 or users.get(y) != [add]
                    or types.get(y) != TensorProto.FLOAT16 or len(after) != 1
                    or after[0].op_type != "Cast" or _attr(after[0], "to") != TensorProto.FLOAT):
                continue
            cast = after[0]
            if b not in wide:
                wide[b] = _fresh(f"{b}_f32", taken)
                graph.initializer.append(numpy_helper.from_array(
                    numpy_helper.to_array(init).astype(np.float32), wide[b]))
            z = cast.output[0]
            y32 = _fresh(f"{y}_f32", taken)
            stale.add(add.output[0])
            cast.input[0], cast.output[0] = y, y32
            add.input[0], add.input[1], add.output[0] = y32, wide[b], z
            moved[i] = index_of[z]
            break
    if not moved:
        return 0
    casts = set(moved.values())
    nodes = [m for i, n in enumerate(graph.node) if i not in casts
             for m in ([graph.node[moved[i]], n] if i in moved else [n])]
    _set_nodes(graph, nodes)
    infos = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return len(moved)


def _softmax_in_float32(graph: onnx.GraphProto, types: dict[str, int]) -> int:
    """Each Softmax of a float16 tensor reads it cast to float32 and is cast back to float16
    after; returns how many.

    Matches:      Softmax(x(f16)) -> y(f16)
    Rewrite to:   Cast(x, to=f32) -> x32;  Softmax(x32) -> y32;  Cast(y32, to=f16) -> y
    """
    taken = ({o for n in graph.node for o in n.output} | {i.name for i in graph.initializer}
             | {i.name for i in graph.input})
    around: dict[int, tuple[onnx.NodeProto, onnx.NodeProto]] = {}  # node index -> casts
    for index, node in enumerate(graph.node):
        if node.op_type != "Softmax" or types.get(node.input[0]) != TensorProto.FLOAT16:
            continue
        x32, y32 = _fresh(f"{node.input[0]}_f32", taken), _fresh(f"{node.output[0]}_f32", taken)
        up = onnx.helper.make_node("Cast", [node.input[0]], [x32], to=TensorProto.FLOAT)
        down = onnx.helper.make_node("Cast", [y32], [node.output[0]], to=TensorProto.FLOAT16)
        node.input[0], node.output[0] = x32, y32
        around[index] = (up, down)
    if not around:
        return 0
    nodes = [m for i, n in enumerate(graph.node)
             for m in ([around[i][0], n, around[i][1]] if i in around else [n])]
    _set_nodes(graph, nodes)
    return len(around)


def _set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Make ``nodes`` (some of them the graph's own) the graph's node list, in that order."""
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes):
        copy.CopyFrom(node)  # copied first: clearing the list frees the graph's own messages
    del graph.node[:]
    graph.node.extend(copies)


def _fresh(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    taken.add(name)
    return name


_FLOATS = (TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE)


def _widens_float(source: int, to: int) -> bool:
    """A float-to-wider-float cast (a float16 table widened after its lookup, folded, would
    store the table at float32's bytes again)."""
    return (source in _FLOATS and to in _FLOATS
            and _FLOATS.index(to) > _FLOATS.index(source) and (source, to) in _WIDENING)


def _cast_target(node: onnx.NodeProto, declared: dict[str, int],
                 constants: dict[str, onnx.NodeProto],
                 inits: dict[str, onnx.TensorProto]) -> int | None:
    """The element type a Cast or CastLike node casts to, where the file says it."""
    if node.op_type == "Cast":
        return _attr(node, "to")  # type: ignore[return-value]
    like = node.input[1] if len(node.input) > 1 else ""
    if like in inits:
        return inits[like].data_type
    if like in constants:
        value = _attr(constants[like], "value")
        return value.data_type if isinstance(value, onnx.TensorProto) else None
    return declared.get(like)


def _bypass_exact(graph: onnx.GraphProto, types: dict[str, int]) -> None:
    """Readers of an Identity, of a cast to its input's own type, or of the second cast of a
    widening round trip read the value before it."""
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    renames: dict[str, str] = {}
    for node in graph.node:
        if not node.input or node.output[0] in outputs:
            continue
        source = node.input[0]
        if node.op_type == "Identity":
            renames[node.output[0]] = source
        elif node.op_type == "Cast":
            to = _attr(node, "to")
            first = producer.get(source)
            if types.get(source) == to:
                renames[node.output[0]] = source
            elif (first is not None and first.op_type == "Cast"
                  and types.get(first.input[0]) == to
                  and (to, _attr(first, "to")) in _WIDENING):
                renames[node.output[0]] = first.input[0]
    _apply(graph, renames)


def _apply(graph: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Every reader of a renamed value reads its replacement (followed to the end of a chain)."""
    def final(name: str) -> str:
        while name in renames:
            name = renames[name]
        return name

    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in renames:
                node.input[k] = final(name)


def _dedupe_casts(graph: onnx.GraphProto) -> None:
    """Casts of one value to one type: the first one's output serves every reader."""
    outputs = {o.name for o in graph.output}
    seen: dict[tuple, str] = {}
    renames: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "Cast":
            continue
        key = (node.input[0], _attr(node, "to"))
        if key in seen and node.output[0] not in outputs:
            renames[node.output[0]] = seen[key]
        else:
            seen.setdefault(key, node.output[0])
    _apply(graph, renames)


def _drop_dead(graph: onnx.GraphProto) -> None:
    """Nodes whose outputs nothing reads, and initializers nothing reads."""
    live = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(o in live for o in node.output) or _has_subgraph(node):
            kept.append(node)
            live.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    inits = [i for i in graph.initializer if i.name in live]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    known = live | {o for n in graph.node for o in n.output}
    infos = [v for v in graph.value_info if v.name in known]
    del graph.value_info[:]
    graph.value_info.extend(infos)


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute)


def _fold_unless_weight_cast(node) -> bool | None:
    """onnxscript's folding rule, except for a cast of an initializer that something else
    also reads in its own type (folding it would store the weight twice) or that widens a
    float (a table stored float16 on purpose). Any other cast that is the initializer's only
    reader folds: a mask's bool to int64 cast, so the chain after it folds too and the file
    reads a constant instead of computing it at every run."""
    source = node.inputs[0] if node.op_type in ("Cast", "CastLike") and node.inputs else None
    if source is None or not source.is_initializer():
        return None
    into = node.outputs[0].dtype
    widens = (source.dtype is not None and source.dtype.is_floating_point()
              and into is not None and into.itemsize > source.dtype.itemsize)
    if widens or len(source.uses()) > 1:
        return False
    return None


def _identities():
    """The pattern rewrites of onnxscript's optimizer that replace a node by its input: ``x + 0``,
    ``x - 0``, ``x * 1``, ``x / 1``, an inference ``Dropout``, a ``Transpose`` or ``Expand`` that
    changes nothing, and an all-zero bias of a ``Gemm`` or ``Conv`` (``torch.onnx`` applies them
    to a float32 file; a freshly initialised Hugging Face model's biases are zero). Not its
    others: two casts made one, or a batch norm folded into a float16 convolution, round
    differently."""
    from onnxscript import rewriter
    from onnxscript.rewriter.rules import common as rules

    return rewriter.RewritePass(rewriter.RewriteRuleSet([
        *rules.mul_by_1_rule.commute(), *rules.add_0_rule.commute(), rules.sub_0_rule,
        rules.div_by_1_rule, rules.dropout_zero_rule, rules.dropout_inference_rule,
        rules.no_op_transpose_rule, rules.no_op_expand_rule,
        rules.remove_optional_bias_from_gemm_rule, rules.remove_optional_bias_from_conv_rule,
        rules.remove_optional_bias_from_conv_transpose_rule]))


def _onnxscript_folds(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's constant folding, CSE and dead-node passes, and of its pattern rewrites
    those that replace a node by its input (:func:`_identities`)."""
    from onnxscript import ir
    from onnxscript.ir.passes import common
    from onnxscript.optimizer import _constant_folding

    irmodel = ir.serde.deserialize_model(model)
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([_constant_folding.FoldConstantsPass(
            shape_inference=True, input_size_limit=8192, output_size_limit=262144,
            should_fold=_fold_unless_weight_cast), _identities(),
            common.RemoveUnusedNodesPass()], steps=2, early_stop=True),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
    )(irmodel)
    return ir.serde.serialize_model(irmodel)
