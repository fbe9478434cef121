"""transformers' Trainer with amprewrite's plan in one line (``amprewrite.trainers.transformers``).

On the overflow LLaMA (amprewrite.testing.overflow: its MLP passes fp16's 65504), CPU, eager
inner backend: fp16 and bf16 train finite and near fp32, with gradient accumulation and
``max_grad_norm``; evaluation, prediction, a checkpoint saved, resumed and loaded with
``from_pretrained`` into a plain model; the model's signature kept, so ``remove_unused_columns``
works as usual.
"""

from __future__ import annotations

import math

import pytest
import torch

import amprewrite
from amprewrite.errors import PolicyError
from amprewrite.testing import overflow

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
amp = pytest.importorskip("amprewrite.trainers.transformers")


def _data(ids: torch.Tensor, n: int = 8) -> list[dict]:
    # "text" is a column the model does not take: remove_unused_columns drops it.
    return [{"input_ids": ids[i % len(ids)], "labels": ids[i % len(ids)], "text": f"row {i}"}
            for i in range(n)]


def _trainer(tmp_path, precision: dict, with_amprewrite: bool, inner: str | None = "eager",
             **more):
    torch._dynamo.reset()  # a fresh compile, whatever earlier tests in this process compiled
    case = overflow.llama()
    settings = {"max_steps": 3, "gradient_accumulation_steps": 2, "save_strategy": "no",
                **precision, **more}
    args = transformers.TrainingArguments(
        str(tmp_path), use_cpu=True, per_device_train_batch_size=2, max_grad_norm=1.0,
        learning_rate=1e-3, report_to=[], logging_steps=1, disable_tqdm=True, seed=0,
        **settings)
    trainer = transformers.Trainer(model=case.model, args=args,
                                   train_dataset=_data(case.inputs[0]))
    if not with_amprewrite:
        return trainer
    return amp.enable(trainer) if inner is None else amp.enable(trainer, inner=inner)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory):
    trainer = _trainer(tmp_path_factory.mktemp("fp32"), {}, with_amprewrite=False)
    trainer.train()
    return _losses(trainer)


@pytest.mark.parametrize("precision", [{"fp16": True}, {"bf16": True}], ids=["fp16", "bf16"])
def test_trains_in_the_trainers_dtype_finite_and_near_fp32(tmp_path, precision, fp32_losses):
    trainer = _trainer(tmp_path, precision, with_amprewrite=True)
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    # Relative to fp32's losses, measured here: fp16 1.5e-6 to 2.7e-6, bf16 5e-6 to 3.1e-5.
    tol = 2e-5 if "fp16" in precision else 2e-4
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(losses, fp32_losses)), (
        losses, fp32_losses)
    low = "float16" if "fp16" in precision else "bfloat16"
    graphs = amprewrite.report(trainer.model).graphs
    assert graphs and all(g.report.dtype == low for g in graphs)
    assert any(d.precision == "low" for g in graphs for d in g.report.decisions)
    if "fp16" in precision:
        assert isinstance(trainer.accelerator.scaler, amprewrite.GradScaler)


def test_enable_as_the_guide_writes_it_compiles_nothing_with_inductor_on_a_cpu(
        tmp_path, no_inductor):
    """``amp.enable(trainer)`` with no ``inner=`` on a CPU runs the planned graphs eagerly
    (inner="auto"): inductor took 6 fp16 steps of a 2-layer Qwen2 from 13 s to 247 s (issue
    65). The losses are those of ``inner="eager"``, bit for bit."""
    default = _trainer(tmp_path / "auto", {"fp16": True}, with_amprewrite=True, inner=None)
    default.train()
    eager = _trainer(tmp_path / "eager", {"fp16": True}, with_amprewrite=True)
    eager.train()
    assert len(_losses(default)) == 3 and _losses(default) == _losses(eager)
    assert isinstance(default.accelerator.scaler, amprewrite.GradScaler)


def test_plain_fp16_trainer_on_a_cpu_trains_in_fp32(tmp_path, fp32_losses):
    """What ``Trainer(fp16=True)`` alone gives on a CPU: accelerate has no fp16 autocast there
    and makes no scaler, so it trains in fp32 (the same losses), silently."""
    trainer = _trainer(tmp_path, {"fp16": True}, with_amprewrite=False)
    assert trainer.accelerator.scaler is None and not trainer.accelerator.native_amp
    trainer.train()
    assert _losses(trainer) == pytest.approx(fp32_losses, rel=1e-6)


