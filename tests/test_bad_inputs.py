"""The bad-input catalogue (docs/errors.md): each bad input gets one clear error of a documented
type and the caller's model stays bitwise unchanged; the inputs that must work, work."""

import copy
import dataclasses

import pytest
import torch
from torch import fx, nn

import amprewrite
from amprewrite import CaptureError, ModelError, PolicyError, ShapeError

from .helpers import graph_signature, rel_err, unchanged

X = torch.randn(2, 4)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.l(x)
        return -self.l(x)


class WritesParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.l.weight.mul_(0.5)
        return self.l(x)


class WritesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        self.scale += 1
        return self.l(x) * self.scale


def _check(model, error, match, **kwargs):
    """transform raises ``error`` whose message contains ``match``; the model is unchanged."""
    with unchanged(model), pytest.raises(error, match=match) as info:
        amprewrite.transform(model, **kwargs)
    message = str(info.value)
    assert "\n" not in message  # one paragraph
    assert "Traceback" not in message
    return message


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("obj", [lambda x: x, X, "model", None])
def test_not_a_module(obj):
    with pytest.raises(ModelError, match=r"expects a torch\.nn\.Module, got"):
        amprewrite.transform(obj)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.float32, "bf17",
                                   torch.float8_e4m3fn])
def test_unsupported_dtype(dtype):
    _check(mlp(), PolicyError, "converts models to bfloat16 or float16", dtype=dtype)


@pytest.mark.parametrize("inputs", [(torch.randn(20, 20),), torch.randn(20, 20),
                                    [torch.randn(20, 20)], {"x": torch.randn(20, 20)}],
                         ids=["tuple", "tensor", "list", "dict"])
def test_inputs_in_dtypes_place_are_named_not_printed(inputs):
    """transform(model, (x,)): the error says where inputs go and shows no tensor values."""
    model = nn.Linear(20, 4)
    with unchanged(model), pytest.raises(PolicyError) as info:
        amprewrite.transform(model, inputs)
    message = str(info.value)
    assert "looks like example inputs" in message and "example_inputs=(x,)" in message
    assert "float32[20,20]" in message or "'x'" in message
    assert "tensor(" not in message and "\n" not in message and len(message) < 400


@pytest.mark.parametrize("inputs", [(X, X), ()], ids=["too-many", "none"])
def test_example_inputs_wrong_arity(inputs):
    msg = _check(mlp(), CaptureError, r"example_inputs do not match Sequential.forward\(input\)",
                 example_inputs=inputs)
    assert "Pass a tuple of positional inputs" in msg


def test_example_inputs_wrong_keyword():
    _check(mlp(), CaptureError, "missing a required argument: 'input'", example_inputs={"x": X})


def test_example_inputs_wrong_shape(capfd):
    msg = _check(mlp(), CaptureError, "fails on the given example_inputs even without amprewrite",
                 example_inputs=(torch.randn(2, 5),))
    assert "2x5 and 4x4" in msg
    assert "Traceback" not in capfd.readouterr().err  # no dynamo log spew either


def test_a_token_id_past_the_vocabulary_is_the_inputs_fault():
    """A capture on fake tensors does not check values: the first real run was in the passes,
    and it raised PassError ("a bug: please report")."""
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8)).eval()
    msg = _check(model, CaptureError, "fails on the given example_inputs even without amprewrite",
                 dtype="bf16", example_inputs=(torch.tensor([[1, 2, 30]]),))
    assert "IndexError: index out of range" in msg and "model(*example_inputs)" in msg


def test_a_hf_models_keyword_ids_past_its_vocabulary():
    from amprewrite.testing import zoo

    model, (ids,) = zoo.llama()
    msg = _check(model, CaptureError, "fails on the given example_inputs even without amprewrite",
                 dtype="bf16", example_inputs={"input_ids": ids + 5000})
    assert "model(**example_inputs) must run in fp32" in msg


def test_dynamic_shapes_keyed_by_another_name_says_forwards_names():
    """The guide's `{"x": {0: batch}}` on a model whose argument is `input` was reported as a
    bug in amprewrite (a plain export without the user's spec had worked)."""
    from torch.export import Dim

    msg = _check(mlp(), PolicyError, r"dynamic_shapes has keys \['x'\]", dtype="bf16",
                 example_inputs=(X,), dynamic_shapes={"x": {0: Dim("batch", min=2, max=64)}})
    assert "these example_inputs as ['input']" in msg and "bug" not in msg
    gm = amprewrite.transform(mlp(), "bf16", example_inputs=(X,),
                              dynamic_shapes={"input": {0: Dim("batch", min=2, max=64)}})
    assert gm(torch.randn(9, 4)).shape[0] == 9


