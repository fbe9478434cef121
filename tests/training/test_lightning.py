"""amprewrite.trainers.lightning: a Lightning Trainer with ``AmpRewritePrecision`` trains on
amprewrite's plan, without Lightning's autocast, with amprewrite.GradScaler in fp16.

The model is amprewrite.testing.overflow's LLaMA (2 layers, hidden 64), its up projections
scaled so that their values reach 2e5, past fp16's 65504: autocast fp16 gives inf there, the
plan keeps those matmuls fp32. Four SGD steps with gradient clipping; the losses are compared
with the same Trainer in fp32 (relative tolerance: bf16 1e-3, fp16 2e-4; measured through
accelerate's loop 3e-5 and 4e-6: the loss is a mean over 64 tokens).
"""

import copy
import math

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from amprewrite.compile.scaler import GradScaler  # noqa: E402
from amprewrite.testing.overflow import llama  # noqa: E402
from amprewrite.trainers.lightning import AmpRewritePrecision  # noqa: E402

STEPS = 4
RTOL = {"bf16": 1e-3, "fp16": 2e-4}


def causal_lm(lightning_module: type) -> type:
    """The test's LightningModule on ``lightning_module`` (``lightning.pytorch``'s or
    ``pytorch_lightning``'s): the net's loss, each step's loss and autocast state kept."""

    class CausalLM(lightning_module):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net
            self.losses: list[float] = []
            self.autocast: list[bool] = []  # torch.is_autocast_enabled("cpu") per forward

        def training_step(self, batch, batch_idx):
            self.autocast.append(torch.is_autocast_enabled("cpu"))
            loss = self.net(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return CausalLM


CausalLM = causal_lm(pl.LightningModule)


@pytest.fixture(scope="module")
def net() -> torch.nn.Module:
    return llama().model.train()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (2, 32), generator=g) for _ in range(8)]


def _fit(net, tmp_path, steps=STEPS, ckpt=None, **trainer_args) -> tuple[CausalLM, pl.Trainer]:
    torch._dynamo.reset()
    model = CausalLM(copy.deepcopy(net))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, **trainer_args)
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    trainer.fit(model, loader, ckpt_path=ckpt)
    return model, trainer


@pytest.fixture(scope="module")
def fp32_losses(net, tmp_path_factory) -> list[float]:
    return _fit(net, tmp_path_factory.mktemp("fp32"))[0].losses


def test_lightning_autocast_is_what_the_plugin_removes(net, tmp_path):
    """The probe sees Lightning's own autocast, and its fp16 autocast (Lightning's plugin made
    for the CPU: precision="16-mixed" would become bf16 there) gives a NaN loss on this model."""
    model, _ = _fit(net, tmp_path, steps=1, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert model.autocast == [True]
    assert math.isnan(model.losses[0])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_trains_on_the_plan_without_autocast(net, tmp_path, fp32_losses, dtype):
    plugin = AmpRewritePrecision(dtype, device="cpu", options={"inner": "eager"})
    model, trainer = _fit(net, tmp_path, plugins=[plugin])
    assert trainer.precision_plugin is plugin
    assert model.autocast == [False] * STEPS
    assert torch.is_autocast_enabled("cpu") is False
    # the network runs compiled, in place: its parameters and checkpoint keys are the model's
    assert model.net._compiled_call_impl is not None
    assert model.state_dict().keys() == CausalLM(net).state_dict().keys()
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(fp32_losses),
                               rtol=RTOL[dtype], atol=0)
    if dtype == "fp16":
        assert isinstance(plugin.scaler, GradScaler) and plugin.scaler.overflows == 0


def test_fp16_checkpoint_restores_the_scaler(net, tmp_path):
    """fit(ckpt_path=...) resumes: the step count, and the scaler's scale from the checkpoint."""
    plugin = AmpRewritePrecision("fp16", device="cpu", options={"inner": "eager"},
                                 scaler=GradScaler("cpu", init_scale=2.0**9))
    _, trainer = _fit(net, tmp_path, steps=2, plugins=[plugin])
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["AmpRewritePrecision"]["scale"] == 2.0**9

    fresh = AmpRewritePrecision("fp16", device="cpu", options={"inner": "eager"})
    assert fresh.scaler.get_scale() == 2.0**16
    model, trainer = _fit(net, tmp_path, steps=3, ckpt=str(ckpt), plugins=[fresh])
    assert trainer.global_step == 3 and len(model.losses) == 1
    assert fresh.scaler.get_scale() == 2.0**9
    assert all(torch.isfinite(torch.tensor(model.losses)))


