"""Real models from libraries nobody here wrote, built from small configs (random weights, no
downloads), plus a ResNet-style CNN with BatchNorm. Each builder returns ``(model, inputs)`` where
``inputs`` is a tuple of positional inputs or a dict of keyword inputs, as
:func:`amprewrite.transform` takes ``example_inputs``.

Shared by the tests (tests/models) and the benchmarks (``python -m benchmarks.conformance``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def _seed() -> None:
    torch.manual_seed(0)


def _tokens(batch: int = 2, seq: int = 64, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


# ----------------------------------------------------------------------------- transformers
def llama_lm(vocab: int = 256, hidden: int = 64, intermediate: int = 128, layers: int = 2,
             positions: int = 512) -> nn.Module:
    """A transformers ``LlamaForCausalLM`` of these sizes (4 heads, 2 key-value heads, no
    cache), seeded, in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=positions, use_cache=False)
    _seed()
    return LlamaForCausalLM(cfg).train()


def llama_tp(mesh: object, backend_options: dict | None = None) -> nn.Module:
    """:func:`llama_lm` with every decoder layer tensor parallel over ``mesh`` (a 1-D
    ``DeviceMesh``) by torch's LLaMA plan: q/k/v/gate/up ``ColwiseParallel``, o/down
    ``RowwiseParallel``; with ``backend_options`` each layer is then
    ``torch.compile(layer, backend="amprewrite", options=backend_options)``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    col, row = ColwiseParallel, RowwiseParallel
    model = llama_lm()
    for k, layer in enumerate(model.model.layers):
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
            "self_attn.o_proj": row(), "mlp.gate_proj": col(), "mlp.up_proj": col(),
            "mlp.down_proj": row()})
        if backend_options is not None:
            model.model.layers[k] = torch.compile(layer, backend="amprewrite",
                                                  options=backend_options)
    return model


def llama():
    return llama_lm().eval(), (_tokens(),)


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, sliding_window=32, use_cache=False)
    _seed()
    return MistralForCausalLM(cfg).eval(), (_tokens(),)


def mixtral():
    """Mixture of experts: 4 experts, top-2 routing (softmax over router logits, topk)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                        use_cache=False)
    _seed()
    return MixtralForCausalLM(cfg).eval(), (_tokens(),)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    _seed()
    return GPT2LMHeadModel(cfg).eval(), (_tokens(),)


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)
    _seed()
    return BertModel(cfg).eval(), (_tokens(),)


def t5():
    """Encoder-decoder with relative position buckets (integer → float → log in the graph)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                   decoder_start_token_id=0, use_cache=False)
    _seed()
    model = T5ForConditionalGeneration(cfg).eval()
    return model, {"input_ids": _tokens(seq=32), "decoder_input_ids": _tokens(seq=16)}


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                    num_labels=10)
    _seed()
    return ViTForImageClassification(cfg).eval(), (torch.randn(2, 3, 32, 32),)


def whisper():
    """Audio encoder-decoder: conv1d over mel features, sinusoidal positions, cross-attention."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=256, num_mel_bins=16, d_model=64, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
                        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1, use_cache=False)
    _seed()
    model = WhisperForConditionalGeneration(cfg).eval()
    return model, {"input_features": torch.randn(2, 16, 64), "decoder_input_ids": _tokens(seq=16)}


def swin():
    """Shifted-window vision transformer: window partition/reverse, rolls, relative bias."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=64, patch_size=4, embed_dim=24, depths=[2, 2, 2],
                     num_heads=[2, 2, 4], window_size=4, num_labels=10)
    _seed()
    return SwinForImageClassification(cfg).eval(), (torch.randn(2, 3, 64, 64),)


def efficientnet():
    """EfficientNet-B0's depth (16 MBConv blocks: depthwise conv, squeeze-excite, BatchNorm,
    SiLU) at a quarter of its width."""
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    cfg = EfficientNetConfig(image_size=64, width_coefficient=0.25, depth_coefficient=1.0,
                             hidden_dim=320, num_labels=10)
    _seed()
    model = EfficientNetForImageClassification(cfg).eval()
    # transformers' init (normal, std 0.02) shrinks the activations to exactly 0 by block 6,
    # so every output was 0 and any error check passed; He init keeps them alive.
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        elif isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Linear)):
            m.reset_parameters()
    return model, (torch.randn(2, 3, 64, 64),)


def wav2vec2():
    """Audio encoder whose positional convolution is ``weight_norm``-parametrized."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    cfg = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=4)
    _seed()
    return Wav2Vec2Model(cfg).eval(), (torch.randn(2, 1600),)


