"""Real models: run-time precision classes, model.to(dtype) crashes, position cones, upsample."""

import copy
import functools

import pytest
import torch

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.precision.ops import Precision
from amprewrite.testing.zoo import AUTOCAST_TWIN, MODELS, call, first_tensor

from ..helpers import LOW_DTYPES, assert_classes_respected, unchanged

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

# One dtype of each model in the default run, both dtypes among them; the others are slow
# (the UNet's fp16 ~15 s; the LLaMA's fp16 and BERT's bf16 2-3 s each, the same code paths).
_CLASSES_FAST = {("llama", torch.bfloat16), ("bert", torch.float16), ("unet2d", torch.bfloat16)}


@functools.cache
def transformed(name: str, dtype: torch.dtype) -> tuple:
    """``(model, inputs, gm)``: the zoo model transformed on its example inputs, the model
    unchanged by it; shared by the tests that read the same graph (a UNet's costs ~5 s)."""
    model, inputs = MODELS[name]()
    with unchanged(model):
        gm = amprewrite.transform(model, dtype=dtype, example_inputs=inputs)
    return model, inputs, gm


@pytest.mark.parametrize(("name", "dtype"), [
    (name, dtype) if (name, dtype) in _CLASSES_FAST
    else pytest.param(name, dtype, marks=pytest.mark.slow)
    for name in ("llama", "bert", "unet2d") for dtype in LOW_DTYPES])
def test_real_model_classes_respected_at_run_time(name, dtype):
    """Every LOW node gets only ``dtype`` inputs and every FP32 node only fp32 ones, at run time.

    (The error against fp32 and autocast is tested for every model in test_conformance.py.)
    """
    _, inputs, gm = transformed(name, dtype)
    assert_classes_respected(gm, *inputs, low=dtype)
    classes = {n.meta.get(M.CLASS) for n in gm.graph.nodes}
    assert {Precision.LOW, Precision.FP32} <= classes


def test_unet2d_works_where_model_to_bf16_crashes():
    """On the same fp32 inputs, model.to(bf16) crashes; the transformed graph is a drop-in."""
    model, (x, t), gm = transformed("unet2d", torch.bfloat16)
    with pytest.raises(RuntimeError, match="should be the same"):
        copy.deepcopy(model).to(torch.bfloat16)(x, t)
    assert torch.isfinite(first_tensor(gm(x, t))).all()


def test_llama_rotary_positions_are_a_position_cone():
    _, _, gm = transformed("llama", torch.bfloat16)
    cone = [n for n in gm.graph.nodes if "position cone" in n.meta.get(M.REASON, "")]
    assert any(n.meta.get(M.FAMILY) == "trig" for n in cone)  # cos/sin of positions in fp32
    emb = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "embedding"]
    assert emb and all(n.meta[M.LABEL] == M.HIGH for n in emb)  # the residual stream stays fp32


# The UNet's: ~30 s on a 2-core CPU; the VAE decoder's upsamples in the default run.
@pytest.mark.parametrize("name", [pytest.param("unet2d", marks=pytest.mark.slow), "vae_decoder"])
def test_nearest_upsample_rewrite_is_exact_on_diffusers(name):
    from amprewrite.testing import zoo

    model, inputs = getattr(zoo, name)()
    always = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs,
                                  upsample="always")
    never = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs,
                                 upsample="never")
    rewrites = [r for r in amprewrite.report(always).rewrites if r.pass_name == "replace_upsample"]
    assert rewrites and all("subgraph" in r.action for r in rewrites)
    assert not [n for n in always.graph.nodes if n.meta.get(M.FAMILY) in (
        "interpolate", "upsample_nearest")]  # plain ops only
    copies = [n for n in always.graph.nodes if n.target in ("expand", "flatten")]
    assert copies and all(n.meta[M.CLASS] == Precision.NEUTRAL for n in copies)
    with torch.no_grad():
        assert torch.equal(first_tensor(always(*inputs)), first_tensor(never(*inputs)))


@pytest.mark.parametrize("name", [pytest.param("swin", marks=pytest.mark.slow),  # 8-11 s
                                  pytest.param("efficientnet", marks=pytest.mark.slow),  # 7-13 s
                                  "wav2vec2"])
def test_more_architectures_transform_within_autocasts_error(name):
    """Swin (window partition, rolls), EfficientNet (depthwise convs, squeeze-excite,
    BatchNorm) and Wav2Vec2 (a weight_norm-parametrized grouped Conv1d): the capture-time
    table's extra models transform, and their error against fp32 is autocast's class."""
    from amprewrite.show.numerics import rel_err
    from amprewrite.testing.zoo import MORE

    model, inputs = MORE[name]()
    with unchanged(model):
        gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs)
    with torch.no_grad():
        ref = first_tensor(model(*inputs))
        out = first_tensor(gm(*inputs))
        with torch.autocast("cpu", torch.bfloat16):
            auto = first_tensor(model(*inputs)).float()
    assert out.dtype == torch.float32
    # Within 2x autocast's error plus one bf16 unit roundoff (2^-8).
    assert rel_err(out, ref) <= 2 * rel_err(auto, ref) + 2.0**-8
    classes = {n.meta.get(M.CLASS) for n in gm.graph.nodes}
    assert {Precision.LOW, Precision.FP32} <= classes


@pytest.mark.parametrize("dtype", [torch.bfloat16,
                                   pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_mixtral_experts_run_low_within_autocasts_error(dtype):
    """transformers' Mixtral experts call ``torch.ops.transformers.grouped_mm_fallback`` (a
    custom op, one ``torch.mm`` per expert): the registry names it a matmul, so the experts
    run low, and the error against fp32 stays within 1.1x autocast's on the same ops."""
    from amprewrite.show.numerics import rel_err

    model, inputs = MODELS["mixtral"]()
    model.eval()
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=inputs)
    experts = [n for n in gm.graph.nodes if "grouped_mm_fallback" in str(n.target)]
    assert experts and all(n.meta[M.CLASS] == Precision.LOW for n in experts)
    # Autocast cannot reach into the custom op (its experts run fp32 there); with transformers'
    # eager experts (the same weights, a matmul per expert) it runs them low, as amprewrite does.
    twin = AUTOCAST_TWIN["mixtral"](model)
    with torch.no_grad():
        ref = first_tensor(call(model, inputs)).double()
        assert torch.allclose(first_tensor(call(twin, inputs)).double(), ref, atol=1e-5)
        out = first_tensor(call(gm, inputs)).double()
        with torch.autocast("cpu", dtype):
            auto = first_tensor(call(twin, inputs)).double()
    assert rel_err(out, ref) <= 1.1 * rel_err(auto, ref), (rel_err(out, ref), rel_err(auto, ref))
