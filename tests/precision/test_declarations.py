"""Model authors' fp32 declarations (DESIGN.md, "Values are facts too"; issue 36).

transformers' models declare parameters that ``from_pretrained`` keeps in fp32:
``_keep_in_fp32_modules`` when loading in fp16 (T5's ``wo``), ``_keep_in_fp32_modules_strict``
in fp16 and bf16 (a MoE router's ``gate.weight``). Every family of the installed transformers
that declares either is enumerated here, built from a shrunk config (random weights, no
downloads), and :func:`amprewrite.precision.ranges.declared_fp32` must name exactly the parameters
and buffers transformers' own loader would keep fp32. A representative set is transformed: every
op that reads a declared parameter computes in fp32 and says why; the slow test transforms
every family that can be given inputs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib
import re
from dataclasses import dataclass, field

import pytest
import torch
from torch import fx, nn

import amprewrite
from amprewrite.capture.trace import keep_captured
from amprewrite.errors import CaptureError
from amprewrite.graph import meta as M
from amprewrite.precision.ops import FAMILIES, Precision, conversion_target
from amprewrite.precision.ranges import declared_fp32
from amprewrite.show.numerics import rel_err
from amprewrite.testing.zoo import call, first_tensor

transformers = pytest.importorskip("transformers")
from transformers import PretrainedConfig, PreTrainedModel  # noqa: E402

# Which low dtypes each attribute applies to (transformers' PreTrainedModel._get_dtype_plan).
APPLIES = {"_keep_in_fp32_modules": (torch.float16,),
           "_keep_in_fp32_modules_strict": (torch.float16, torch.bfloat16)}
LOW = (torch.float16, torch.bfloat16)

# Families with a declaration, measured in transformers 5.24.0: 56; 17 declare
# _keep_in_fp32_modules, 45 _keep_in_fp32_modules_strict (6 both). Fewer means the
# enumeration broke (or transformers dropped some: measure again).
FAMILY_FLOOR = 56
ATTRIBUTE_FLOORS = {"_keep_in_fp32_modules": 17, "_keep_in_fp32_modules_strict": 45}


# ------------------------------------------------------------------------ enumeration
_MODELS_DIR = pathlib.Path(transformers.__file__).parent / "models"


def _declares(cls: type) -> bool:
    return any(getattr(cls, attr, None) for attr in APPLIES)


def _declaring_classes(module: object) -> list[type]:
    """The model classes defined in ``module`` that declare (or inherit) a non-empty
    declaration, in definition order."""
    return [c for c in vars(module).values()
            if inspect.isclass(c) and issubclass(c, PreTrainedModel)
            and c.__module__ == module.__name__ and _declares(c)]


def _import(name: str, failed: dict[str, str]) -> object | None:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # one family's missing optional dependency must not hide the rest
        failed[name] = f"{type(exc).__name__}: {exc}"
        return None


@functools.cache
def enumerate_families(everything: bool = False
                       ) -> tuple[dict[str, tuple[type, ...]], dict[str, str]]:
    """Each family (a directory of ``transformers.models``) with a model class that declares
    fp32 parameters, with those classes; and each module that failed to import, with why.

    By default only the modeling files that spell the attribute are imported (2 s instead of
    15 s); ``everything=True`` imports every modeling file, to check that shortcut
    (:func:`test_enumeration_shortcut_misses_no_family`)."""
    families: dict[str, list[type]] = {}
    failed: dict[str, str] = {}
    for path in sorted(_MODELS_DIR.glob("*/modeling_*.py")):
        if not everything and "_keep_in_fp32_modules" not in path.read_text(encoding="utf-8"):
            continue
        module = _import(f"transformers.models.{path.parent.name}.{path.stem}", failed)
        if module is not None and (classes := _declaring_classes(module)):
            families.setdefault(path.parent.name, []).extend(classes)
    return {k: tuple(v) for k, v in families.items()}, failed


DECLARING, IMPORT_FAILURES = enumerate_families()
# The per-family tests' parameters: each family, and each candidate module that failed to
# import, skipped with why (the family floor still catches an enumeration that broke).
FAMILY_PARAMS = [*sorted(DECLARING), *(
    pytest.param(name, marks=pytest.mark.skip(reason=f"import failed: {why}"))
    for name, why in sorted(IMPORT_FAILURES.items()))]


# ------------------------------------------------------------------------ small models
# A generic shrinker: each attribute named here, on the config and every nested config (or
# dict of one), is lowered to this value where it is larger (never raised).
SMALL = {
    # width
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32,
    "intermediate_size": 64, "d_ff": 64, "ffn_dim": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
    "shared_experts_intermediate_size": 16, "expert_intermediate_size": 16,
    # depth (a MoE family's first layer is often dense: two layers, the second sparse)
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "num_decoder_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "first_k_dense_replace": 1,
    # attention
    "num_attention_heads": 4, "num_heads": 4, "n_head": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "d_kv": 8,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "qk_head_dim": 16,
    # vocabulary and positions
    "vocab_size": 128, "max_position_embeddings": 128, "attention_hidden_size": 32,
    # experts
    "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "n_group": 1, "topk_group": 1,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _smaller(v: object, small: int) -> object:
    if _is_int(v):
        return min(v, small)
    if isinstance(v, list) and v and all(_is_int(x) for x in v):  # per-layer sizes
        return [min(x, small) for x in v]
    return v


def _assign(cfg: PretrainedConfig | dict, key: str, value: object) -> None:
    if isinstance(cfg, dict):
        cfg[key] = value
        return
    try:
        setattr(cfg, key, value)
    except AttributeError:  # a derived property (read-only): its sources are shrunk instead
        pass


def shrink(cfg: PretrainedConfig | dict, seen: set[int] | None = None) -> None:
    """Lower the sizes :data:`SMALL` names, in ``cfg`` and every config nested in it; keep one
    layer of each kind a per-layer list names (``layer_types``, ``mlp_layer_types``); bring
    token ids inside the smaller vocabulary; turn the KV cache off."""
    seen = set() if seen is None else seen
    if id(cfg) in seen:
        return
    seen.add(id(cfg))
    fields = cfg if isinstance(cfg, dict) else vars(cfg)
    get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    for key, small in SMALL.items():
        v = get(key)
        if (new := _smaller(v, small)) != v:
            _assign(cfg, key, new)
    vocab, layers = get("vocab_size"), get("num_hidden_layers")
    for key, v in list(fields.items()):
        if not isinstance(key, str):
            continue
        if isinstance(v, (PretrainedConfig, dict)):
            shrink(v, seen)
        elif (key.endswith("layer_types") and isinstance(v, list) and _is_int(layers)
              and len(v) > layers):
            kinds = list(dict.fromkeys(v))[:layers]  # a sparse layer must survive the cut
            _assign(cfg, key, kinds + [v[-1]] * (layers - len(kinds)))
        elif key == "layers_block_type" and isinstance(v, list):  # its length is the depth
            _assign(cfg, key, list(dict.fromkeys(v)))
        elif key.endswith("token_id") and _is_int(v) and _is_int(vocab) and v >= vocab:
            _assign(cfg, key, v % vocab)
    if "use_cache" in fields:
        _assign(cfg, "use_cache", False)


@dataclass(frozen=True)
class Recipe:
    """What the generic shrinker cannot guess for one family."""

    model: str = ""  # the class to build; default: see pick_class
    config: dict[str, object] = field(default_factory=dict)  # dotted attribute -> value
    kwargs: dict[str, object] = field(default_factory=dict)  # make the config from these only
    why: str = ""


_BLIP = Recipe(config={"vision_config.image_size": 28, "qformer_config.encoder_hidden_size": 32,
                       "num_query_tokens": 4, "image_token_index": 5, "video_token_index": 5,
                       "text_config.word_embed_proj_dim": 32},
               why="the Q-Former reads the vision tower's width; small images, 4 queries, "
                   "image token 5")

RECIPES: dict[str, Recipe] = {
    "apertus1p5": Recipe(config={
        "vision_config.base_channels": 32, "vision_config.channel_multiplier": [1, 1],
        "vision_config.num_res_blocks": 1, "vision_config.latent_channels": 32,
        "vision_config.codebook_size": 64, "vision_config.attn_resolutions": [],
        "audio_config.codebook_size": 64, "audio_config.codebook_dim": 32,
        "audio_config.decoder_hidden_size": 32, "audio_config.decoder_intermediate_size": 64,
        "audio_config.decoder_num_layers": 1, "audio_config.num_lstm_layers": 1},
        why="VQ image and audio tokenizers (190M parameters at their own sizes)"),
    "blip_2": _BLIP,
    "deepseek_ocr2": Recipe(config={"mlp_layer_types": ["dense", "sparse"],
                                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1},
                            why="its defaults leave the MoE unset (None)"),
    "deepseek_v2": Recipe(config={"num_experts_per_tok": 2},
                          why="its defaults leave the router's top-k unset (None)"),
    "dots1": Recipe(config={"n_routed_experts": 4, "num_experts_per_tok": 2,
                            "n_shared_experts": 1},
                    why="its defaults leave the MoE unset (None)"),
    "dots3_note": Recipe(kwargs=dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_experts_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, head_dim=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, index_head_dim=8, index_n_heads=2,
        index_topk=4, max_position_embeddings=128, use_cache=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2),
        why="per-layer attention configs, validated when the config is made"),
    "ernie4_5_vl_moe": Recipe(config={"rope_parameters.mrope_section": [1, 1, 2]},
                              why="the default mrope sections need head_dim 128"),
    "esmfold2": Recipe(config={
        "pairwise_hidden_size": 32, "pair_transition_intermediate_size": 64,
        "folding_trunk_num_hidden_layers": 1,
        "structure_head.diffusion_module.pair_intermediate_size": 64,
        "structure_head.diffusion_module.fourier_dim": 32},
        why="the pair stack (53M parameters at its own sizes)"),
    "glm4v_moe": Recipe(config={"head_dim": 16, "rope_parameters.mrope_section": [2, 1, 1]},
                        why="the default mrope sections need head_dim 128"),
    "instructblip": _BLIP,
    "instructblipvideo": _BLIP,
    "kyutai_speech_to_text": Recipe(config={
        "codec_config.upsample_groups": 32, "codec_config.num_filters": 8,
        "codec_config.codebook_size": 64, "codec_config.codebook_dim": 32,
        "codec_config.vector_quantization_hidden_dimension": 32,
        "codec_config.num_quantizers": 2, "num_codebooks": 2, "codebook_vocab_size": 65},
        why="the codec's grouped upsampling needs groups <= width; its codebooks (24M)"),
    "mimo_v2_flash": Recipe(config={"num_key_value_heads": 2},
                            why="its sliding-window layers have twice the KV heads"),
    "rwkv": Recipe(config={"rescale_every": 0},
                   why="in eval mode it rescales its weights in place every 6 layers"),
    "slanext": Recipe(model="SLANeXtForTableRecognition",
                      why="the vision encoder holds none of the declared modules"),
    "voxtral": Recipe(config={"audio_config.max_source_positions": 8,
                              "audio_config.num_mel_bins": 16, "audio_token_id": 5},
                      why="16 mel bins x 16 frames of audio, audio token 5"),
}


def pick_class(family: str) -> type:
    """The class to build: the recipe's, else the smallest that reads token ids (a text
    model, the base model, a causal LM), else the first declaring class."""
    classes = [c for c in DECLARING[family] if not c.__name__.endswith("PreTrainedModel")]
    if name := RECIPES.get(family, Recipe()).model:
        return next(c for c in classes if c.__name__ == name)
    for suffix in ("TextModel", "Model", "ForCausalLM", "ForConditionalGeneration"):
        for c in classes:
            if c.__name__.endswith(suffix) and not re.search("Vision|Audio", c.__name__):
                return c
    return classes[0]


def _set_dotted(cfg: PretrainedConfig, dotted: str, value: object) -> None:
    *path, last = dotted.split(".")
    for part in path:
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    _assign(cfg, last, value)


@functools.cache
def build(family: str) -> nn.Module:
    """The family's model, shrunk, random weights (seed 0), eval mode; cached per family."""
    cls, recipe = pick_class(family), RECIPES.get(family, Recipe())
    if recipe.kwargs:
        cfg = cls.config_class(**recipe.kwargs)
    else:
        cfg = cls.config_class()
        shrink(cfg)
    for dotted, value in recipe.config.items():
        _set_dotted(cfg, dotted, value)
    torch.manual_seed(0)
    return cls(cfg).eval()