# ----------------------------------------------------------------------------- diffusers
def unet2d():
    from diffusers import UNet2DModel

    _seed()
    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(32, 64),
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    return model.eval(), (torch.randn(2, 3, 16, 16), torch.tensor([10, 500]))


def unet2d_condition():
    """The Stable Diffusion UNet shape: cross-attention to text states, timestep embedding."""
    from diffusers import UNet2DConditionModel

    _seed()
    model = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4,
                                 layers_per_block=1, block_out_channels=(32, 64),
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                 cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    return model.eval(), (torch.randn(2, 4, 16, 16), torch.tensor([10, 500]),
                          torch.randn(2, 7, 32))


def _autoencoder_kl():
    from diffusers import AutoencoderKL

    _seed()
    return AutoencoderKL(in_channels=3, out_channels=3,
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64),
                         layers_per_block=1, latent_channels=4, norm_num_groups=8,
                         sample_size=16).eval()


def autoencoder_kl():
    """Encode (posterior mode) and decode: forward(sample) with sample_posterior=False."""
    return _autoencoder_kl(), (torch.randn(2, 3, 16, 16),)


def vae_decoder():
    return _autoencoder_kl().decoder, (torch.randn(1, 4, 8, 8),)


# ----------------------------------------------------------------------------- plain CNN
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + identity)


class ResNet(nn.Module):
    """A small ResNet-18-style classifier: BatchNorm after every conv, residual adds."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 32, 2),
                                    BasicBlock(32, 64, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def resnet():
    _seed()
    model = ResNet()
    with torch.no_grad():  # non-trivial running statistics, as after training
        for _ in range(3):
            model(torch.randn(8, 3, 32, 32) * 2 + 0.5)
    return model.eval(), (torch.randn(8, 3, 32, 32),)


# ----------------------------------------------------------------------------- helpers
MODELS = {
    "llama": llama, "mistral": mistral, "mixtral": mixtral, "gpt2": gpt2, "bert": bert,
    "t5": t5, "vit": vit, "whisper": whisper, "unet2d": unet2d,
    "unet2d_condition": unet2d_condition, "autoencoder_kl": autoencoder_kl, "resnet": resnet,
}
# More architectures, outside the conformance matrix (docs/models.md): the capture-time table
# (python -m benchmarks.capture) and tests/models/test_real_models.py.
MORE = {"swin": swin, "efficientnet": efficientnet, "wav2vec2": wav2vec2}
def _eager_experts(model: nn.Module) -> nn.Module:
    """A copy of a transformers MoE model whose experts run as transformers' eager loop (one
    matmul per expert, ``F.linear``) instead of the ``transformers::grouped_mm_fallback`` custom
    op: the same weights and the same fp32 values, but ops autocast can reach."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "eager"
    return twin


# The model autocast's error is measured on, where autocast cannot reach ops that amprewrite
# does: under autocast, Mixtral's experts (a custom op whose body calls ``torch.mm``) run in
# fp32, so its error would compare low experts with fp32 ones (docs/models.md says which).
AUTOCAST_TWIN = {"mixtral": _eager_experts}

LIBRARY = {"unet2d": "diffusers", "unet2d_condition": "diffusers", "autoencoder_kl": "diffusers",
           "resnet": "tests (torch.nn)"}


def call(model: nn.Module, inputs) -> object:
    """``model(*inputs)`` for a tuple, ``model(**inputs)`` for a dict."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def cast_inputs(inputs, dtype: torch.dtype):
    """Floating-point inputs cast to ``dtype`` (for the ``model.to(dtype)`` baseline)."""
    def one(a):
        return a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return tuple(one(a) for a in inputs)


def first_tensor(out: object) -> torch.Tensor:
    """The main output of a model: a tensor, ModelOutput's first field, or .sample."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    if hasattr(out, "to_tuple"):
        return out.to_tuple()[0]
    return out[0]
