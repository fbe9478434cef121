"""accelerate's Accelerator with amprewrite's plan (``amprewrite.trainers.accelerate``): a few
steps of its usual loop on the overflow LLaMA (CPU, eager inner backend), fp16 and bf16, with
gradient clipping and a state saved and loaded; no autocast active in the model's forward."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import amprewrite
from amprewrite.errors import PolicyError
from amprewrite.testing import overflow

accelerate = pytest.importorskip("accelerate")
amp = pytest.importorskip("amprewrite.trainers.accelerate")


def _accelerator(**kwargs):
    """A new Accelerator: accelerate keeps one state per process, reset for each test run."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return accelerate.Accelerator(cpu=True, **kwargs)


def _run(mixed: str, with_amprewrite: bool, tmp_path=None, steps: int = 3, **enable):
    # Earlier tests in this process compiled the same LLaMA code: past dynamo's recompile
    # limit it would run uncompiled, with no plan to report (seen once in a full run).
    torch._dynamo.reset()
    case = overflow.llama()
    model, ids = case.model, case.inputs[0]
    accelerator = _accelerator(mixed_precision=mixed)
    if with_amprewrite:
        enable = {"inner": "eager", **enable}
        if enable["inner"] is None:  # as the guide writes it: no inner=
            del enable["inner"]
        amp.enable(accelerator, model, **enable)
    seen = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model, opt, schedule = accelerator.prepare(model, opt, schedule)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(float(loss))
    if tmp_path is not None:
        accelerator.save_state(str(tmp_path))
    return accelerator, model, losses, seen


def test_enable_as_the_guide_writes_it_compiles_nothing_with_inductor_on_a_cpu(no_inductor):
    """``amp.enable(accelerator, model)`` with no ``inner=`` on a CPU runs the planned graphs
    eagerly (inner="auto"; inductor took 4 fp16 steps from 4.8 s to 177 s, issue 65): the
    losses of ``inner="eager"``, bit for bit, with amprewrite's scaler."""
    accelerator, _, losses, seen = _run("fp16", with_amprewrite=True, inner=None)
    assert losses == _run("fp16", with_amprewrite=True)[2]
    assert isinstance(accelerator.scaler, amprewrite.GradScaler) and seen == [False] * 3


@pytest.fixture(scope="module")
def fp32_losses():
    return _run("no", with_amprewrite=False)[2]


@pytest.mark.parametrize("mixed", ["fp16", "bf16"])
def test_the_loop_trains_finite_near_fp32_without_autocast(mixed, fp32_losses, tmp_path):
    accelerator, model, losses, seen = _run(mixed, True, tmp_path)
    assert all(math.isfinite(v) for v in losses)
    tol = 1e-4 if mixed == "fp16" else 1e-3  # relative to fp32's losses
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(losses, fp32_losses)), (
        losses, fp32_losses)
    assert seen and not any(seen)  # accelerate's autocast is off inside the forward
    graphs = amprewrite.report(model).graphs
    assert graphs and {g.report.dtype for g in graphs} == {
        "float16" if mixed == "fp16" else "bfloat16"}
    if mixed == "fp16":
        assert isinstance(accelerator.scaler, amprewrite.GradScaler)
        scale = accelerator.scaler.get_scale()
        accelerator.scaler.update(new_scale=1.0)
        accelerator.load_state(str(tmp_path))  # the scaler comes back with the state
        assert accelerator.scaler.get_scale() == scale


def test_enable_needs_a_dtype_and_comes_before_prepare():
    case = overflow.llama()
    with pytest.raises(PolicyError, match=r"mixed_precision='fp16' or 'bf16'"):
        amp.enable(_accelerator(), case.model)
    accelerator = _accelerator(mixed_precision="bf16")
    prepared = accelerator.prepare(case.model)
    with pytest.raises(PolicyError, match=r"before accelerator\.prepare"):
        amp.enable(accelerator, prepared)


@pytest.mark.parametrize("mixed", ["fp16", "bf16"])
def test_params_low_prepares_amprewrites_optimizer_and_trains_near_fp32(mixed, fp32_losses,
                                                                         tmp_path):
    """``enable(accelerator, model, params="low")``: the weights low ops read are stored low in
    the model, the AdamW given to prepare() becomes an amprewrite.optimizer (its scheduler
    still sets the learning rate), clipping and the fp16 scaler work, and the losses stay
    within 2% of fp32's (bf16 weights; measured under 0.5%); the state saves and loads."""
    from amprewrite.compile.optimizer import Optimizer

    accelerator, model, losses, _ = _run(mixed, True, tmp_path, params="low")
    low = torch.float16 if mixed == "fp16" else torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == low
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.float32
    opt = accelerator._optimizers[0].optimizer
    assert isinstance(opt, Optimizer) and opt.steps == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)  # the scheduler's, 3 steps on
    assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(losses, fp32_losses)), (
        losses, fp32_losses)
    kept = copy.deepcopy(opt.state_dict())
    accelerator.load_state(str(tmp_path))
    assert opt.steps == kept["amprewrite"]["steps"]
