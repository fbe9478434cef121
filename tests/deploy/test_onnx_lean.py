"""amprewrite.deploy.onnx_lean: an exported ONNX file made lean by exact rewrites only (the same
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

from amprewrite.deploy.onnx_lean import cast_count, lean  # noqa: E402


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
    # the causal mask on these fixed sizes is a stored constant, not ops at every run; the
    # fresh model's all-zero Gemm biases are gone
    assert not {"CumSum", "GatherND", "Equal"} & {n.op_type for n in out.graph.node}
    assert all(len(n.input) == 2 for n in out.graph.node if n.op_type == "Gemm")


def lookup_model():
    """A float16 file's shape of an embedding: a vocabulary table read by a float32 Gather
    into a float32 residual stream (the plan's: the lookup is exact), tied to a float16 head
    through a cast; a second table read only by a Gather; a float32 weight read in float32."""
    rng = np.random.default_rng(0)
    # 9000 rows: past onnxscript's folding limit, so the head's Transpose is not folded into a
    # second (transposed) copy of the table
    wte = numpy_helper.from_array(rng.standard_normal((9000, 8)).astype(np.float32), "wte")
    wpe = numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "wpe")
    ln = numpy_helper.from_array(rng.standard_normal((8,)).astype(np.float32), "ln")
    nodes = [
        h.make_node("Gather", ["wte", "ids"], ["tok"]),
        h.make_node("Gather", ["wpe", "pos"], ["where"]),
        h.make_node("Add", ["tok", "where"], ["x"]),
        h.make_node("Mul", ["x", "ln"], ["xn"]),  # float32 stream
        cast("xn", "x16", T.FLOAT16),
        cast("wte", "wte16", T.FLOAT16),  # the tied head
        h.make_node("Transpose", ["wte16"], ["head"], perm=[1, 0]),
        h.make_node("MatMul", ["x16", "head"], ["logits16"]),
        cast("logits16", "logits", T.FLOAT),
    ]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", T.INT64, [2, 4]),
                                      h.make_tensor_value_info("pos", T.INT64, [2, 4])],
                         [h.make_tensor_value_info("logits", T.FLOAT, [2, 4, 9000])],
                         [wte, wpe, ln])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)


def with_tables_rounded(model, names):
    """``model`` with the named initializers rounded to float16 (kept float32)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in names:
            array = numpy_helper.to_array(init).astype(np.float16).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(array, init.name))
    return out


def test_tables_stores_lookup_tables_float16_with_the_cast_after_the_lookup():
    from amprewrite.deploy.onnx_rounded import run_rounded

    model = lookup_model()
    out = lean(model, tables=True)
    inits = {i.name: i.data_type for i in out.graph.initializer}
    # both tables float16, the tied one once; a weight read in float32 stays float32
    assert inits == {"wte": T.FLOAT16, "wpe": T.FLOAT16, "ln": T.FLOAT}
    producer = {o: n for n in out.graph.node for o in n.output}
    casts = [n for n in out.graph.node if n.op_type == "Cast"]
    widened = sorted(producer[n.input[0]].input[0] for n in casts
                     if n.attribute[0].i == T.FLOAT and producer[n.input[0]].op_type == "Gather")
    assert widened == ["wpe", "wte"]  # one cast to float32 after each lookup
    assert not any(n.input[0] == "wte" for n in casts)  # the head reads the stored table
    assert cast_count(out) == cast_count(model) - 1 + 2
    # what it computes: the file before, with the tables rounded to float16, bit for bit
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.integers(0, 9000, (2, 4)), "pos": rng.integers(0, 4, (2, 4))}
    want = with_tables_rounded(model, {"wte", "wpe"})
    np.testing.assert_array_equal(run_rounded(out, feeds)[0], run_rounded(want, feeds)[0])
    np.testing.assert_array_equal(run(out, feeds)[0], run(want, feeds)[0])
    # without tables=True, lean leaves them float32: the rule is a rounding, asked for
    assert {i.name: i.data_type for i in lean(model).graph.initializer}["wpe"] == T.FLOAT


def test_tables_leaves_a_float32_file_and_tables_float16_cannot_hold():
    model = lookup_model()
    # no cast to float16 anywhere: a float32 file keeps its tables
    fp32 = onnx.ModelProto()
    fp32.CopyFrom(model)
    nodes = [n for n in fp32.graph.node if n.op_type in ("Gather", "Add")]
    del fp32.graph.node[:]
    fp32.graph.node.extend(nodes)
    del fp32.graph.output[:]
    fp32.graph.output.append(h.make_tensor_value_info("x", T.FLOAT, [2, 4, 8]))
    assert all(i.data_type == T.FLOAT for i in lean(fp32, tables=True).graph.initializer)
    # past float16's range, or mostly float16 subnormals: stays float32
    for value in (1e5, 1e-6):
        big = onnx.ModelProto()
        big.CopyFrom(model)
        init = next(i for i in big.graph.initializer if i.name == "wpe")
        init.CopyFrom(numpy_helper.from_array(np.full((4, 8), value, np.float32), "wpe"))
        inits = {i.name: i.data_type for i in lean(big, tables=True).graph.initializer}
        assert inits["wpe"] == T.FLOAT and inits["wte"] == T.FLOAT16, value


