"""transform(): params modes, train/eval, the caller's model untouched, torch.compile, errors."""

import copy

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.precision.ops import Precision

from .helpers import LOW_DTYPES, by_family, rel_err, transform, unchanged


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.head(self.drop(y.mean((2, 3))))


# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_params_fp32_shares_the_callers_tensors(dtype):
    model = Net()
    with unchanged(model):
        gm = transform(model, dtype=dtype)
    for name, p in model.named_parameters():
        assert gm.get_parameter(name) is p
    for name, b in model.named_buffers():
        assert gm.get_buffer(name) is b
    before = model.conv.weight.detach().clone()
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    gm(torch.randn(4, 3, 8, 8)).sum().backward()
    opt.step()
    assert not torch.equal(model.conv.weight, before)  # training gm trains the model
    assert model.conv.weight.grad is not None and model.conv.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_params_low_stores_low_weights_and_fp32_stats(dtype):
    model = Net().eval()
    with unchanged(model):
        gm = transform(model, dtype=dtype, params="low")
    assert gm.get_parameter("conv.weight").dtype == dtype
    assert gm.get_parameter("head.weight").dtype == dtype
    assert gm.get_parameter("conv.weight") is not model.conv.weight
    for name in ("bn.weight", "bn.bias"):
        assert gm.get_parameter(name).dtype == torch.float32
    for name in ("bn.running_mean", "bn.running_var"):
        assert gm.get_buffer(name).dtype == torch.float32
    # No weight cast is left in the graph for the stored weights.
    assert not any(c.args[0].op == "get_attr" and c.args[0].target == "conv.weight"
                   for c in gm.graph.nodes if M.CAST in c.meta)
    x = torch.randn(2, 3, 8, 8)
    ref = transform(model, dtype=dtype)(x)
    assert torch.equal(gm(x), ref)  # same arithmetic, weights just stored pre-cast


@pytest.mark.parametrize("params", ["fp32", "low"])
def test_state_dict_keys_match_and_load_into_the_model(params):
    model = Net()
    gm = transform(model, dtype=torch.bfloat16, params=params)
    assert set(gm.state_dict()) == set(model.state_dict())
    fresh = Net()
    fresh.load_state_dict(gm.state_dict())
    for k, v in model.state_dict().items():
        assert fresh.state_dict()[k].dtype == v.dtype
    gm.load_state_dict(model.state_dict())  # and back


def test_state_dict_keys_match_after_dynamo_capture():
    model = Net().eval()
    gm = transform(model, dtype=torch.bfloat16, example_inputs=(torch.randn(2, 3, 8, 8),))
    assert set(gm.state_dict()) == set(model.state_dict())
    assert gm.get_parameter("conv.weight") is model.conv.weight


# --- train / eval ---------------------------------------------------------------------------


def test_symbolic_graph_follows_train_and_eval():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    gm = transform(copy.deepcopy(model), dtype=torch.bfloat16)
    x = torch.randn(8, 3, 8, 8)

    gm.eval(), ref.eval()
    assert not gm.get_submodule("bn").training and not gm.get_submodule("drop").training
    assert torch.equal(gm(x), gm(x))  # no dropout in eval
    assert rel_err(gm(x), ref(x)) < 3e-2

    gm.train(), ref.train()
    stats = gm.get_submodule("bn").running_mean.clone()
    torch.manual_seed(1)
    out = gm(x)
    torch.manual_seed(1)
    ref_out = ref(x)
    assert not torch.equal(gm.get_submodule("bn").running_mean, stats)  # batch stats updated
    torch.testing.assert_close(gm.get_submodule("bn").running_mean, ref.bn.running_mean,
                               rtol=2e-2, atol=1e-3)
    assert rel_err(out, ref_out) < 3e-2  # same dropout mask: same seed, same op order


def test_train_eval_switch_never_touches_the_callers_modes():
    model = Net().train()
    gm = transform(model)
    gm.eval()
    assert model.training and model.bn.training and model.drop.training


