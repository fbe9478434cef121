"""fp16 overflow on models amprewrite's overflow handling was not tuned on (issue 36).

    python -m benchmarks.overflow_unseen              # every case, about 90 s on 2 cores
    python -m benchmarks.overflow_unseen bert vit     # some cases (merged into the results)

Written by a helper session as a probe, kept as it ran: 28 cases built to overflow fp16
(the largest fp32 value of each scaled by bisection to about 3e5, 9e5 for two): Hugging Face
BERT, ViT, Mistral, Qwen2, Whisper's encoder, Wav2Vec2, diffusers' UNet2D and AutoencoderKL,
a plain CNN, elementwise and reduction overflows (``x.pow(2).mean``, ``exp``, a long sum,
cumsum, a hand-written variance norm), nn.TransformerEncoderLayer and MultiheadAttention, a
Gram matrix, an in-place residual, and three in train mode (gradients against fp32). Each
row: finite where fp32 is, the error of ``transform(model, "fp16", example_inputs=...)``
against fp32 and against the same with the overflowing modules kept fp32 by hand
(``amprewrite.testing.overflow.overflowing_modules``), the share of matmul FLOPs in fp16,
the transform's time, whether the model's parameters changed, and a fresh batch's error.
Writes docs/benchmarks/overflow_unseen.json.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
import traceback
import warnings

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from amprewrite.capture.verify import float_leaves, rel_err
from amprewrite.testing.overflow import matmul_flops, overflowing_modules
from amprewrite.testing.zoo import call

warnings.filterwarnings("ignore")
OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "overflow_unseen.json")
FP16 = 65504.0


# ----------------------------------------------------------------------------- helpers
def seed():
    torch.manual_seed(0)


class Peak(TorchDispatchMode):
    """Largest finite |value| of any aten op output (ignoring mask-like values >= 1e30)."""

    def __init__(self):
        super().__init__()
        self.peak = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                a = t.detach().abs().float()
                a = a[torch.isfinite(a) & (a < 1e30)]
                if a.numel():
                    self.peak = max(self.peak, float(a.max()))
        return out


def peak_of(model, inputs):
    # grad enabled so nn.TransformerEncoderLayer / MHA take the decomposed (non fast) path
    with Peak() as p:
        out = call(model, inputs)
    fin = all(bool(torch.isfinite(o).all()) for o in float_leaves(out))
    return p.peak, fin


def scale_params(model, inputs, names, target=3e5, lo_ok=1e5, hi_ok=1e6, peak_fn=None):
    """Multiply the parameters named (full names, or (name, slice)) by one factor found by
    bisection in log space so that the largest fp32 op value is ~target, outputs finite."""
    params = dict(model.named_parameters())
    items = []
    for n in names:
        name, sl = (n if isinstance(n, tuple) else (n, slice(None)))
        items.append((params[name], sl, params[name].detach()[sl].clone()))

    def setf(f):
        with torch.no_grad():
            for p, sl, orig in items:
                p[sl] = orig * f

    def measure(f):
        setf(f)
        pk, fin = peak_of(model, inputs)
        return (peak_fn(model, inputs), fin) if peak_fn else (pk, fin)

    base, _ = measure(1.0)
    lo, hi = 0.0, 0.0  # log2 factors
    pk, fin = base, True
    while pk < target and hi < 60:
        hi += 2.0
        pk, fin = measure(2 ** hi)
    for _ in range(30):
        mid = (lo + hi) / 2
        pk, fin = measure(2 ** mid)
        if pk < target:
            lo = mid
        else:
            hi = mid
        if abs(math.log(max(pk, 1e-30) / target)) < 0.05:
            break
    f = 2 ** ((lo + hi) / 2)
    pk, fin = measure(f)
    return {"factor": f, "peak_before": base, "peak_fp32": pk, "fp32_out_finite": fin,
            "peak_in_range": lo_ok <= pk <= hi_ok}


def clone_inputs(inputs):
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, inputs)


def inputs_equal(a, b):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(la, lb))


def state_equal(model, before):
    now = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    p_diff = [k for k in before if k in params and not torch.equal(before[k], now[k])]
    b_diff = [k for k in before if k not in params and not torch.equal(before[k], now[k])]
    return p_diff, b_diff


def rel_errs(outs, refs):
    return [rel_err(o, r) for o, r in zip(outs, refs)]


def bad_finite(outs, refs):
    """Count of positions where ref is finite and out is not."""
    return sum(int((torch.isfinite(r) & ~torch.isfinite(o.to(r.dtype))).sum())
               for o, r in zip(outs, refs))


def exc_info(e):
    tb = traceback.extract_tb(e.__traceback__)
    last = tb[-1] if tb else None
    return {"type": f"{type(e).__module__}.{type(e).__name__}",
            "amprewrite_error": isinstance(e, amprewrite.errors.AmpRewriteError),
            "msg": str(e)[:300],
            "where": f"{last.filename}:{last.lineno}" if last else ""}


def evaluate(name, model, inputs, scale_info, train=False, grad_params=()):
    row = {"case": name, **scale_info}
    with torch.no_grad():
        refs = [r.detach().clone() for r in float_leaves(call(model, inputs))]
    row["ref_finite"] = all(bool(torch.isfinite(r).all()) for r in refs)
    row["ref_absmax"] = max(float(r.abs().max()) for r in refs)
    ref_grads = {}
    if train:
        model.zero_grad(set_to_none=True)
        out = float_leaves(call(model, inputs))
        loss = sum(o.float().pow(2).mean() for o in out)
        loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                     if n in grad_params}
        model.zero_grad(set_to_none=True)
    inputs_copy = clone_inputs(inputs)
    try:
        half = copy.deepcopy(model).half()
        hin = pytree.tree_map(lambda t: t.half() if isinstance(t, torch.Tensor)
                              and t.is_floating_point() else t, inputs)
        with torch.no_grad():
            hout = float_leaves(call(half, hin))
        row["naive_half_finite"] = bad_finite(hout, refs) == 0
        row["naive_half_err"] = max(rel_errs(hout, refs))
        del half
    except Exception as e:
        row["naive_half_exc"] = exc_info(e)

    # by hand
    mods = overflowing_modules(model, inputs)
    row["by_hand_mods"] = mods
    hand = None
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    try:
        hand = amprewrite.transform(model, torch.float16, example_inputs=inputs, keep_fp32=mods)
    except Exception as e:
        row["by_hand_exc"] = exc_info(e)
        try:
            hand = amprewrite.transform(model, torch.float16, example_inputs=inputs,
                                        keep_fp32=mods, verify=False)
            row["by_hand_verify_false"] = True
        except Exception as e2:
            row["by_hand_exc2"] = exc_info(e2)
    row["hand_seconds"] = time.perf_counter() - t0
    p_diff, b_diff = state_equal(model, before)
    row["hand_params_changed"], row["hand_buffers_changed"] = p_diff, b_diff
    if hand is not None:
        with torch.no_grad():
            h_out = float_leaves(call(hand, inputs))
        row["err_hand"] = max(rel_errs(h_out, refs))
        row["hand_finite"] = bad_finite(h_out, refs) == 0
        row["hand_flops_low"] = _share(hand)
        if train:
            row["hand_grad_errs"] = grad_errs(model, hand, inputs, ref_grads, grad_params)
        del hand

    # the other overflow modes, for context
    for mode in ("fp32", "rescale"):
        try:
            g2 = amprewrite.transform(model, torch.float16, example_inputs=inputs,
                                      overflow=mode)
            with torch.no_grad():
                o2 = float_leaves(call(g2, inputs))
            row[f"err_{mode}"] = max(rel_errs(o2, refs))
            row[f"flops_low_{mode}"] = _share(g2)
        except Exception as e:
            row[f"exc_{mode}"] = exc_info(e)

    before = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # auto
    t0 = time.perf_counter()
    try:
        gm = amprewrite.transform(model, torch.float16, example_inputs=inputs)
    except Exception as e:
        row["seconds"] = time.perf_counter() - t0
        row["exc"] = exc_info(e)
        gm = None
    else:
        row["seconds"] = time.perf_counter() - t0
    p_diff, b_diff = state_equal(model, before)
    row["params_changed"] = p_diff
    row["buffers_changed"] = b_diff
    row["inputs_changed"] = not inputs_equal(inputs, inputs_copy)
    if gm is not None:
        with torch.no_grad():
            out = float_leaves(call(gm, inputs))
        row["n_outputs"] = len(out)
        row["out_dtypes"] = sorted({str(o.dtype) for o in out})
        row["nonfinite_where_ref_finite"] = bad_finite(out, refs)
        row["finite"] = row["nonfinite_where_ref_finite"] == 0
        errs = rel_errs(out, refs)
        row["errs"] = errs
        row["err"] = max(errs)
        row["flops_low"] = _share(gm)
        try:
            rep = amprewrite.report(gm)
            row["rescaled"] = sum(r.pass_name == "rescale_matmuls" for r in rep.rewrites)
        except Exception as e:
            row["report_exc"] = exc_info(e)
        if "err_hand" in row:
            row["ratio"] = (row["err"] / row["err_hand"]) if row["err_hand"] else (
                0.0 if row["err"] == 0 else math.inf)
        if train:
            row["grad_errs"] = grad_errs(model, gm, inputs, ref_grads, grad_params)
        try:
            fresh = fresh_inputs(inputs)
            with torch.no_grad():
                fr = float_leaves(call(model, fresh))
                fo = float_leaves(call(gm, fresh))
            row["fresh_ref_finite"] = all(bool(torch.isfinite(r).all()) for r in fr)
            row["fresh_finite"] = bad_finite(fo, fr) == 0
            row["fresh_err"] = max(rel_errs(fo, fr))
        except Exception as e:
            row["fresh_exc"] = exc_info(e)
    return row


def fresh_inputs(inputs):
    g = torch.Generator().manual_seed(1)

    def one(t):
        if not isinstance(t, torch.Tensor) or t.dtype == torch.bool:
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, generator=g) * t.std() + t.mean()
        return torch.randint(int(t.min()), int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype)
    return pytree.tree_map(one, inputs)


def grad_errs(model, gm, inputs, ref_grads, grad_params):
    model.zero_grad(set_to_none=True)
    out = float_leaves(call(gm, inputs))
    loss = sum(o.float().pow(2).mean() for o in out)
    loss.backward()
    g = {"loss_finite": bool(torch.isfinite(loss))}
    gparams = dict(model.named_parameters())
    for n in grad_params:
        grad = gparams[n].grad
        if grad is None:
            g[n] = "None"
            continue
        r = ref_grads[n].double()
        gg = grad.double()
        g[n] = (math.inf if not torch.isfinite(gg).all()
                else float((gg - r).norm() / r.norm().clamp_min(1e-30)))
    model.zero_grad(set_to_none=True)
    return g


def _share(gm):
    try:
        low, total = matmul_flops(gm)
        return low / total if total else None
    except Exception as e:
        return f"exc {type(e).__name__}: {str(e)[:100]}"


def _tokens(b=2, s=32, v=256):
    return torch.randint(0, v, (b, s))


# ----------------------------------------------------------------------------- cases
def case_bert():
    from transformers import BertConfig, BertModel
    cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)
    seed()
    model = BertModel(cfg).eval()
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, 24:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    s = scale_params(model, inputs, ["encoder.layer.1.intermediate.dense.weight",
                                     "encoder.layer.1.intermediate.dense.bias"])
    return "bert", model, inputs, s


def case_vit():
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    seed()
    model = ViTModel(cfg).eval()
    inputs = (torch.randn(2, 3, 32, 32),)
    s = scale_params(model, inputs, ["layers.0.mlp.fc1.weight"])
    return "vit", model, inputs, s


def _input_peak(path):
    def fn(model, inputs):
        got = [0.0]
        mod = model.get_submodule(path)
        h = mod.register_forward_hook(
            lambda m, a, o: got.__setitem__(0, max(got[0], float(a[0].detach().abs().max()))))
        with torch.no_grad():
            call(model, inputs)
        h.remove()
        return got[0]
    return fn


def case_mistral():
    from transformers import MistralConfig, MistralModel
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, sliding_window=16, use_cache=False)
    seed()
    model = MistralModel(cfg).eval()
    inputs = (_tokens(s=32),)
    s = scale_params(model, inputs, ["layers.0.mlp.up_proj.weight"],
                     peak_fn=_input_peak("layers.0.mlp.down_proj"))
    s["peak_graph_values"] = peak_of(model, inputs)[0]
    return "mistral", model, inputs, s


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)
    seed()
    return Qwen2ForCausalLM(cfg).eval(), (_tokens(s=24),)


def case_qwen2():
    model, inputs = _qwen2()
    s = scale_params(model, inputs, ["model.layers.1.mlp.gate_proj.weight",
                                     "model.layers.1.mlp.up_proj.weight"],
                     peak_fn=_input_peak("model.layers.1.mlp.down_proj"))
    s["peak_graph_values"] = peak_of(model, inputs)[0]
    return "qwen2", model, inputs, s


def case_whisper_enc():
    from transformers import WhisperConfig, WhisperModel
    cfg = WhisperConfig(vocab_size=256, num_mel_bins=16, d_model=64, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
                        max_target_positions=32, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1, use_cache=False)
    seed()
    model = WhisperModel(cfg).encoder.eval()
    inputs = (torch.randn(2, 16, 64),)
    s = scale_params(model, inputs, ["conv1.weight", "conv1.bias"])
    return "whisper_enc", model, inputs, s


def case_wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    cfg = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                         num_conv_pos_embedding_groups=4)
    seed()
    model = Wav2Vec2Model(cfg).eval()
    inputs = (torch.randn(2, 1600),)
    s = scale_params(model, inputs, ["feature_extractor.conv_layers.1.conv.weight"])
    return "wav2vec2", model, inputs, s


def case_unet2d():
    from diffusers import UNet2DModel
    seed()
    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(32, 64),
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8).eval()
    inputs = (torch.randn(2, 3, 16, 16), torch.tensor([10, 500]))
    s = scale_params(model, inputs, ["down_blocks.0.resnets.0.conv2.weight",
                                     "down_blocks.0.resnets.0.conv2.bias"])
    return "unet2d", model, inputs, s


def case_vae():
    from diffusers import AutoencoderKL
    seed()
    model = AutoencoderKL(in_channels=3, out_channels=3,
                          down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64),
                          layers_per_block=1, latent_channels=4, norm_num_groups=16,
                          sample_size=16).eval()
    inputs = (torch.randn(2, 3, 16, 16),)
    s = scale_params(model, inputs, ["decoder.up_blocks.0.resnets.0.conv1.weight",
                                     "decoder.up_blocks.0.resnets.0.conv1.bias"])
    return "vae", model, inputs, s


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        c = [3, 16, 32, 32]
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(c[i], c[i + 1], 3, padding=1),
                                                  nn.BatchNorm2d(c[i + 1]), nn.ReLU())
                                    for i in range(3)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.body(x)), 1))


def _convnet():
    seed()
    model = ConvNet()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 16, 16))
    return model


def case_convnet():
    model = _convnet().eval()
    inputs = (torch.randn(2, 3, 16, 16),)
    s = scale_params(model, inputs, ["body.1.0.weight", "body.1.0.bias"])
    return "convnet", model, inputs, s


class PowMean(nn.Module):
    """Un-upcast RMS statistic: x.pow(2) passes 65504 for inputs ~300."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))
        self.fc = nn.Linear(64, 8)

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return self.fc(x * torch.rsqrt(ms + 1e-6) * self.w), ms.sqrt()


