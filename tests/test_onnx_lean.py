"""amprewrite.onnx_lean: an exported ONNX file made lean by exact rewrites only (the same
outputs, bit for bit, in onnxruntime)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from amprewrite.onnx_lean import cast_count, lean  # noqa: E402


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def cast(src, dst, to):
    return h.make_node("Cast", [src], [dst], to=to)


def mixed_model():
    """A float32 input through float16 matmuls: a weight read only in float16, a weight read
    in float16 and float32 (tied), a widening round trip, a lossy one, duplicate casts, an
    Identity, a cast of a Constant and node metadata."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    tied = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "tied")
    nodes = [
        cast("x", "x16", T.FLOAT16), cast("x", "x16b", T.FLOAT16),  # duplicates
        cast("w", "w16", T.FLOAT16), cast("w", "w16b", T.FLOAT16),  # weight cast twice
        h.make_node("MatMul", ["x16", "w16"], ["m"]),
        h.make_node("MatMul", ["x16b", "w16b"], ["m2"]),
        cast("m", "m32", T.FLOAT), cast("m32", "m16", T.FLOAT16),  # widening round trip
        h.make_node("Identity", ["m16"], ["mi"]),
        cast("tied", "tied16", T.FLOAT16),
        h.make_node("MatMul", ["mi", "tied16"], ["p"]),
        h.make_node("Add", ["p", "m2"], ["p2"]),
        cast("p2", "p32", T.FLOAT),
        h.make_node("MatMul", ["p32", "tied"], ["q"]),  # the tied weight read in float32
        cast("q", "q16", T.FLOAT16), cast("q16", "q32", T.FLOAT),  # lossy: the plan's
        h.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
            np.array(0.5, np.float64), "c")),
        h.make_node("CastLike", ["c", "q32"], ["c32"]),
        h.make_node("Mul", ["q32", "c32"], ["y"]),
    ]
    for node in nodes:
        node.metadata_props.add(key="pkg.torch.onnx.stack_trace", value="File ... " * 50)
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 8])], [w, tied])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)


def test_lean_removes_only_what_is_exact_and_keeps_the_outputs_bit_for_bit():
    model = mixed_model()
    before = model.SerializeToString()
    out = lean(model)
    assert model.SerializeToString() == before  # the caller's model is not modified
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(out, {"x": x})[0], run(model, {"x": x})[0])
    inits = {i.name: i.data_type for i in out.graph.initializer}
    # read only through casts to float16: stored float16; the tied weight stays float32,
    # once (no float16 copy beside it)
    assert inits["w"] == T.FLOAT16 and inits["tied"] == T.FLOAT
    assert [i for i, t in inits.items() if i not in ("w", "tied") and t == T.FLOAT16] == []
    casts = [(n.input[0], n.attribute[0].i) for n in out.graph.node if n.op_type == "Cast"]
    # x to float16 once, tied to float16 (it is also read in float32), p2 up for the float32
    # MatMul, and the lossy q -> float16 -> float32 pair the plan asked for; no CastLike
    assert sorted(casts) == sorted([("x", T.FLOAT16), ("tied", T.FLOAT16), ("p2", T.FLOAT),
                                    ("q", T.FLOAT16), ("q16", T.FLOAT)])
    assert cast_count(out) == 5 and cast_count(model) == 11
    assert not any(n.op_type == "Identity" for n in out.graph.node)
    assert not any(n.metadata_props for n in out.graph.node)


def test_a_zoo_gpt2_file_gets_lean_with_the_same_outputs(tmp_path):
    import amprewrite
    from amprewrite.testing import zoo

    model, (ids,) = zoo.gpt2()
    gm = amprewrite.transform(model, torch.float16, example_inputs=(ids,), dynamic_shapes=None)
    ep = torch.export.export(gm, (ids,))
    path = tmp_path / "gpt2.onnx"
    torch.onnx.export(ep, (ids,), str(path), dynamo=True, optimize=False, verbose=False,
                      external_data=False)
    exported = onnx.load(str(path))
    out = lean(exported)
    onnx.checker.check_model(out, full_check=True)
    feeds = {exported.graph.input[0].name: ids.numpy()}
    for got, want in zip(run(out, feeds), run(exported, feeds)):
        np.testing.assert_array_equal(got, want)
    # every weight a float16 Gemm/MatMul alone reads is stored float16
    fp32_inits = [i.name for i in out.graph.initializer if i.data_type == T.FLOAT]
    readers = {i: [n.op_type for n in out.graph.node if i in n.input] for i in fp32_inits}
    assert all("Gemm" not in r and "MatMul" not in r for r in readers.values()), readers
    assert len(out.SerializeToString()) < 0.25 * len(exported.SerializeToString())
    assert cast_count(out) < cast_count(exported) / 2