def test_dynamo_graph_refuses_the_other_mode():
    model = Net().eval()
    gm = transform(model, example_inputs=(torch.randn(2, 3, 8, 8),))
    gm.eval()  # same mode: fine
    with pytest.raises(amprewrite.ModeSwitchError, match="captured by dynamo in eval mode"):
        gm.train()
    assert not gm.training


def test_mode_switch_error_says_an_eval_mode_graph():
    """Issue 47, item 11: it said "a eval-mode graph"."""
    model = Net().train()
    gm = transform(model, example_inputs=(torch.randn(2, 3, 8, 8),), verify=False)
    with pytest.raises(amprewrite.ModeSwitchError,
                       match=r"transform again on model\.eval\(\) to get an eval-mode graph,"):
        gm.eval()


# --- torch.compile ----------------------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    model = Net().eval()
    gm = transform(model, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 8, 8)
    compiled = torch.compile(gm, fullgraph=True)
    out, ref = compiled(x), gm(x)
    # Inductor may fuse the bf16 casts differently; allow bf16 rounding.
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


# --- report ------------------------------------------------------------------------------------


def test_report_names_every_decision():
    model = Net()
    gm = transform(model, dtype=torch.bfloat16)
    rep = amprewrite.report(gm)
    assert {d.node for d in rep.decisions} == {n.name for n in gm.graph.nodes}
    (bn,) = [d for d in rep.decisions if d.family == "batch_norm"]
    assert (bn.precision, bn.dtype, bn.module_path) == ("fp32", "torch.float32", "bn")
    (conv,) = [d for d in rep.decisions if d.family == "conv"]
    assert (conv.precision, conv.dtype, conv.module_path) == ("low", "torch.bfloat16", "conv")
    assert len(rep.casts) == len([n for n in gm.graph.nodes if M.CAST in n.meta])
    text = str(rep)
    assert "batch_norm" in text and "op family 'conv'" in text


# --- overrides --------------------------------------------------------------------------------


@pytest.mark.parametrize("selector", ["head", nn.Linear, "linear"])
def test_keep_fp32_by_path_type_or_family(selector):
    gm = transform(Net(), dtype=torch.bfloat16, keep_fp32=[selector])
    (head,) = by_family(gm, "linear")
    assert head.meta[M.CLASS] == Precision.FP32
    assert "keep_fp32" in head.meta[M.REASON]


def test_allow_low_lets_a_family_follow_its_inputs():
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    gm = transform(model, dtype=torch.bfloat16, allow_low=["softmax"])
    (sm,) = by_family(gm, "softmax")
    assert sm.meta[M.CLASS] == Precision.PROMOTE and sm.meta[M.LABEL] == M.LOW


# --- bad input ---------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self, on_values=False):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.on_values = on_values

    def forward(self, x):
        if self.on_values:
            if x.sum() > 0:  # branch on tensor values: no tracer can follow it
                return self.fc(x)
            return x
        if x.shape[0] > 1:  # branch on a shape: dynamo specialises it
            return self.fc(x)
        return x


def test_untraceable_model_names_the_line_and_says_pass_example_inputs():
    model = Branchy()
    with unchanged(model), pytest.raises(amprewrite.CaptureError) as err:
        transform(model)
    msg = str(err.value)
    assert "test_api.py" in msg and "if x.shape[0] > 1" in msg and "example_inputs" in msg
    assert len(msg.splitlines()) == 1
    gm = transform(model, example_inputs=(torch.ones(2, 4),))  # and the advice works
    assert rel_err(gm(torch.ones(2, 4)), model(torch.ones(2, 4))) < 1e-2


def test_value_dependent_branch_fails_clearly_with_example_inputs():
    model = Branchy(on_values=True)
    with unchanged(model), pytest.raises(amprewrite.CaptureError) as err:
        transform(model, example_inputs=(torch.ones(2, 4),))
    assert "dynamo could not capture Branchy" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, "int8", torch.int32])