def test_wrong_dtype_and_scaler_are_refused():
    with pytest.raises(ValueError, match="must be 'bf16' or 'fp16'"):
        AmpRewritePrecision("fp32")
    with pytest.raises(TypeError, match=r"amprewrite\.GradScaler"):
        AmpRewritePrecision("fp16", device="cpu", scaler=torch.amp.GradScaler("cpu"))


def test_per_block_modules(net, tmp_path, fp32_losses):
    """modules= compiles the blocks it names, each in place, and nothing else."""
    plugin = AmpRewritePrecision("fp16", device="cpu", options={"inner": "eager"},
                                 modules=lambda m: m.net.model.layers)
    model, _ = _fit(net, tmp_path, steps=2, plugins=[plugin])
    assert [layer._compiled_call_impl is not None for layer in model.net.model.layers] == [True] * 2
    assert model.net._compiled_call_impl is None
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(fp32_losses[:2]),
                               rtol=RTOL["fp16"], atol=0)


class AdamWLM(CausalLM):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                        "interval": "step"}]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_params_low_trains_with_amprewrites_optimizer_and_resumes(net, tmp_path, dtype):
    """``AmpRewritePrecision(..., params="low")``: low weights in the network, the AdamW of
    configure_optimizers an amprewrite.optimizer (its StepLR still halves the rate), clipping
    at 1.0 (and the fp16 scaler) working, losses within 2% of the same recipe in fp32, and a
    checkpoint that resumes with the optimizer's state."""
    from amprewrite.compile.optimizer import Optimizer

    def fit(steps, plugins=(), ckpt=None):
        torch._dynamo.reset()
        model = AdamWLM(copy.deepcopy(net))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps,
                             gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, plugins=list(plugins))
        trainer.fit(model, torch.utils.data.DataLoader(_batches(), batch_size=None),
                    ckpt_path=ckpt)
        return model, trainer

    plugin = lambda: AmpRewritePrecision(dtype, device="cpu", params="low",  # noqa: E731
                                         options={"inner": "eager"})
    ref, _ = fit(STEPS)
    model, trainer = fit(STEPS, [plugin()])
    low = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert model.net.model.layers[0].mlp.down_proj.weight.dtype == low
    assert model.net.model.norm.weight.dtype == torch.float32
    opt = trainer.optimizers[0]
    assert isinstance(opt, Optimizer) and opt.steps == STEPS
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**STEPS)
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(ref.losses),
                               rtol=0.02, atol=0)
    ckpt = tmp_path / "low.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, trainer = fit(STEPS + 1, [plugin()], ckpt=str(ckpt))
    assert trainer.optimizers[0].steps == STEPS + 1 and len(resumed.losses) == 1


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_fit_under_either_package_name(net, tmp_path, fp32_losses, package, no_inductor):
    """``lightning.Trainer`` and ``pytorch_lightning.Trainer`` both take the plugin (issue 65:
    pytorch_lightning refused it as an invalid plugin type) and train on the plan: fp16 with
    amprewrite's scaler, its checkpoint entry, no autocast, losses within fp16's tolerance of
    fp32's; and with no ``options`` inductor compiles nothing on the CPU (``no_inductor``): the
    graphs run eagerly, the fit takes seconds, not inductor's minutes."""
    lib = pytest.importorskip(package)
    import importlib

    plugins = importlib.import_module(f"{package}.plugins.precision")

    LM = causal_lm(lib.LightningModule)
    torch._dynamo.reset()
    plugin = AmpRewritePrecision("fp16", device="cpu")
    assert isinstance(plugin, plugins.Precision)
    model = LM(copy.deepcopy(net))
    trainer = lib.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, gradient_clip_val=1.0,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=tmp_path,
                          plugins=[plugin])
    trainer.fit(model, torch.utils.data.DataLoader(_batches(), batch_size=None))
    assert trainer.precision_plugin is plugin and model.autocast == [False] * STEPS
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(fp32_losses),
                               rtol=RTOL["fp16"], atol=0)
    assert isinstance(plugin.scaler, GradScaler) and plugin.scaler.overflows == 0
    ckpt = tmp_path / "scaler.ckpt"
    trainer.save_checkpoint(ckpt)
    assert "AmpRewritePrecision" in torch.load(ckpt, weights_only=False)