def test_evaluate_predict_checkpoint_resume_and_from_pretrained(tmp_path):
    trainer = _trainer(tmp_path / "run", {"fp16": True}, with_amprewrite=True,
                       save_strategy="steps", save_steps=2)
    trainer.train()
    data = _data(overflow.llama().inputs[0], 4)
    assert math.isfinite(trainer.evaluate(data)["eval_loss"])
    predicted = trainer.predict(data).predictions
    logits = predicted[0] if isinstance(predicted, tuple) else predicted
    assert logits.shape[0] == 4 and torch.isfinite(torch.as_tensor(logits)).all()

    checkpoint = tmp_path / "run" / "checkpoint-2"
    plain = type(trainer.model).from_pretrained(checkpoint)
    assert list(plain.state_dict()) == list(overflow.llama().model.state_dict())
    resumed = _trainer(tmp_path / "run", {"fp16": True}, with_amprewrite=True,
                       save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
    trainer.save_model(tmp_path / "final")
    final = type(trainer.model).from_pretrained(tmp_path / "final")
    mine = trainer.model.state_dict()
    assert all(torch.equal(t, mine[k]) for k, t in final.state_dict().items())


def test_enable_refuses_what_cannot_work(tmp_path):
    with pytest.raises(PolicyError, match="fp16=True or bf16=True"):
        _trainer(tmp_path, {}, with_amprewrite=True)
    case = overflow.llama()
    case.model.compile(backend="eager")
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    with pytest.raises(PolicyError, match="compiled already"):
        amp.enable(transformers.Trainer(model=case.model, args=args))


class _GrowAfterStep2(transformers.TrainerCallback):
    """Multiplies layer 0's v_proj by 1e6 after step 2: its values then pass the fp16 plan's
    ranges (weights that grow mid-training)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            with torch.no_grad():
                model.model.layers[0].self_attn.v_proj.weight.mul_(1e6)


def test_an_overflow_mid_training_costs_one_step_and_is_planned_again(tmp_path):
    """fp16: the step whose forward outgrew the plan is skipped once (amprewrite.GradScaler
    found inf), the plan is made again from the grown ranges, and the next steps are finite."""
    trainer = _trainer(tmp_path, {"fp16": True}, with_amprewrite=True, max_steps=4,
                       gradient_accumulation_steps=1)
    trainer.add_callback(_GrowAfterStep2())
    trainer.train()
    assert trainer.accelerator.scaler.overflows == 1
    losses = _losses(trainer)
    assert all(math.isfinite(v) and v > 1 for v in losses[3:]), losses
    replans = [e for e in amprewrite.report(trainer.model).replans
               if "GradScaler found inf" in e.reason]
    assert replans, amprewrite.report(trainer.model)


@pytest.mark.parametrize("precision", [{"bf16": True}, {"fp16": True}], ids=["bf16", "fp16"])
def test_params_low_trains_low_weights_with_amprewrites_optimizer_and_checkpoints(
        tmp_path, precision, fp32_losses):
    """``enable(trainer, params="low")``: the linear and embedding weights are stored low in
    the model, the Trainer's AdamW (its weight-decay groups, its scheduler) is an
    amprewrite.optimizer, the losses stay near fp32's (bf16 weights: within 2%, measured
    0.2-0.5%), and a checkpoint resumes and loads into an fp32 model."""
    from amprewrite.compile.optimizer import Optimizer

    def make(path, **more):
        torch._dynamo.reset()
        case = overflow.llama()
        args = transformers.TrainingArguments(
            str(path), use_cpu=True, per_device_train_batch_size=2, max_grad_norm=1.0,
            learning_rate=1e-3, weight_decay=0.01, report_to=[], logging_steps=1,
            disable_tqdm=True, seed=0, max_steps=3, gradient_accumulation_steps=2,
            **precision, **more)
        trainer = transformers.Trainer(model=case.model, args=args,
                                       train_dataset=_data(case.inputs[0]))
        return amp.enable(trainer, inner="eager", params="low")

    trainer = make(tmp_path / "run", save_strategy="steps", save_steps=2)
    low = torch.float16 if "fp16" in precision else torch.bfloat16
    model = trainer.model
    assert model.model.layers[0].mlp.up_proj.weight.dtype == low
    assert model.model.embed_tokens.weight.dtype == low
    assert model.model.norm.weight.dtype == torch.float32
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, Optimizer)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.01, 0.0]
    losses = _losses(trainer)
    assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(losses, fp32_losses)), (
        losses, fp32_losses)

    checkpoint = tmp_path / "run" / "checkpoint-2"
    resumed = make(tmp_path / "run", save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
    assert _losses(resumed)[-1] == losses[-1]  # the resumed step is the uninterrupted one
    trainer.save_model(tmp_path / "final")
    plain = type(model).from_pretrained(tmp_path / "final", dtype=torch.float32)
    assert {t.dtype for t in plain.state_dict().values()} == {torch.float32}
    mine = model.state_dict()
    assert all(torch.equal(t, mine[k].float()) for k, t in plain.state_dict().items())