def test_unsupported_dtype(dtype):
    model = Net()
    with unchanged(model), pytest.raises(amprewrite.PolicyError, match="bfloat16 or float16"):
        transform(model, dtype=dtype)


def test_not_a_module():
    with pytest.raises(amprewrite.ModelError, match=r"expects a torch\.nn\.Module"):
        transform(lambda x: x)


def test_keep_fp32_unknown_module_suggests_close_names():
    model = Net()
    with unchanged(model), pytest.raises(amprewrite.PolicyError, match=r"Did you mean 'head'"):
        transform(model, keep_fp32=["haed"])


@pytest.mark.parametrize("inputs, match", [
    ((torch.randn(2, 3, 8, 8), torch.randn(1)), "do not match"),  # wrong arity
    ((torch.randn(2, 5, 8, 8),), "fails on the given example_inputs even without"),  # channels
])
def test_example_inputs_the_model_cannot_take(inputs, match):
    model = Net().eval()
    with unchanged(model), pytest.raises(amprewrite.CaptureError, match=match):
        transform(model, example_inputs=inputs)


def test_params_option_is_validated():
    with pytest.raises(amprewrite.PolicyError, match="params must be"):
        transform(Net(), params="fp8")


def test_meta_device_model_is_rejected():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(amprewrite.ModelError, match="meta-device"):
        transform(model)


def test_check_numerics_takes_keyword_example_inputs():
    """Encoder-decoder models are called with keywords (T5, Whisper): the tools take dicts too."""
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x, y=None):
            return self.a(x).softmax(-1) + self.b(y)

    model = TwoInputs()
    inputs = {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}
    result = amprewrite.check_numerics(model, inputs, dtype=torch.bfloat16)
    assert result.finite and 0 < result.output_error < 0.05
    assert {"softmax", "linear"} <= {row.node for row in result.nodes}
    assert amprewrite.find_fp32_nodes(model, inputs, rtol=0.5) == []


def test_many_dynamo_transforms_of_one_module_class():
    """Each export adds a dynamo cache entry to Sequential.forward; past dynamo's recompile limit
    (8) the ninth transform failed. find_fp32_nodes transforms up to 17 times."""
    for width in range(4, 16):
        model = torch.nn.Sequential(torch.nn.Linear(width, 4))
        gm = amprewrite.transform(model, example_inputs=(torch.randn(2, width),))
        assert gm(torch.randn(2, width)).shape == (2, 4)


def test_transforms_leave_torch_compile_of_modules_working():
    """dynamo exports a module through a wrapper whose code object every torch.compile-d module
    shares. Exports used to leave cache entries there: after 8 transforms, torch.compile of any
    module hit the recompile limit, ran eagerly, and every later transform failed."""
    for width in range(4, 16):
        amprewrite.transform(torch.nn.Sequential(torch.nn.Linear(width, 4)),
                             example_inputs=(torch.randn(2, width),))
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 3)), backend=counting_backend)
    compiled(torch.randn(2, 3))
    assert len(graphs) == 1  # compiled, not skipped
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).train()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(4, 8),))
    assert gm(torch.randn(4, 8)).shape == (4, 8)