def test_a_zoo_bert_file_stores_its_embedding_tables_float16(tmp_path):
    """deploy.export's float16 file: BERT's word, position and token-type tables are stored
    float16 (the plan reads them in float32), each lookup cast to float32 after it."""
    from amprewrite.deploy import export as deploy
    from amprewrite.testing import zoo

    model, (ids,) = zoo.bert()
    path = tmp_path / "bert.onnx"
    deploy.export(model, (ids,), path=path, to="onnx", dtype="fp16", dynamic_batch=False,
                  check=False)
    out = onnx.load(str(path))
    fp32 = [i.name for i in out.graph.initializer if i.data_type == T.FLOAT and len(i.dims) > 1]
    assert fp32 == [], fp32  # only the norms' vectors stay float32
    tables = {i.name for i in out.graph.initializer if i.name.endswith("_embeddings.weight")}
    assert "embeddings.word_embeddings.weight" in tables
    assert all(i.data_type == T.FLOAT16 for i in out.graph.initializer if i.name in tables)
    # bias=True and softmax=True fire on the real file: the attention output and the FFN
    # output projections (before each residual add) add their bias in float32, and both
    # layers' attention softmax runs in float32
    from amprewrite.deploy.onnx_lean import _types

    types = _types(out)
    inits = {i.name: i.data_type for i in out.graph.initializer}
    widened = [n for n in out.graph.node if n.op_type == "Add"
               and any(inits.get(i) == T.FLOAT and i.endswith("bias_f32") for i in n.input)]
    assert len(widened) == 4, [n.input for n in widened]
    softmax = [n for n in out.graph.node if n.op_type == "Softmax"]
    assert len(softmax) == 2 and all(types[n.input[0]] == T.FLOAT for n in softmax)