def test_example_inputs_wrong_dtype():
    _check(mlp(), CaptureError, "linear in 0 receives tensors of dtypes torch.int64",
           example_inputs=(torch.ones(2, 4, dtype=torch.long),))


def test_example_inputs_wrong_device():
    _check(mlp(), CaptureError, "fails on the given example_inputs",
           example_inputs=(torch.randn(2, 4, device="meta"),))


def test_data_dependent_control_flow_without_example_inputs():
    msg = _check(DataDependent(), CaptureError, "could not trace DataDependent symbolically")
    assert "Pass example_inputs=" in msg and "if x.sum() > 0" in msg


def test_data_dependent_control_flow_with_example_inputs_names_dynamo():
    msg = _check(DataDependent(), CaptureError, "dynamo could not capture DataDependent",
                 example_inputs=(X,))
    assert "outside amprewrite" in msg and "Data-dependent branching" in msg


@pytest.mark.parametrize("inputs", [None, (X,)], ids=["symbolic", "dynamo"])
def test_forward_writes_a_parameter(inputs):
    msg = _check(WritesParameter(), ModelError,
                 "updates floating-point parameter 'l.weight' in place", example_inputs=inputs)
    assert "test_bad_inputs.py:" in msg  # the user's line, not torch's


def test_forward_writes_a_buffer_symbolic():
    model = WritesBuffer()
    msg = _check(model, ModelError, "updates buffer 'scale' in place")
    assert "example_inputs" in msg
    assert model.scale.item() == 1.0  # tracing ran the update on a copy


def test_meta_device_parameters():
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(ModelError, match="meta-device tensor 'weight'"):
        amprewrite.transform(model)
    assert model.weight.is_meta  # (meta tensors cannot be snapshotted; nothing was materialised)


def test_half_initialised_lazy_module():
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    with pytest.raises(ModelError, match=r"uninitialised or meta-device tensor '0\.weight'"):
        amprewrite.transform(model)
    assert isinstance(model[0].weight, nn.parameter.UninitializedParameter)


@pytest.mark.parametrize("option", ["keep_fp32", "allow_low"])
def test_selector_names_unknown_module(option):
    msg = _check(mlp(), PolicyError, f"{option} names '3'", **{option: ["3"]})
    assert "named_modules" in msg


def test_selector_typo_gets_a_suggestion():
    _check(mlp(), PolicyError, "Did you mean 'softmax'", keep_fp32=["softmx"])


def test_selector_unknown_graph_node():
    _check(mlp(), PolicyError, "graph node 'linear_9'", keep_fp32=["node:linear_9"])


def test_conflicting_selectors():
    _check(mlp(), PolicyError, "both keep_fp32 and allow_low", keep_fp32=["0"], allow_low=["0"])


@pytest.mark.parametrize(("option", "value", "match"), [
    ("params", "half", "params must be 'fp32'"),
    ("upsample", "sometimes", "upsample must be 'auto'"),
    ("device", "tpu", "device must name a torch device"),
    ("keep_fp32", 3, "keep_fp32 must be a list"),
])
def test_bad_option_values(option, value, match):
    _check(mlp(), PolicyError, match, **{option: value})


def test_model_already_in_bf16():
    model = mlp().to(torch.bfloat16)
    msg = _check(model, ModelError, "are all torch.bfloat16 already")
    assert "model.float()" in msg


def test_module_without_forward():
    _check(nn.Module(), ModelError, "has no forward method")


def test_torchscript_module():
    _check(torch.jit.script(mlp()), ModelError, "TorchScript module")


def test_data_parallel_wrapper():
    _check(nn.DataParallel(mlp()), ModelError, r"transform the module it wraps \(model.module\)")


