"""Run an ONNX file with every tensor it declares float16 (or bfloat16) really rounded.

onnxruntime's CPU provider has no float16 kernel for most ops (Mul, Div, Pow, Sqrt, Softmax,
ReduceMean, ...): it runs them in float32 between casts it inserts, and then removes the
``float32 -> float16 -> float32`` pairs it made, at every optimisation level (measured,
onnxruntime 1.32: a float16 ``x * 1000 / 1000`` of ``x = 300`` gives 300, not inf). An
overflow that any float16 runtime would meet (CUDA, TensorRT, DirectML, a phone's NPU) never
shows there.

:func:`rounded` rewrites the file into one that computes every op in float32 and rounds each
value the file declares low precision to that precision before anything reads it: each such
value ``t`` becomes ``Cast(Cast(t, to=FLOAT16), to=FLOAT)``; low-precision inputs and
initializers are widened (exactly). So every op reads exactly the low-precision values the file
declares, computes in float32 (what the float16 kernels of GPUs do inside: tensor-core matmuls
and convolutions accumulate in float32, elementwise kernels compute in float32) and its result
is rounded as the file declares: a value past 65504 becomes inf. The rewritten file is run in
onnxruntime with graph optimisations off, so no cast pair is removed (the cast pairs are
ordinary ops of a float32 graph there; :func:`run_rounded` checks that they round).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["LOW_TYPES", "RoundedSession", "rounded", "run_rounded"]

LOW_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
"""The element types :func:`rounded` rounds to."""

_SUFFIX = "__amp_declared"


def rounded(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float32 model that computes what ``model`` computes, with every value ``model``
    declares float16/bfloat16 rounded to it. Inputs and outputs declared low become float32
    (holding low-precision values). ``model`` is not changed.

    Raises ValueError when the type of a node's output is unknown (ONNX's shape inference
    cannot type it), since its rounding could not be placed, or when the graph has subgraphs
    (If, Loop, Scan), which this does not rewrite.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    try:
        out = onnx.shape_inference.infer_shapes(out)
    except Exception as exc:
        raise ValueError(f"ONNX shape inference fails on the file: {exc}") from None
    g = out.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in g.node for a in n.attribute):
        raise ValueError("the file has control flow (If, Loop or Scan), whose subgraphs are "
                         "not rewritten")
    # A sequence (SplitToSequence) counts as typed: its tensors are rounded where they are
    # taken out of it (SequenceAt), and were made from rounded values.
    types = {v.name: v.type.tensor_type.elem_type if v.type.HasField("tensor_type") else -1
             for v in [*g.value_info, *g.input, *g.output] if v.type.WhichOneof("value")}
    types.update((i.name, i.data_type) for i in g.initializer)
    unknown = [o for n in g.node for o in n.output if o and not types.get(o)]
    if unknown:
        raise ValueError(f"the element type of {len(unknown)} value(s) is unknown "
                         f"({', '.join(unknown[:3])}), so their rounding cannot be placed")
    nodes: list[onnx.NodeProto] = []
    # Inputs and initializers declared low: widened (exact) under their own name.
    for vi in g.input:
        if vi.type.tensor_type.elem_type in LOW_TYPES:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for init in g.initializer:
        if init.data_type in LOW_TYPES:
            init.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(init).astype(np.float32), init.name))
    for node in g.node:
        low = [(k, o) for k, o in enumerate(node.output) if o and types[o] in LOW_TYPES]
        for k, name in low:
            node.output[k] = name + _SUFFIX
        nodes.append(node)
        for _, name in low:
            nodes += [onnx.helper.make_node("Cast", [name + _SUFFIX], [name + "__amp_low"],
                                            to=types[name]),
                      onnx.helper.make_node("Cast", [name + "__amp_low"], [name],
                                            to=TensorProto.FLOAT)]
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes):
        copy.CopyFrom(node)
    del g.node[:]
    g.node.extend(copies)
    for vi in g.output:
        if vi.type.tensor_type.elem_type in LOW_TYPES:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    del g.value_info[:]  # the low values' types changed; onnxruntime infers them again
    return out


class RoundedSession:
    """:func:`rounded` of a file, loaded in onnxruntime (CPU, graph optimisations off).

    ``run(feeds)`` takes the feeds the original file takes (low-precision arrays included)
    and returns its outputs in the dtypes the original file declares.
    """

    def __init__(self, model: onnx.ModelProto | str | os.PathLike) -> None:
        import onnxruntime

        if not isinstance(model, onnx.ModelProto):
            model = onnx.load(os.fspath(model))
        self._out_types = [o.type.tensor_type.elem_type for o in model.graph.output]
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        self.session = onnxruntime.InferenceSession(
            rounded(model).SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        wide = {k: v.astype(np.float32) if v.dtype == np.float16 else v
                for k, v in feeds.items()}
        outs = self.session.run(None, wide)
        return [o.astype(np.float16) if t == TensorProto.FLOAT16 else o
                for o, t in zip(outs, self._out_types)]


def run_rounded(model: onnx.ModelProto | str | os.PathLike,
                feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` once on ``feeds`` with every low-precision value really rounded.

    >>> import numpy as np
    >>> from onnx import helper as h, TensorProto as T
    >>> k = h.make_tensor("k", T.FLOAT16, [], [1000.0])
    >>> g = h.make_graph([h.make_node("Mul", ["x", "k"], ["a"]),
    ...                   h.make_node("Div", ["a", "k"], ["y"])], "g",
    ...                  [h.make_tensor_value_info("x", T.FLOAT16, [2])],
    ...                  [h.make_tensor_value_info("y", T.FLOAT16, [2])], [k])
    >>> m = h.make_model(g, opset_imports=[h.make_opsetid("", 20)], ir_version=10)
    >>> run_rounded(m, {"x": np.array([3, 300], np.float16)})[0]  # 300 * 1000 > 65504
    array([ 3., inf], dtype=float16)
    """
    return RoundedSession(model).run(feeds)