def case_elem_pow():
    seed()
    model = PowMean().eval()
    x = torch.randn(2, 16, 64)
    x = x * (math.sqrt(3e5) / float(x.abs().max()))  # max |x| ~548, x^2 max 3e5
    inputs = (x,)
    pk, fin = peak_of(model, inputs)
    return "elem_pow", model, inputs, {"factor": 1.0, "peak_fp32": pk, "fp32_out_finite": fin,
                                       "peak_in_range": 1e5 <= pk <= 1e6}


class ExpNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        e = torch.exp(self.proj(x))
        s = e.sum(-1, keepdim=True)
        return self.head(e / s * 64), torch.log(s)


def case_elem_exp():
    seed()
    model = ExpNorm().eval()
    inputs = (torch.randn(2, 16, 64),)
    s = scale_params(model, inputs, ["proj.weight"])
    return "elem_exp", model, inputs, s


class SumReduce(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 4096)
        self.head = nn.Linear(4096, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))              # ~50 on average
        s = h.sum(-1, keepdim=True)             # ~2e5
        return self.head(h * (64.0 / s)), torch.log(s)


def case_sum_reduce():
    seed()
    model = SumReduce().eval()
    inputs = (torch.randn(2, 16, 64),)
    s = scale_params(model, inputs, ["up.weight", "up.bias"], target=2e5)
    with torch.no_grad():
        s["h_mean"] = float(torch.relu(model.up(inputs[0])).mean())
    return "sum_reduce", model, inputs, s