class ChangesShapeInPlace(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.op = op

    def forward(self, x):
        y = self.l(x)
        if self.op == "t_":
            y.t_()
        elif self.op == "resize_":
            y.resize_(8)
        else:
            y.set_(torch.zeros(2, 4))
        return y * 2


@pytest.mark.parametrize("op", ["t_", "resize_", "set_"])
@pytest.mark.parametrize("inputs", [None, (X,)], ids=["symbolic", "dynamo"])
def test_in_place_write_that_changes_shape(op, inputs):
    if inputs is not None and op == "resize_":  # dynamo itself refuses resize_
        msg = _check(ChangesShapeInPlace(op), CaptureError, "dynamo could not capture",
                     example_inputs=inputs)
        assert "resize_" in msg
        return
    msg = _check(ChangesShapeInPlace(op), ModelError, f"in-place write .*{op}",
                 example_inputs=inputs)
    assert "changes the tensor's shape or storage" in msg and "test_bad_inputs.py:" in msg


class WritesBroadcastView(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x)
        a, b = torch.broadcast_tensors(h, x)
        a.mul_(2)  # writes h through a view amprewrite cannot replay
        return h + b


@pytest.mark.parametrize("inputs", [None, (X,)], ids=["symbolic", "dynamo"])
def test_in_place_write_through_a_view_that_cannot_be_replayed(inputs):
    msg = _check(WritesBroadcastView(), ModelError, "a view amprewrite cannot replay",
                 example_inputs=inputs)
    assert "test_bad_inputs.py:" in msg


def test_distributed_data_parallel_wrapper(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(mlp())
        _check(ddp, ModelError, r"transform the module it wraps \(model.module\)")
    finally:
        dist.destroy_process_group()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, k: float):
        return self.l(x) * k


def test_graph_stops_after_8_other_shapes():
    """A non-tensor argument that changes on every call: dynamo bakes it into the graph, so each
    value needs a graph of its own; after 8, a ShapeError says what changed."""
    gm = amprewrite.transform(Scaled(), example_inputs=(X, 1.0))
    for k in range(8):
        gm(X, 2.0 + k)
    with pytest.raises(ShapeError, match="transformed for 8 other input shapes already") as info:
        gm(X, 10.0)
    assert "input 'k' was captured as the constant 1.0" in str(info.value)
    assert "\n" not in str(info.value)


def test_params_low_graph_cannot_be_transformed_again():
    gm = amprewrite.transform(mlp(), params="low")
    with pytest.raises(PolicyError, match="params='low'"):
        amprewrite.transform(gm)


# ------------------------------------------------------------------------------ must work
@dataclasses.dataclass
class Pair:
    logits: torch.Tensor
    probs: torch.Tensor


class StructuredOutputs(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        y = self.l(x)
        if self.kind == "dict":
            return {"y": y, "nested": (y.softmax(-1), [y.sum()]), "ids": x.argmax(-1)}
        if self.kind == "dataclass":
            return Pair(y, y.softmax(-1))
        return (y, (y.exp(), (y.relu(),)))


def _leaves(out):
    if dataclasses.is_dataclass(out):
        out = dataclasses.asdict(out)
    return torch.utils._pytree.tree_leaves(out)


@pytest.mark.parametrize("kind", ["dict", "dataclass", "nested"])
@pytest.mark.parametrize("inputs", [None, (X,)], ids=["symbolic", "dynamo"])
def test_structured_outputs_work(kind, inputs):
    model = StructuredOutputs(kind)
    with unchanged(model):
        gm = amprewrite.transform(model, example_inputs=inputs)
    with torch.no_grad():
        out, ref = gm(X), model(X)
    assert type(out) is type(ref)
    if kind == "dataclass":
        assert isinstance(out, Pair)
    got, want = _leaves(out), _leaves(ref)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)  # bf16 linear


def test_empty_model_is_the_identity():
    model = nn.Sequential()
    gm = amprewrite.transform(model)
    assert torch.equal(gm(X), X)
    assert torch.equal(amprewrite.transform(model, example_inputs=(X,))(X), X)


class InPlaceOnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.l(x)


@pytest.mark.parametrize("inputs", [None, "dynamo"])
def test_in_place_on_inputs_keeps_eager_semantics(inputs):
    model = InPlaceOnInput()
    example = X.clone()
    gm = amprewrite.transform(model, example_inputs=(example,) if inputs else None)
    assert torch.equal(example, X)  # transforming does not run the model on the caller's inputs
    a, b = X.clone(), X.clone()
    out = gm(a)
    ref = model(b)
    assert torch.equal(a, b)  # the graph mutates its input exactly as the model does
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_integer_buffer_counter_is_kept_in_the_graph():
    """BatchNorm's num_batches_tracked pattern: an integer buffer updated in forward is fine."""
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.steps.add_(1)
            return self.l(x)

    model = Counter()
    gm = amprewrite.transform(model, example_inputs=(X,))
    assert model.steps.item() == 0  # capture did not run it
    gm(X)
    gm(X)
    assert model.steps.item() == 2  # the graph shares the buffer, as it shares parameters


def test_graph_module_input_works():
    model = mlp()
    traced = fx.symbolic_trace(model)
    gm = amprewrite.transform(traced)
    torch.testing.assert_close(gm(X), model(X), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("inputs", [None, (X,)], ids=["symbolic", "dynamo"])
def test_transforming_a_transformed_graph_is_idempotent(inputs):
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1), nn.Linear(4, 4), nn.LayerNorm(4))
    once = amprewrite.transform(model, example_inputs=inputs)
    twice = amprewrite.transform(once, example_inputs=inputs)
    assert graph_signature(twice) == graph_signature(once)
    assert torch.equal(twice(X), once(X))
    # ... and re-transforming to another dtype starts from the captured graph, not on top.
    fp16 = amprewrite.transform(once, dtype=torch.float16, example_inputs=inputs)
    direct = amprewrite.transform(model, dtype=torch.float16, example_inputs=inputs)
    assert graph_signature(fp16) == graph_signature(direct)