def test_params_low_stores_only_weights_low_ops_read_and_frees_the_fp32_model():
    """params='low' on a real model: a weight is stored low exactly when every reader is a
    LOW op; the graph keeps no reference to the fp32 model, so dropping it frees its weights."""
    import gc
    import weakref

    from amprewrite.testing.zoo import llama

    model, inputs = llama()
    refs = {name: weakref.ref(p) for name, p in model.named_parameters()}
    gm = transform(model, dtype=torch.bfloat16, example_inputs=inputs, params="low")
    readers: dict[str, list] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        readers.setdefault(str(node.target), []).extend(node.users)
    stored = {name for name, p in gm.named_parameters() if p.dtype == torch.bfloat16}
    assert stored  # the projections and the head
    for name, users in readers.items():
        if name in stored:  # LOW ops, or embedding lookups whose rows are cast up after
            assert users and all(u.meta.get(M.CLASS) == Precision.LOW or (
                u.meta.get(M.FAMILY) == "embedding"
                and [c.meta.get(M.CAST) for c in u.users] == [torch.float32])
                for u in users), name
        elif name in refs:  # kept fp32: some reader is not a cast to bf16 (a norm, an add)
            assert not all(M.CAST in u.meta and u.args[1] == torch.bfloat16 for u in users), name
    assert {n.split(".")[-2] for n in stored} >= {"q_proj", "down_proj", "lm_head",
                                                  "embed_tokens"}
    norms = [n for n in refs if "norm" in n]
    assert norms and not set(norms) & stored  # RMSNorm scales: fp32, shared
    out = gm(*inputs).logits
    del model
    gc.collect()
    assert all(refs[name]() is None for name in stored)  # the fp32 copies are gone
    assert all(refs[name]() is not None for name in norms)  # shared with the graph
    assert torch.equal(gm(*inputs).logits, out)
    with pytest.raises(amprewrite.ShapeError, match=r"fp32 model .* has been freed"):
        gm(inputs[0][:, :7])  # a new shape cannot be transformed from a freed model


def test_a_selector_that_selects_no_node_is_reported():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    gm = amprewrite.transform(WithUnused(), dtype=torch.bfloat16, example_inputs=(
        torch.randn(2, 4),), keep_fp32=["unused", "used"])
    notes = amprewrite.report(gm).notes
    assert any(n.startswith("keep_fp32='unused' selects no node") for n in notes)
    assert not any("keep_fp32='used'" in n for n in notes)
    linear = [d for d in amprewrite.report(gm).decisions if d.family == "linear"]
    assert [d.precision for d in linear] == ["fp32"]


@pytest.mark.parametrize("capture", ["symbolic", "dynamo", "export"])
def test_a_non_persistent_buffer_stays_out_of_the_state_dict(capture):
    """A buffer registered with ``persistent=False`` (LLaMA's rotary ``inv_freq``) that the
    graph reads stays non-persistent: ``gm.state_dict()`` has exactly the model's keys, and
    each loads into the other (GraphModule registers the buffers it copies as persistent)."""

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("inv_freq", torch.rand(8), persistent=False)

        def forward(self, x):
            return self.fc(x) * self.inv_freq

    model = Rotary()
    x = torch.randn(2, 8)
    kw = ({"verify": False} if capture == "symbolic"
          else {"example_inputs": (x,), "capture": capture})
    gm = amprewrite.transform(model, torch.bfloat16, **kw)
    assert any(n.op == "get_attr" and n.target == "inv_freq" for n in gm.graph.nodes)
    assert gm.state_dict().keys() == model.state_dict().keys() == {"fc.weight", "fc.bias"}
    gm.load_state_dict(model.state_dict())
    model.load_state_dict(gm.state_dict())


def test_advice_never_contradicts_allow_low(tmp_path):
    """A module the user allowed low that overflows fp16 gets the check's own error, saying
    that their allow_low is what departs, not a PolicyError about keep_fp32 the advice search
    made up; export with check=False (--no-check) writes what was asked for."""
    import sys
    from pathlib import Path

    from amprewrite.deploy.export import export

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    try:
        from cli_models import overflow
    finally:
        sys.path.pop(0)
    model, inputs = overflow()
    with pytest.raises(amprewrite.VerificationError, match="you passed in allow_low") as err:
        amprewrite.transform(model, "fp16", example_inputs=inputs, allow_low=["fc"])
    assert err.value.keep_fp32 is None and "Drop 'fc' from allow_low" in str(err.value)
    result = export(model, inputs, path=tmp_path / "overflow.pt2", dtype="fp16", check=False,
                    allow_low=["fc"])
    assert (tmp_path / "overflow.pt2").exists() and result.skipped
