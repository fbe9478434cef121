"""Parametrized modules (weight_norm, spectral_norm, register_parametrization) capture both
ways, and capture errors name whose failure it is."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import amprewrite
from amprewrite.capture import trace as C
from amprewrite.graph import meta as M
from amprewrite.precision.ops import Precision

from ..helpers import assert_classes_respected, rel_err, unchanged


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    sym = nn.Linear(16, 16)
    parametrize.register_parametrization(sym, "weight", Symmetric())
    return {
        "weight_norm": nn.Sequential(weight_norm(nn.Linear(16, 32)), nn.GELU(),
                                     nn.Linear(32, 8)),
        # Wav2Vec2's positional convolution: weight_norm over dim 2 of a grouped Conv1d.
        "weight_norm_conv": nn.Sequential(
            weight_norm(nn.Conv1d(16, 16, 5, padding=2, groups=4), dim=2), nn.GELU()),
        "spectral_norm": nn.Sequential(spectral_norm(nn.Linear(16, 32)), nn.ReLU(),
                                       nn.Linear(32, 8)),
        "register_parametrization": nn.Sequential(sym, nn.Tanh()),
    }


def _input(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn((4, 16, 10) if name.endswith("conv") else (4, 16), generator=g)


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize("method", ["symbolic_trace", "dynamo"])
def test_parametrized_module_transforms_and_matches_fp32(name, method, request):
    if method == "symbolic_trace" and name == "weight_norm_conv":
        # No probe, no trust: without example inputs the grouped conv's weight is computed in
        # the graph, its shape unknown, and no guessed input runs it even in fp32, so it is an
        # fp32 island with a report note (allow_low overrides). Strict: a probe that learns
        # this case makes it pass, and then this mark must go.
        request.applymarker(pytest.mark.xfail(strict=True, reason="probe cannot rebuild the "
                                              "computed grouped-conv weight's shape"))
    model = _models()[name].eval()
    x = _input(name)
    example = (x,) if method == "dynamo" else None
    with unchanged(model):
        gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=example)
    assert gm.meta["amprewrite_report"].capture == method
    with torch.no_grad():
        out, ref = gm(x), model(x)
    # bf16 rounds to 2^-9 relative; two or three LOW ops in a row stay well under 2e-2.
    assert out.dtype == torch.float32 and rel_err(out, ref) < 2e-2
    assert_classes_respected(gm, x, low=torch.bfloat16)
    low = [n for n in gm.graph.nodes if n.meta.get(M.CLASS) == Precision.LOW
           and n.meta.get(M.FAMILY) in ("linear", "conv")]
    assert low, "the parametrized layer itself runs in bf16 on a cast of the computed weight"
    # The parametrization's originals are the caller's Parameters, shared, under their names.
    assert gm.state_dict().keys() == model.state_dict().keys()
    for key, p in model.named_parameters():
        assert gm.get_parameter(key) is p, key


@pytest.mark.parametrize("method", ["symbolic_trace", "dynamo"])
def test_weight_norm_trains_its_original_parameters(method):
    model = _models()["weight_norm"].train()
    x, target = _input("weight_norm"), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    gm = amprewrite.transform(model, dtype=torch.bfloat16,
                              example_inputs=(x,) if method == "dynamo" else None)
    nn.functional.mse_loss(gm(x), target).backward()
    with torch.autocast("cpu", torch.bfloat16):
        nn.functional.mse_loss(ref(x), target).backward()
    originals = [k for k, _ in model.named_parameters() if "original" in k]
    assert len(originals) == 2  # weight_norm's g and v
    for key, p in model.named_parameters():
        want = ref.get_parameter(key).grad
        assert p.grad is not None and p.grad.dtype == torch.float32, key
        # Both runs round the same matmuls to bf16: gradients agree to a few bf16 roundoffs.
        assert rel_err(p.grad, want) < 3e-2, key


def test_spectral_norm_updates_its_power_iteration_buffers_in_training():
    model = _models()["spectral_norm"].train()
    x = _input("spectral_norm")
    ref = copy.deepcopy(model)
    gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=(x,))
    u_key = "0.parametrizations.weight.0._u"
    before = model.get_buffer(u_key).clone()
    out = gm(x)  # runs one power iteration, as the model does, on the shared buffer
    want = ref(x)
    after = model.get_buffer(u_key)
    assert not torch.equal(before, after)
    assert rel_err(after, ref.get_buffer(u_key)) < 2e-2  # the iteration's mv runs in bf16
    assert rel_err(out, want) < 2e-2


def test_hooked_linear_kept_as_a_module_runs_in_fp32():
    """A leaf module called as a whole (a forward hook keeps it from being lowered) reads its
    own fp32 weights where no cast reaches them: it must not get a low input."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model[0].register_forward_hook(lambda mod, args, out: out * 2)
    x = torch.randn(3, 4)
    gm = amprewrite.transform(model, dtype=torch.bfloat16)
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "0"]
    assert call.meta[M.CLASS] == Precision.FP32
    assert "called as a module" in call.meta[M.REASON]
    assert torch.equal(gm(x), model(x))  # fp32 throughout: bit-exact


def test_capture_failure_dynamo_alone_survives_is_blamed_on_amprewrite(monkeypatch):
    """When torch._dynamo.export captures the model itself, the error must not blame dynamo
    or the model."""
    model = nn.Sequential(nn.Linear(4, 4))

    def broken_export(model, args, kwargs, *spec):
        raise RuntimeError("copy went wrong")

    monkeypatch.setattr(C, "_export", broken_export)
    with unchanged(model), pytest.raises(amprewrite.CaptureError) as err:
        amprewrite.transform(model, example_inputs=(torch.randn(2, 4),))
    msg = str(err.value)
    assert "bug in amprewrite" in msg and "copy went wrong" in msg
    assert "torch._dynamo.export captures the same model" in msg
    assert "dynamo could not capture" not in msg
    assert len(msg.splitlines()) == 1


def test_capture_failure_inside_amprewrite_code_is_blamed_on_amprewrite(monkeypatch):
    def broken_copy(module):
        return C._get(module, "no.such.attribute")  # fails in amprewrite's own code

    monkeypatch.setattr(C, "share_copy", broken_copy)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(amprewrite.CaptureError, match="bug in amprewrite"):
        amprewrite.transform(model, example_inputs=(torch.randn(2, 4),))