# ------------------------------------------------------------------------ the oracle
def _tensor_names(model: nn.Module) -> list[str]:
    return [*(n for n, _ in model.named_parameters(remove_duplicate=False)),
            *(n for n, _ in model.named_buffers(remove_duplicate=False))]


def loader_keeps_fp32(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, str]:
    """What transformers' own loader keeps fp32 when loading ``model`` in ``dtype``, by its own
    code: ``_get_dtype_plan``'s globs, matched as ``core_model_loading`` matches checkpoint
    keys (``build_glob_alternation``, ``re.search``); each with the attribute declaring it
    (strict where both do: it applies in every low dtype)."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return {}
    fp32, _, _ = build_glob_alternation(list(plan))
    strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    strict_re = build_glob_alternation(strict)[0] if strict else None
    return {name: ("_keep_in_fp32_modules_strict" if strict_re and strict_re.search(name)
                   else "_keep_in_fp32_modules")
            for name in _tensor_names(model) if fp32.search(name)}


# ------------------------------------------------------------------------ fast tests
def test_every_declaring_family_is_enumerated():
    """The enumeration finds every family of the installed transformers with a declaration:
    at least the 56 measured (a module that fails to import is skipped with its reason)."""
    assert len(DECLARING) >= FAMILY_FLOOR, (sorted(DECLARING), IMPORT_FAILURES)
    kinds = {attr: sorted(f for f, classes in DECLARING.items()
                          if any(getattr(c, attr, None) for c in classes)) for attr in APPLIES}
    assert all(len(kinds[attr]) >= floor for attr, floor in ATTRIBUTE_FLOORS.items()), kinds
    assert {"t5", "mt5", "umt5"} <= set(kinds["_keep_in_fp32_modules"])
    assert {"deepseek_v3", "glm4_moe"} <= set(kinds["_keep_in_fp32_modules_strict"])


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_declared_fp32_names_what_transformers_keeps_fp32(family):
    """For each low dtype, declared_fp32 names exactly the parameters and buffers that
    transformers' loader keeps fp32, with the attribute that declares each; it is non-empty
    for each dtype a declaration applies to (the small model still holds a declared module)."""
    model = build(family)
    tensors = set(_tensor_names(model))
    for dtype in LOW:
        declared = declared_fp32(model, dtype)
        assert set(declared) <= tensors
        assert declared == loader_keeps_fp32(model, dtype), dtype
        applies = [attr for attr, dtypes in APPLIES.items()
                   if dtype in dtypes and getattr(model, attr, None)]
        assert bool(declared) == bool(applies), (dtype, applies)
        if dtype == torch.bfloat16:
            assert set(declared.values()) <= {"_keep_in_fp32_modules_strict"}


# ------------------------------------------------------------------------ transforms
@dataclass(frozen=True)
class Read:
    """An op of the transformed graph that reads declared parameter ``param``, directly or
    through the nodes ``via`` (views, fp32 conversions, casts)."""

    param: str
    attr: str  # the attribute declaring it
    node: fx.Node
    via: tuple[fx.Node, ...] = ()


def reads_of_declared(gm: fx.GraphModule, declared: dict[str, str]
                      ) -> dict[str, list[Read]]:
    """Each declared parameter the graph reads, with the ops that read it: through views and
    other exact NEUTRAL ops, and through conversions that keep it fp32 (``.float()``,
    ``.type(torch.float32)``: the same value, so the op after one reads the parameter too)."""
    out: dict[str, list[Read]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or (attr := declared.get(str(node.target))) is None:
            continue
        readers: list[Read] = []
        todo, seen = [(user, ()) for user in node.users], set()
        while todo:
            user, via = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            readers.append(Read(str(node.target), attr, user, via))
            if M.CAST in user.meta:  # amprewrite's cast: what reads it reads the parameter
                todo.extend((u, (*via, user)) for u in user.users)
                continue
            family = FAMILIES.get(user.meta.get(M.FAMILY) or "")
            if family is None or family.precision is not Precision.NEUTRAL:
                continue
            if conversion_target(user) in LOW:  # the model itself makes it low
                continue
            todo.extend((u, (*via, user)) for u in user.users)
        out[str(node.target)] = readers
    return out


def wrong_reads(gm: fx.GraphModule, declared: dict[str, str]) -> list[Read]:
    """The ops reading a declared parameter that do not compute in fp32 for the declaration:
    each must be planned fp32 with the reason ``declared fp32 by the model (<attribute>)``;
    a cast taking the parameter low is wrong too."""
    decisions = {d.node: d for d in amprewrite.report(gm).decisions}
    return [read for readers in reads_of_declared(gm, declared).values() for read in readers
            if decisions[read.node.name].precision != "fp32"
            or not decisions[read.node.name].reason.startswith(
                f"declared fp32 by the model ({read.attr})")]


def show(gm: fx.GraphModule, reads: list[Read]) -> str:
    decisions = {d.node: d for d in amprewrite.report(gm).decisions}
    lines = []
    for r in reads:
        d = decisions[r.node.name]
        path = " -> ".join([r.param, *(n.name for n in r.via), r.node.name])
        lines.append(f"{path} ({d.target}, {d.module_path}): {d.precision} {d.dtype}: {d.reason}")
    return "\n".join(lines)


def _tokens(n: int = 8, vocab: int = 128) -> torch.Tensor:
    """Token ids from 10 up: clear of the special ids (0-2, the image token 5)."""
    return torch.randint(10, min(vocab, 100), (1, n), generator=torch.Generator().manual_seed(0))


def _pixels(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _blip(model: nn.Module, frames: int = 0) -> dict[str, torch.Tensor]:
    """Pixels, the Q-Former's text, and the language model's tokens behind one image token
    per query (per frame)."""
    images = model.config.num_query_tokens * max(frames, 1)
    shape = (1, frames, 3, 28, 28) if frames else (1, 3, 28, 28)
    inputs = {"pixel_values": _pixels(*shape),
              "input_ids": torch.cat([torch.full((1, images), 5), _tokens()], dim=1)}
    if "qformer_input_ids" in inspect.signature(model.forward).parameters:
        inputs["qformer_input_ids"] = _tokens()
    return inputs


# Inputs for the families whose forward takes more than token ids (built lazily, per model).
INPUTS = {
    "blip_2": _blip,
    "instructblip": _blip,
    "instructblipvideo": lambda m: _blip(m, frames=2),
    "slanext": lambda m: {"pixel_values": _pixels(1, 3, 512, 512)},
    # 16 frames -> 8 encoder positions -> 4 rows of the projector: 4 audio tokens.
    "voxtral": lambda m: {"input_features": _pixels(1, 16, 16),
                          "input_ids": torch.cat([torch.full((1, 4), 5), _tokens()], dim=1)},
    "udop": lambda m: {"input_ids": _tokens(), "decoder_input_ids": _tokens(4),
                       "bbox": _pixels(1, 8, 4).sigmoid()},  # normalised boxes
    # One attention context of stacked (4x) mel frames.
    "granite_speech5": lambda m: {"input_features": _pixels(
        1, m.config.context_size, 4 * m.config.num_mel_bins)},
}

# Families the slow test cannot give inputs that reach a declared module, with why.
NO_INPUTS = {
    "esmfold2": "protein folding: ten structure inputs (token_index, residue_index, ...)",
    "kyutai_speech_to_text": "the declared codec_model runs in generate(), not in forward()",
    "pocket_tts": "latent_mean/latent_std are read with training labels, freqs in the flow "
                  "head's sampling loop; forward() on tokens reads neither",
    "gradium_phonon_tts": "latent_mean/latent_std are read with training labels, freqs in "
                          "the flow head's sampling loop; forward() on tokens reads neither",
    "apertus1p5": "the declared image and audio tokenizers turn pixels and waveforms into "
                  "token ids; inputs for them are not built here",
    "nemotron3_5_transcribe": "the declared audio tower needs ASR features and its "
                              "diarization state; inputs for them are not built here",
}

# Families whose forward one dynamo graph cannot hold, with what transform()'s CaptureError
# says (torch.compile(backend="amprewrite") splits such a model into graphs instead).
NO_GRAPH = {
    "longcat_flash": ("(?i)data-dependent", "MoE dispatch with data-dependent shapes"),
    "openai_privacy_filter": ("(?i)data-dependent", "MoE dispatch with data-dependent shapes"),
    "slanext": ("(?i)data-dependent", "its table decoder loops until a stop token"),
    "udop": ("returns a type dynamo cannot return", "dynamo stops on an exception inside "
             "UdopModel.forward (torch.export: a None's .size())"),
}


# The dtype each family is transformed in: fp16 where _keep_in_fp32_modules declares (the
# strict declaration applies there too), else bf16, where only the strict one applies.
def transform_dtype(model: nn.Module) -> torch.dtype:
    return torch.float16 if getattr(model, "_keep_in_fp32_modules", None) else torch.bfloat16


def example_inputs(family: str, model: nn.Module) -> dict[str, torch.Tensor]:
    if family in INPUTS:
        return INPUTS[family](model)
    params = inspect.signature(model.forward).parameters
    inputs = {"input_ids": _tokens()}
    if "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = _tokens(4)
    return inputs


@functools.cache
def _inputs(family: str) -> dict[str, torch.Tensor]:
    return example_inputs(family, build(family))


@pytest.fixture(scope="module", autouse=True)
def _one_capture_per_model():
    """The transforms of one family's model on its one inputs object (T5 in four policies,
    DeepSeek-V3 in two dtypes) start from one capture, as the rounds of ``check --fix`` do
    (``keep_captured``; tests/capture/test_verify.py checks that such graphs compute what
    fresh captures give, bit for bit)."""
    with keep_captured():
        yield


@functools.cache
def transformed(family: str, dtype: torch.dtype, allow_low: tuple[str, ...] = (),
                params: str = "fp32", verify: bool = True) -> fx.GraphModule:
    """The family's small model transformed on its example inputs (cached: each costs
    seconds). Verification is kept where numerics matter, off where only the plan does."""
    return amprewrite.transform(build(family), dtype, example_inputs=_inputs(family),
                                allow_low=list(allow_low), params=params, verify=verify)


def _decisions(gm: fx.GraphModule, family: str) -> list:
    return [d for d in amprewrite.report(gm).decisions if d.family == family]


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


T5_WO = "encoder.block.0.layer.1.DenseReluDense.wo"


# ------------------------------------------------------------------------ representative
def test_t5_wo_runs_fp32_in_fp16_and_the_output_stays_close_to_fp32():
    """T5 declares ``wo`` (``_keep_in_fp32_modules``): in fp16 each of its four linears
    computes in fp32, says so in the report, and the output's relative L2 error against fp32
    is within 2e-3 (4 fp16 roundoff units of 2^-11; measured 5.4e-4, autocast 6.5e-4)."""
    model = build("t5")
    declared = declared_fp32(model, torch.float16)
    gm = transformed("t5", torch.float16)
    reads = reads_of_declared(gm, declared)
    assert set(reads) == set(declared) and len(declared) == 4  # every wo is read
    bad = wrong_reads(gm, declared)
    assert not bad, show(gm, bad)
    wo = [d for d in _decisions(gm, "linear") if d.module_path.endswith(".wo")]
    assert len(wo) == 4
    for d in wo:
        assert (d.precision, d.dtype) == ("fp32", "torch.float32")
        assert d.reason == ("declared fp32 by the model (_keep_in_fp32_modules): reads "
                            f"'{d.module_path}.weight'")
    assert any(d.precision == "low" for d in _decisions(gm, "linear"))  # wi, attention: low
    assert "declared fp32 by the model (_keep_in_fp32_modules): reads" in str(
        amprewrite.report(gm))
    inputs = example_inputs("t5", model)
    with torch.no_grad():
        ref, out = first_tensor(call(model, inputs)), first_tensor(call(gm, inputs))
    assert out.dtype == torch.float32
    assert rel_err(out, ref) <= 2e-3, rel_err(out, ref)


def test_t5_wo_runs_low_in_bf16_where_nothing_declares_it():
    """``_keep_in_fp32_modules`` applies in fp16 only: in bf16 T5's ``wo`` linears are low
    and no decision gives a declaration as its reason."""
    assert declared_fp32(build("t5"), torch.bfloat16) == {}
    gm = transformed("t5", torch.bfloat16, verify=False)
    wo = [d for d in _decisions(gm, "linear") if d.module_path.endswith(".wo")]
    assert len(wo) == 4 and all(d.precision == "low" for d in wo)
    assert not [d for d in amprewrite.report(gm).decisions if "declared" in d.reason]


def test_allow_low_gives_back_one_non_strict_declaration():
    """``allow_low=[<one wo>]`` vouches for that linear: it runs low again, says why, and
    the other three stay fp32 for the declaration."""
    gm = transformed("t5", torch.float16, allow_low=(T5_WO,), verify=False)
    wo = {d.module_path: d for d in _decisions(gm, "linear") if d.module_path.endswith(".wo")}
    assert wo.pop(T5_WO).precision == "low"
    assert len(wo) == 3 and all(
        d.precision == "fp32" and d.reason.startswith("declared fp32 by the model") for d in
        wo.values())
    reason = next(d.reason for d in _decisions(gm, "linear") if d.module_path == T5_WO)
    assert reason.startswith(f"allow_low={T5_WO!r}") and "declared fp32 by the model" in reason


def test_params_low_keeps_t5_wo_fp32():
    """``params="low"`` stores fp16 copies of the weights only low ops read; the declared
    ``wo`` weights stay fp32, in the state dict and in what the graph reads."""
    gm = transformed("t5", torch.float16, params="low", verify=False)
    declared = declared_fp32(build("t5"), torch.float16)
    state = gm.state_dict()
    assert {state[name].dtype for name in declared} == {torch.float32}
    assert state[T5_WO.replace(".wo", ".wi") + ".weight"].dtype == torch.float16  # not vacuous
    read = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in declared]
    assert sorted(read) == sorted(declared)
    assert {_attr(gm, t).dtype for t in read} == {torch.float32}


def _router_bias_readers(gm: fx.GraphModule, declared: dict[str, str]) -> list[fx.Node]:
    bias = [p for p in declared if p.endswith("e_score_correction_bias")]
    return [r.node for p in bias for r in reads_of_declared(gm, declared).get(p, [])]


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_deepseek_v3_router_bias_is_read_in_fp32_for_the_strict_declaration(dtype):
    """DeepSeek-V3 declares its router's ``gate.weight`` and ``e_score_correction_bias``
    strict: in fp16 and in bf16 both are declared, and the op adding the bias to the scores
    computes in fp32 for that reason."""
    declared = declared_fp32(build("deepseek_v3"), dtype)
    assert declared == {"layers.1.mlp.gate.weight": "_keep_in_fp32_modules_strict",
                        "layers.1.mlp.gate.e_score_correction_bias":
                        "_keep_in_fp32_modules_strict"}
    gm = transformed("deepseek_v3", dtype)
    readers = _router_bias_readers(gm, declared)
    assert readers
    decisions = {d.node: d for d in amprewrite.report(gm).decisions}
    for node in readers:
        d = decisions[node.name]
        assert d.precision == "fp32", d
        assert d.reason == ("declared fp32 by the model (_keep_in_fp32_modules_strict): reads "
                            "'layers.1.mlp.gate.e_score_correction_bias'")


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_deepseek_v3_router_linear_runs_fp32_for_the_strict_declaration(dtype):
    """DeepSeek-V3's router reads its weight through the model's own conversion,
    ``F.linear(h.type(torch.float32), self.weight.type(torch.float32))``: every op reading
    the declared weight, through that conversion too, computes in fp32, the router linear
    above all. (Before 5991fe3 the walk stopped at the conversion and the router ran low,
    reading its weight through a cast to the low dtype.)"""
    declared = declared_fp32(build("deepseek_v3"), dtype)
    gm = transformed("deepseek_v3", dtype)
    bad = wrong_reads(gm, declared)
    assert not bad, show(gm, bad)
    router = [r.node for r in reads_of_declared(gm, declared)["layers.1.mlp.gate.weight"]
              if r.node.meta.get(M.FAMILY) == "linear"]
    assert len(router) == 1 and router[0].meta[M.CLASS] == Precision.FP32


def test_inkling2_router_gate_runs_fp32_in_bf16():
    """Inkling2's MoE router reads its strict-declared ``gate.weight`` directly
    (``F.linear(flat, self.weight)``): in bf16 the router linear of each MoE layer computes in
    fp32 for the declaration, and so does every other op reading a declared parameter (its
    attention/MLP input queries through ``.float()``, views and an expand, into a matmul)."""
    declared = declared_fp32(build("inkling2"), torch.bfloat16)
    router = [p for p in declared if p.endswith(".mlp.gate.weight")]
    assert router and set(declared.values()) == {"_keep_in_fp32_modules_strict"}
    gm = transformed("inkling2", torch.bfloat16, verify=False)
    reads = reads_of_declared(gm, declared)
    assert set(router) <= set(reads)
    bad = wrong_reads(gm, declared)
    assert not bad, show(gm, bad)
    linears = [r.node for p in router for r in reads[p] if r.node.meta.get(M.FAMILY) == "linear"]
    assert len(linears) == len(router)


def test_allow_low_cannot_give_back_a_strict_declaration():
    """``allow_low`` on DeepSeek-V3's router module changes none of the ops a strict
    declaration made fp32: same class, same reason."""
    declared = declared_fp32(build("deepseek_v3"), torch.bfloat16)
    plain = transformed("deepseek_v3", torch.bfloat16)
    allowed = transformed("deepseek_v3", torch.bfloat16, allow_low=("layers.1.mlp.gate",),
                          verify=False)
    taken = {r.node for readers in reads_of_declared(plain, declared).values()
             for r in readers if r.node.meta.get(M.REASON, "").startswith("declared fp32")}
    # The router linear (LOW by its family), the weight's conversion, the bias add:
    assert any(n.meta.get(M.FAMILY) == "linear" for n in taken) and len(taken) >= 3
    taken = {n.name for n in taken}
    before = {d.node: (d.precision, d.reason) for d in amprewrite.report(plain).decisions}
    after = {d.node: (d.precision, d.reason) for d in amprewrite.report(allowed).decisions}
    for name in taken:
        assert after[name] == before[name]
        assert after[name][0] == "fp32"
    # The selector does match the router: an fp32 reduction in it is given back.
    assert any(d.module_path == "layers.1.mlp.gate" and
               d.reason.startswith("allow_low='layers.1.mlp.gate'")
               for d in amprewrite.report(allowed).decisions)


def test_params_low_keeps_deepseek_v3_router_fp32():
    """``params="low"`` in bf16: the router's declared weight and bias stay fp32 storage,
    while an expert-free dense linear's weight is stored bf16."""
    declared = declared_fp32(build("deepseek_v3"), torch.bfloat16)
    gm = transformed("deepseek_v3", torch.bfloat16, params="low", verify=False)
    state = gm.state_dict()
    assert {state[name].dtype for name in declared} == {torch.float32}
    assert state["layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # not vacuous
    read = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in declared]
    assert sorted(read) == sorted(declared)
    assert {_attr(gm, t).dtype for t in read} == {torch.float32}