def linear_model(shared_sum: bool = False):
    """A float16 linear as torch.onnx writes it (MatMul, then Add of the bias), its sum widened
    to float32 for the residual stream, and a float16 softmax; ``shared_sum``: the float16
    sum is also read by a float16 op (then its bias stays float16)."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float16), "w")
    b = numpy_helper.from_array((rng.standard_normal(8) * 3).astype(np.float16), "b")
    nodes = [cast("x", "x16", T.FLOAT16), h.make_node("MatMul", ["x16", "w"], ["m"]),
             h.make_node("Add", ["m", "b"], ["s"]), cast("s", "s32", T.FLOAT),
             h.make_node("Add", ["x", "s32"], ["r"]),
             h.make_node("Softmax", ["x16"], ["p16"], axis=-1), cast("p16", "p", T.FLOAT)]
    outputs = [h.make_tensor_value_info("r", T.FLOAT, [4, 8]),
               h.make_tensor_value_info("p", T.FLOAT, [4, 8])]
    if shared_sum:
        nodes.append(h.make_node("Relu", ["s"], ["t"]))
        outputs.append(h.make_tensor_value_info("t", T.FLOAT16, [4, 8]))
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [4, 8])],
                         outputs, [w, b])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)


def test_bias_adds_a_float16_bias_in_float32_where_the_sum_is_widened_after():
    from amprewrite.deploy.onnx_rounded import run_rounded

    model = linear_model()
    out = lean(model, bias=True)
    ops = [n.op_type for n in out.graph.node if n.op_type != "Softmax"]
    assert ops[:5] == ["Cast", "MatMul", "Cast", "Add", "Add"], ops  # as many nodes, reordered
    add = next(n for n in out.graph.node if n.op_type == "Add")
    inits = {i.name: i for i in out.graph.initializer}
    assert inits[add.input[1]].data_type == T.FLOAT and "b" not in inits  # widened, exactly
    np.testing.assert_array_equal(numpy_helper.to_array(inits[add.input[1]]),
                                  numpy_helper.to_array(model.graph.initializer[1]).astype(
                                      np.float32))
    # What it computes with every float16 value rounded: the float16 product, rounded once,
    # plus the float16 bias in float32 (before: rounded again after the bias), bit for bit.
    x = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32) * 10
    w16 = numpy_helper.to_array(model.graph.initializer[0])
    b16 = numpy_helper.to_array(model.graph.initializer[1])
    m16 = (x.astype(np.float16).astype(np.float32) @ w16.astype(np.float32)).astype(np.float16)
    want = x + (m16.astype(np.float32) + b16.astype(np.float32))
    np.testing.assert_array_equal(run_rounded(out, {"x": x})[0], want)
    before = run_rounded(model, {"x": x})[0]
    assert not np.array_equal(before, want)  # the second rounding the rule removes


def test_bias_leaves_a_sum_that_a_float16_op_also_reads():
    model = linear_model(shared_sum=True)
    out = lean(model, bias=True)
    inits = {i.name: i.data_type for i in out.graph.initializer}
    assert inits["b"] == T.FLOAT16 and len(inits) == 2
    add = next(n for n in out.graph.node if n.op_type == "Add")
    assert list(add.input) == ["m", "b"]


def test_softmax_computes_a_float16_softmax_in_float32():
    from amprewrite.deploy.onnx_rounded import run_rounded

    model = linear_model()
    out = lean(model, softmax=True)
    producer = {o: n for n in out.graph.node for o in n.output}
    softmax = next(n for n in out.graph.node if n.op_type == "Softmax")
    up = producer[softmax.input[0]]
    assert up.op_type == "Cast" and up.attribute[0].i == T.FLOAT
    down = next(n for n in out.graph.node if list(n.input) == [softmax.output[0]])
    assert down.op_type == "Cast" and down.attribute[0].i == T.FLOAT16
    x = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float32) * 4
    z = x.astype(np.float16).astype(np.float32)
    e = np.exp(z - z.max(-1, keepdims=True))
    want = (e / e.sum(-1, keepdims=True)).astype(np.float16).astype(np.float32)
    got = run_rounded(out, {"x": x})[1]
    np.testing.assert_allclose(got, want, rtol=0, atol=float(np.finfo(np.float16).eps))
    plain = next(n for n in lean(model).graph.node if n.op_type == "Softmax")
    assert list(plain.input) == ["x16"]  # asked for, not by default


def test_a_constant_mask_behind_a_bool_cast_is_computed_once_at_export_not_at_every_run():
    """A causal mask the export leaves as ops on initializers (a bool value cast to int64,
    a cumsum, a comparison, a where): the whole chain folds into one initializer, and the
    outputs are bit for bit the file's. A float16 table widened where it is read keeps its
    cast (stored float16 on purpose)."""
    pad = numpy_helper.from_array(np.array([[False, False, True, False]]), "pad")
    table = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((1, 4)).astype(np.float16), "table16")
    nodes = [
        h.make_node("Not", ["pad"], ["keep"]),  # folds first, then the cast of its value
        cast("keep", "keep64", T.INT64),
        h.make_node("CumSum", ["keep64", "axis"], ["pos"]),
        h.make_node("Unsqueeze", ["pos", "one"], ["col"]),
        h.make_node("Unsqueeze", ["pos", "two"], ["row"]),
        h.make_node("LessOrEqual", ["col", "row"], ["causal"]),
        h.make_node("Where", ["causal", "zero", "minus"], ["mask"]),
        cast("table16", "table", T.FLOAT),
        h.make_node("Add", ["x", "table"], ["xt"]),
        h.make_node("Unsqueeze", ["xt", "one"], ["xu"]),
        h.make_node("Add", ["xu", "mask"], ["y"]),
    ]
    consts = [numpy_helper.from_array(np.array(v, np.int64), n)
              for n, v in (("axis", 1), ("one", [2]), ("two", [1]))]
    consts += [numpy_helper.from_array(np.array(v, np.float32), n)
               for n, v in (("zero", 0.0), ("minus", -1e4))]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 4])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 4])],
                         [pad, table, *consts])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)
    out = lean(model)
    assert [n.op_type for n in out.graph.node] == ["Cast", "Add", "Unsqueeze", "Add"]
    assert next(i for i in out.graph.initializer if i.name == "table16").data_type == T.FLOAT16
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4)).astype(np.float32)}
    np.testing.assert_array_equal(run(out, feeds)[0], run(model, feeds)[0])


def test_a_zero_bias_and_arithmetic_identities_go_and_everything_else_stays():
    """``Gemm`` with an all-zero bias reads no bias (what torch.onnx's optimizer does to a
    float32 file; a fresh Hugging Face model's biases are zero), ``x * 1`` and ``x + 0`` read
    ``x``; a nonzero bias and a float16 round trip stay. Bit for bit the same outputs."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("w", rng.standard_normal((8, 8)).astype(np.float16)),
        ("zero", np.zeros(8, np.float16)),
        ("bias", rng.standard_normal(8).astype(np.float16)),
        ("one", np.array(1.0, np.float16)), ("nought", np.array(0.0, np.float16)))]
    nodes = [
        cast("x", "x16", T.FLOAT16),
        h.make_node("Gemm", ["x16", "w", "zero"], ["a"]),
        h.make_node("Mul", ["a", "one"], ["b"]),
        h.make_node("Add", ["nought", "b"], ["c"]),
        h.make_node("Gemm", ["c", "w", "bias"], ["d"]),
        cast("d", "y", T.FLOAT),
    ]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 8])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)
    out = lean(model)
    assert [(n.op_type, len(n.input)) for n in out.graph.node] == [
        ("Cast", 1), ("Gemm", 2), ("Gemm", 3), ("Cast", 1)]
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    np.testing.assert_array_equal(run(out, feeds)[0], run(model, feeds)[0])