@pytest.mark.parametrize("inputs", [None, (X,)], ids=["symbolic", "dynamo"])
def test_transforming_twice_gives_the_casts_the_same_names(inputs):
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1), nn.Linear(4, 4), nn.LayerNorm(4))
    once = amprewrite.transform(model, example_inputs=inputs)
    twice = amprewrite.transform(once, example_inputs=inputs)
    assert [n.name for n in twice.graph.nodes] == [n.name for n in once.graph.nodes]
    assert twice.code == once.code and torch.equal(twice(X), once(X))
    assert amprewrite.transform(twice, example_inputs=inputs).code == once.code


def test_example_inputs_as_a_bare_tensor_or_list():
    model = mlp()
    for inputs in (X, [X]):
        gm = amprewrite.transform(model, example_inputs=inputs)
        torch.testing.assert_close(gm(X), model(X), rtol=2e-2, atol=2e-2)


def test_deepcopy_of_the_result_is_independent():
    model = mlp()
    gm = amprewrite.transform(model)
    other = copy.deepcopy(gm)
    with torch.no_grad():
        other.get_submodule("0").weight.zero_()
    assert not torch.equal(model[0].weight, torch.zeros(4, 4))


class _DataDependentBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # a branch on a tensor's value
            return h * 2
        return h


def test_data_dependent_branching_advises_the_backend_not_pytree():
    """The capture error names the cause (values decide the control flow) and the route that
    works (the backend splits the model there), not a pytree registration."""
    with pytest.raises(amprewrite.CaptureError) as err:
        amprewrite.transform(_DataDependentBranch(), torch.bfloat16,
                             example_inputs=(torch.randn(2, 8),))
    msg = str(err.value)
    assert "torch.compile(model, backend='amprewrite')" in msg and "torch.cond" in msg
    assert "pytree" not in msg and len(msg.splitlines()) == 1
    # The advice works: the backend splits the model at the branch (its graphs run eagerly
    # here; the advice's default inner compiler, inductor, is test_backend.py's).
    compiled = torch.compile(_DataDependentBranch(), backend="amprewrite",
                             options={"inner": "eager"})
    assert compiled(torch.randn(2, 8)).dtype == torch.float32


class _IndexAssign(nn.Module):
    def forward(self, x):
        x[0] = 1.0  # a Proxy assignment under symbolic tracing
        return x * 2


def test_symbolic_trace_failure_names_the_assignment_not_control_flow():
    """A Proxy item assignment was blamed on control flow."""
    with pytest.raises(amprewrite.CaptureError) as err:
        amprewrite.transform(_IndexAssign(), torch.bfloat16, verify=False)
    msg = str(err.value)
    assert "assigns into a tensor" in msg and "control flow or loops" not in msg
    assert "example_inputs=" in msg and len(msg.splitlines()) == 1


def test_an_exported_program_gives_an_exported_program():
    """transform(ep) said to wrap a function in a module, then to pass ep.module(); it
    transforms the program and returns one (tests/capture/test_exported_program.py), and ep.module()
    still gives a GraphModule."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1)).eval(), torch.randn(2, 8)
    ep = torch.export.export(model, (x,))
    out = amprewrite.transform(ep, torch.bfloat16)
    assert isinstance(out, torch.export.ExportedProgram)
    gm = amprewrite.transform(ep.module(), torch.bfloat16, example_inputs=(x,))
    with torch.no_grad():
        assert rel_err(out.module()(x), model(x)) < 2e-2
        assert rel_err(gm(x), model(x)) < 2e-2