# ------------------------------------------------------------------------ slow: every family
@pytest.mark.slow
def test_enumeration_shortcut_misses_no_family():
    """Importing every modeling file of transformers finds the same declaring families as
    importing only the files that spell the attribute (a class inheriting a declaration from
    another family's file would be missed by the shortcut)."""
    everything, failed = enumerate_families(everything=True)
    assert sorted(everything) == sorted(DECLARING), failed


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_every_family_reads_its_declared_parameters_in_fp32(family):
    """Each family's small model, transformed in the dtype its declarations apply to (fp16
    where ``_keep_in_fp32_modules`` declares, else bf16): the graph reads declared parameters,
    and every op reading one computes in fp32 for the declaration. Verification is off: the
    plan is under test here, T5's numerics above."""
    if family in NO_INPUTS:
        pytest.skip(NO_INPUTS[family])
    model = build(family)
    dtype = transform_dtype(model)
    declared = declared_fp32(model, dtype)
    if family in NO_GRAPH:
        error, why = NO_GRAPH[family]
        with pytest.raises(CaptureError, match=error):
            transformed(family, dtype, verify=False)
        pytest.skip(f"one dynamo graph cannot hold it: {why}")
    gm = transformed(family, dtype, verify=False)
    assert reads_of_declared(gm, declared), "the inputs reach no declared parameter"
    bad = wrong_reads(gm, declared)
    assert not bad, show(gm, bad)