class TEL(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.layer(x))


def case_tel():
    seed()
    model = TEL().eval()
    inputs = (torch.randn(2, 32, 64),)
    s = scale_params(model, inputs, ["layer.self_attn.in_proj_weight"])
    return "tel_inproj", model, inputs, s


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(64, 4, batch_first=True)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 8)

    def forward(self, x, pad):
        a, _ = self.mha(x, x, x, key_padding_mask=pad, need_weights=False)
        return self.head(self.norm(x + a))


def case_mha_v():
    seed()
    model = MHA().eval()
    pad = torch.zeros(2, 32, dtype=torch.bool)
    pad[1, 20:] = True
    inputs = (torch.randn(2, 32, 64), pad)
    s = scale_params(model, inputs, [("mha.in_proj_weight", slice(128, 192))])
    return "mha_vslice", model, inputs, s


def case_train_convnet():
    model = _convnet().train()
    inputs = (torch.randn(4, 3, 16, 16),)
    s = scale_params(model, inputs, ["body.1.0.weight", "body.1.0.bias"])
    return "train_convnet", model, inputs, s


class TinyTf(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0,
                                                               batch_first=True,
                                                               norm_first=True)
                                    for _ in range(2))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def case_train_tf():
    seed()
    model = TinyTf().train()
    inputs = (torch.randn(2, 16, 32),)
    s = scale_params(model, inputs, ["blocks.0.linear1.weight", "blocks.0.linear1.bias"])
    return "train_tf", model, inputs, s


