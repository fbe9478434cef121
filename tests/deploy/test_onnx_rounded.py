"""amprewrite.deploy.onnx_rounded: an ONNX file run with every value it declares float16 really
rounded, which onnxruntime's CPU provider does not do (it computes most float16 ops in float32
and drops the roundings between them)."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402

from amprewrite.deploy.onnx_rounded import RoundedSession, rounded, run_rounded  # noqa: E402


def fp16_model(nodes, consts: dict[str, float], out_type=T.FLOAT16):
    """A graph of ``nodes`` from a float16 input ``x`` of 4 values to an output ``y``."""
    inits = [h.make_tensor(k, T.FLOAT16, [], [v]) for k, v in consts.items()]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT16, [4])],
                         [h.make_tensor_value_info("y", out_type, [4])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)


def plain_run(model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_an_overflow_onnxruntime_cpu_hides_is_non_finite_when_rounded():
    # softmax(x * 1000 / 1000): 300 * 1000 passes float16's 65504, so a float16 runtime
    # gets inf, and the softmax NaN.
    model = fp16_model([h.make_node("Mul", ["x", "k"], ["a"]),
                        h.make_node("Div", ["a", "k"], ["b"]),
                        h.make_node("Softmax", ["b"], ["y"])], {"k": 1000.0})
    x = np.array([1, 2, 3, 300], np.float16)
    plain = plain_run(model, x)
    assert np.isfinite(plain).all()  # onnxruntime CPU: finite, as if computed in float32
    np.testing.assert_allclose(plain.astype(np.float32),
                               np.exp(x - x.max()) / np.exp(x - x.max()).sum(), atol=1e-3)
    assert not np.isfinite(run_rounded(model, {"x": x})[0]).all()


def test_every_value_declared_float16_is_rounded_before_it_is_read():
    # (x + 0.25) - x: 2048.25 is not a float16 (spacing 2 at 2048), so the rounded sum is
    # 2048 and the difference 0; 1.25 is exact. A float32 computation gives 0.25 for both.
    model = fp16_model([h.make_node("Add", ["x", "q"], ["a"]),
                        h.make_node("Sub", ["a", "x"], ["y"])], {"q": 0.25})
    x = np.array([1, 2048, 4, 8192], np.float16)
    got = run_rounded(model, {"x": x})[0]
    assert got.dtype == np.float16  # the dtype the file declares for its output
    np.testing.assert_array_equal(got, np.array([0.25, 0, 0.25, 0], np.float16))


def test_float32_values_are_not_rounded_and_casts_still_round():
    # Cast to float32, add 0.25 in float32 (exact at 2048), cast to float16 (rounds).
    model = fp16_model([h.make_node("Cast", ["x"], ["x32"], to=T.FLOAT),
                        h.make_node("Add", ["x32", "q32"], ["a32"]),
                        h.make_node("Sub", ["a32", "x32"], ["y"])], {},
                       out_type=T.FLOAT)
    model.graph.initializer.append(h.make_tensor("q32", T.FLOAT, [], [0.25]))
    x = np.array([1, 2048, 4, 8192], np.float16)
    np.testing.assert_array_equal(run_rounded(model, {"x": x})[0], np.full(4, 0.25, np.float32))


def test_the_rewritten_file_is_float32_with_a_rounding_pair_after_each_low_value():
    model = fp16_model([h.make_node("Mul", ["x", "k"], ["a"]),
                        h.make_node("Relu", ["a"], ["y"])], {"k": 3.0})
    out = rounded(model)
    assert out.graph.input[0].type.tensor_type.elem_type == T.FLOAT
    assert out.graph.initializer[0].data_type == T.FLOAT
    casts = [(n.input[0], n.attribute[0].i) for n in out.graph.node if n.op_type == "Cast"]
    # a and y, each rounded to float16 and widened back
    assert [to for _, to in casts] == [T.FLOAT16, T.FLOAT] * 2
    assert model.graph.input[0].type.tensor_type.elem_type == T.FLOAT16  # not modified


def test_a_session_is_reusable_and_refuses_control_flow():
    model = fp16_model([h.make_node("Mul", ["x", "k"], ["y"])], {"k": 2.0})
    session = RoundedSession(model)
    for scale in (1, 3):
        x = np.arange(4, dtype=np.float16) * scale
        np.testing.assert_array_equal(session.run({"x": x})[0], x * 2)
    branch = h.make_graph([h.make_node("Identity", ["x"], ["z"])], "b", [],
                          [h.make_tensor_value_info("z", T.FLOAT16, [4])])
    cond = fp16_model([h.make_node("Constant", [], ["c"], value=h.make_tensor(
        "c", T.BOOL, [], [True])), h.make_node("If", ["c"], ["y"], then_branch=branch,
                                                else_branch=branch)], {})
    with pytest.raises(ValueError, match="control flow"):
        rounded(cond)
