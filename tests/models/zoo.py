"""Real models from libraries nobody here wrote, built from small configs (random weights)."""

from __future__ import annotations

import torch


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(0, 256, (2, 64)),)


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    return BertModel(cfg).eval(), (torch.randint(0, 256, (2, 64)),)


def unet2d():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(32, 64),
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    return model.eval(), (torch.randn(2, 3, 16, 16), torch.tensor([10, 500]))


def first_tensor(out: object) -> torch.Tensor:
    """The main output of a model: a tensor, ModelOutput's first field, or .sample."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    if hasattr(out, "to_tuple"):
        return out.to_tuple()[0]
    return out[0]


MODELS = {"llama": llama, "bert": bert, "unet2d": unet2d}


def vae_decoder():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64),
                        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16)
    return vae.decoder.eval(), (torch.randn(1, 4, 8, 8),)