def _bert_cfg(**kw):
    from transformers import BertConfig
    return BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=128, **kw)


def _bert_scores_peak(model, inputs):
    """max |q k^T| (before 1/sqrt(d)) in layer 0: inside SDPA, never a graph value."""
    got = {}
    att = model.encoder.layer[0].attention.self
    hs = [att.query.register_forward_hook(lambda m, a, o: got.__setitem__("q", o)),
          att.key.register_forward_hook(lambda m, a, o: got.__setitem__("k", o))]
    with torch.no_grad():
        call(model, inputs)
    for h in hs:
        h.remove()
    q, k = (got[n].unflatten(-1, (4, 16)).transpose(1, 2) for n in "qk")
    return float((q @ k.transpose(-1, -2)).abs().max())


def case_bert_qk():
    from transformers import BertModel
    seed()
    model = BertModel(_bert_cfg()).eval()
    inputs = {"input_ids": _tokens()}
    s = scale_params(model, inputs, [f"encoder.layer.0.attention.self.{n}.{p}"
                                     for n in ("query", "key") for p in ("weight", "bias")],
                     peak_fn=_bert_scores_peak)
    s["peak_graph_values"] = peak_of(model, inputs)[0]
    return "bert_qk_sdpa", model, inputs, s


def case_qwen2_logits():
    model, inputs = _qwen2()
    s = scale_params(model, inputs, ["lm_head.weight"])
    return "qwen2_logits", model, inputs, s


class BigInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc(self.norm(x))


def case_big_input():
    seed()
    model = BigInput().eval()
    x = torch.randn(2, 16, 64) * 5e4 + 1e5   # input itself past 65504
    pk, fin = peak_of(model, (x,))
    return "big_input", model, (x,), {"factor": 1.0, "peak_fp32": pk, "fp32_out_finite": fin,
                                      "peak_in_range": 1e5 <= pk <= 1e6}


class Gram(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.head = nn.Linear(32 * 32, 10)

    def forward(self, x):
        f = torch.relu(self.conv(x)).flatten(2)          # (B, C, HW)
        g = f @ f.transpose(1, 2)                         # activation x activation, ~3e5
        return self.head((g / f.shape[-1]).flatten(1))


def case_gram():
    seed()
    model = Gram().eval()
    inputs = (torch.randn(2, 3, 16, 16),)
    s = scale_params(model, inputs, ["conv.weight", "conv.bias"])
    return "gram_bmm", model, inputs, s


class CumSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 2048)
        self.head = nn.Linear(2048, 8)

    def forward(self, x):
        c = torch.relu(self.up(x)).cumsum(-1)
        return self.head(c / c[..., -1:]), c[..., -1]


def case_cumsum():
    seed()
    model = CumSum().eval()
    inputs = (torch.randn(2, 16, 64),)
    s = scale_params(model, inputs, ["up.weight", "up.bias"])
    return "cumsum", model, inputs, s


class VarNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        h = self.fc(x)
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return self.head((h - mu) / torch.sqrt(var + 1e-5))


def case_var_norm():
    seed()
    model = VarNorm().eval()
    inputs = (torch.randn(2, 16, 64),)
    s = scale_params(model, inputs, ["fc.weight", "fc.bias"])
    return "var_norm", model, inputs, s


class InplaceRes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        h = x.clone()
        for fc in self.fcs:
            h += torch.relu(fc(h))
        h.div_(h.norm(dim=-1, keepdim=True))
        return self.head(h)


def case_inplace():
    seed()
    model = InplaceRes().eval()
    inputs = (torch.randn(2, 16, 64),)
    s = scale_params(model, inputs, ["fcs.1.weight", "fcs.1.bias"])
    return "inplace_res", model, inputs, s


def case_train_bert():
    from transformers import BertModel
    seed()
    model = BertModel(_bert_cfg(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model.train()
    inputs = {"input_ids": _tokens(s=16)}
    s = scale_params(model, inputs, ["encoder.layer.0.intermediate.dense.weight",
                                     "encoder.layer.0.intermediate.dense.bias"])
    return "train_bert", model, inputs, s


def case_bert_hi():
    from transformers import BertModel
    seed()
    model = BertModel(_bert_cfg()).eval()
    inputs = {"input_ids": _tokens()}
    s = scale_params(model, inputs, ["encoder.layer.1.intermediate.dense.weight",
                                     "encoder.layer.1.intermediate.dense.bias"], target=9e5)
    return "bert_peak9e5", model, inputs, s


def case_convnet_hi():
    model = _convnet().eval()
    inputs = (torch.randn(2, 3, 16, 16),)
    s = scale_params(model, inputs, ["body.0.0.weight", "body.0.0.bias"], target=9e5)
    return "convnet_peak9e5", model, inputs, s


def case_bert_embed():
    from transformers import BertModel
    seed()
    model = BertModel(_bert_cfg()).eval()
    inputs = {"input_ids": _tokens()}
    s = scale_params(model, inputs, ["embeddings.word_embeddings.weight"])
    return "bert_big_embed", model, inputs, s


class LayerScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.gamma = nn.Parameter(torch.full((64,), 1.0))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.norm(x + self.gamma * self.fc(x)))


def case_layerscale():
    seed()
    model = LayerScale().eval()
    inputs = (torch.randn(2, 16, 64),)
    s = scale_params(model, inputs, ["gamma"])   # gamma itself ends up > 65504
    s["gamma"] = float(model.gamma[0])
    return "big_param_gamma", model, inputs, s


CASES = {
    "bert": case_bert, "vit": case_vit, "mistral": case_mistral, "qwen2": case_qwen2,
    "whisper_enc": case_whisper_enc, "wav2vec2": case_wav2vec2, "unet2d": case_unet2d,
    "vae": case_vae, "convnet": case_convnet, "elem_pow": case_elem_pow,
    "elem_exp": case_elem_exp, "sum_reduce": case_sum_reduce, "tel_inproj": case_tel,
    "mha_vslice": case_mha_v, "bert_qk_sdpa": case_bert_qk, "qwen2_logits": case_qwen2_logits,
    "big_input": case_big_input, "gram_bmm": case_gram, "cumsum": case_cumsum,
    "var_norm": case_var_norm, "inplace_res": case_inplace, "bert_peak9e5": case_bert_hi,
    "convnet_peak9e5": case_convnet_hi, "bert_big_embed": case_bert_embed,
    "big_param_gamma": case_layerscale,
    "train_convnet": case_train_convnet, "train_tf": case_train_tf, "train_bert": case_train_bert,
}
TRAIN_GRADS = {
    "train_convnet": ["body.0.0.weight", "body.1.0.weight", "body.2.0.weight", "fc.weight"],
    "train_tf": ["inp.weight", "blocks.0.linear1.weight", "blocks.0.linear2.weight",
                 "blocks.1.self_attn.in_proj_weight", "head.weight"],
    "train_bert": ["embeddings.word_embeddings.weight", "encoder.layer.0.intermediate.dense.weight",
                   "encoder.layer.0.output.dense.weight", "encoder.layer.1.output.dense.weight",
                   "pooler.dense.weight"],
}


def run_case(key):
    t0 = time.perf_counter()
    try:
        name, model, inputs, s = CASES[key]()
    except Exception as e:
        return {"case": key, "build_exc": exc_info(e)}
    try:
        row = evaluate(name, model, inputs, s, train=key.startswith("train"),
                       grad_params=TRAIN_GRADS.get(key, ()))
    except Exception as e:
        row = {"case": key, **s, "probe_exc": exc_info(e), "tb": traceback.format_exc()[-1500:]}
    row["case_seconds"] = time.perf_counter() - t0
    return row


def fmt(r):
    def f(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    exc = r.get("exc") or r.get("build_exc") or r.get("probe_exc")
    return (f"{r['case']:14s} peak={f(r.get('peak_fp32'))} finite={r.get('finite')} "
            f"err={f(r.get('err'))} hand={f(r.get('err_hand'))} ratio={f(r.get('ratio'))} "
            f"low={f(r.get('flops_low'))} t={f(r.get('seconds'))} "
            f"pchg={len(r.get('params_changed', []))} bchg={len(r.get('buffers_changed', []))}"
            + f" naive_finite={r.get('naive_half_finite')} fresh_finite={r.get('fresh_finite')}"
            f" fresh_err={f(r.get('fresh_err'))}"
            + (f" grads={r['grad_errs']}" if "grad_errs" in r else "")
            + (f" HANDEXC={r['by_hand_exc']['type']}" if "by_hand_exc" in r else "")
            + (f" EXC={exc['type']}: {exc['msg'][:150]}" if exc else ""))


def main(argv):
    keys = argv or list(CASES)
    results = {}
    if os.path.exists(OUT) and argv:
        with open(OUT) as fh:
            results = json.load(fh)
    for k in keys:
        r = run_case(k)
        results[k] = r
        print(fmt(r), flush=True)
        with open(OUT, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
