"""float8: the linears a bf16 transform runs in float8, chosen and checked by amprewrite.

``transform(model, "bf16", example_inputs=..., fp8=True)`` (or ``fp8="rowwise"``, or a
:class:`Float8`) runs a linear in float8 where two facts say it should (docs/guide.md, "float8"):

- **it pays**: a roofline of the matmul on a named GPU (:data:`TARGETS`), with the scaling's
  extra passes over the input and the weight, its float8 GEMM against the bf16 one, forward (and
  the two backward GEMMs in train mode); the shape comes from the example inputs (M = the rows
  the linear reads) and the weight (K, N), and float8 GEMMs need K and N divisible by 16;
- **it is accurate**: on the example inputs, the linear's own inputs as the bf16 plan computes
  them, its float8 output's error against an fp64 reference is at most ``bound`` times what
  e4m3 gives an ordinary layer: 16 times the error of the same linear in bf16 (e4m3 keeps 3
  mantissa bits, bf16 7). A layer far above that (values e4m3's range cannot scale together)
  stays bf16.

Everything else follows the bf16 plan. The float8 linear is torchao's: the graph calls
:func:`linear`, which is ``torchao.float8.Float8Linear.forward`` on the same weight, with the
recipe's forward and backward (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``, as
torchao defines them), so a chosen linear equals torchao's bit for bit. torchao is an optional
dependency (``pip install torchao``), imported only when fp8 is asked for.

>>> Float8().recipe, Float8("rowwise").min_speedup
('tensorwise', 1.1)
>>> round(speedup(8192, 4096, 11008, training=False), 2) > 1.1   # LLaMA-7B's MLP: pays
True
>>> round(speedup(128, 64, 64, training=False), 2) < 1.0         # a tiny layer does not
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import PolicyError
from ..graph import meta as M
from ..progress import quiet_loggers

__all__ = [
    "E4M3_VS_BF16",
    "RECIPES",
    "TARGETS",
    "Float8",
    "Target",
    "accepted",
    "check_factor",
    "configs",
    "graph_linear",
    "linear",
    "linear_inference",
    "parse_fp8",
    "scale_of",
    "speedup",
    "to_e4m3",
]

# torchao's recipe names (torchao.float8.Float8LinearRecipeName).
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# e4m3 keeps 3 mantissa bits, bf16 7: its rounding error is 2**4 times bf16's on ordinary
# values (measured: 15.5x to 16.0x on normal and outlier-channel inputs, tests/test_float8.py).
E4M3_VS_BF16 = 16.0
_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# A bf16 error below this is taken as this: a layer exact in bf16 is judged against it.
_ERROR_FLOOR = 2.0**-12


@dataclass(frozen=True)
class Target:
    """A GPU for the cost model: the GEMM rates and memory bandwidth it reaches (a share of its
    peak), and the fixed cost of each extra kernel the scaling launches."""

    name: str
    bf16_flops: float
    fp8_flops: float
    bandwidth: float  # bytes / s
    launch_s: float


# H100 SXM: 989 dense bf16 TFLOP/s and 1979 float8 at 70% and 65%, 3.35 TB/s at 90%, 2 us per
# kernel. A model, to be checked on the GPU (python -m benchmarks fp8; docs/benchmarks.md).
TARGETS = {"h100": Target("h100", 989e12 * 0.70, 1979e12 * 0.65, 3.35e12 * 0.90, 2e-6)}


@dataclass(frozen=True)
class Float8:
    """What ``transform(fp8=...)`` asks for. ``fp8=True`` is ``Float8()``, ``fp8="rowwise"``
    is ``Float8("rowwise")``.

    Args:
        recipe: torchao's scaling recipe, forward and backward: ``"tensorwise"`` (one scale per
            tensor), ``"rowwise"`` (one per row, e4m3 everywhere), ``"rowwise_with_gw_hp"``
            (rowwise, the weight gradient in bf16).
        min_speedup: a linear runs in float8 when the cost model gives it at least this speedup
            over bf16 on ``target``; 0 skips the cost model (every linear with K and N divisible
            by 16 is a candidate, then checked).
        bound: the largest float8 error accepted, in units of e4m3's ordinary error (16 times
            the linear's error in bf16): the default 2 accepts up to 32x the linear's bf16
            error, the unit the report and the README give it in (``bound 32x``).
        target: the GPU of the cost model (a key of :data:`TARGETS`).
        include: selectors (as ``keep_fp32``'s: module paths, types, ``node:`` names) whose
            linears run in float8 without the cost model and the check.
        exclude: selectors whose linears stay bf16.
    """

    recipe: str = "tensorwise"
    min_speedup: float = 1.1
    bound: float = 2.0
    target: str = "h100"
    include: tuple = field(default=())
    exclude: tuple = field(default=())

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise PolicyError(f"fp8 recipe must be one of {', '.join(map(repr, RECIPES))} "
                              f"(torchao's float8 recipes), got {self.recipe!r}.")
        if self.target not in TARGETS:
            raise PolicyError(f"fp8 target must be one of {sorted(TARGETS)}, got "
                              f"{self.target!r}.")
        if not (self.bound > 0 and self.min_speedup >= 0):
            raise PolicyError(f"fp8 bound must be > 0 and min_speedup >= 0, got bound="
                              f"{self.bound!r}, min_speedup={self.min_speedup!r}.")
        for name in ("include", "exclude"):  # checked as selectors by Policy
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, (str, type)) else
                               tuple(value))


def parse_fp8(value: object) -> Float8 | None:
    """``transform(fp8=...)``: None / False (no float8), True, a recipe name, a dict of
    :class:`Float8`'s fields (the backend's and CLI's form) or a :class:`Float8`."""
    if value is None or value is False:
        return None
    if value is True:
        return Float8()
    if isinstance(value, Float8):
        return value
    if isinstance(value, str):
        return Float8(recipe=value)
    if isinstance(value, dict):
        try:
            return Float8(**value)
        except TypeError as exc:
            raise PolicyError(f"fp8={value!r}: {exc}; the fields are recipe, min_speedup, "
                              "bound, target, include, exclude.") from None
    raise PolicyError(f"fp8 must be True, a recipe name ({', '.join(map(repr, RECIPES))}), "
                      f"or amprewrite.Float8(...); got {value!r}.")


# --- the cost model ----------------------------------------------------------------------------

def _gemm(flops: float, nbytes: float, rate: float, t: Target) -> float:
    return max(flops / rate, nbytes / t.bandwidth)


def speedup(m: int, k: int, n: int, training: bool = False, target: str = "h100",
            weight_bytes: int = 4) -> float:
    """The cost model's bf16 time over float8 time for a linear reading ``m`` rows of ``k``
    values into ``n`` outputs, its weight stored in ``weight_bytes`` bytes per value.

    bf16: the GEMM (2mkn FLOPs; bf16 operands and output) and the weight's cast to bf16.
    float8: the GEMM at the float8 rate (1-byte operands, bf16 output) and, per operand, the
    dynamic scaling: an amax pass reading it, then a pass reading it again and writing its
    float8 copy (two kernels, ``launch_s`` each). In train mode the two backward GEMMs too,
    with their operands scaled again (grad_output twice, the weight and the input once more)."""
    t = TARGETS[target]
    flops = 2.0 * m * k * n
    mk, kn, mn = m * k, k * n, m * n
    wb = weight_bytes
    w_cast = (wb + 2) * kn if wb != 2 else 0
    bf16 = _gemm(flops, 2 * (mk + kn + mn), t.bf16_flops, t) + w_cast / t.bandwidth
    scale_x, scale_w = 3 * mk, (2 * wb + 1) * kn
    fp8 = (_gemm(flops, mk + kn + 2 * mn, t.fp8_flops, t)
           + (scale_x + scale_w) / t.bandwidth + 4 * t.launch_s)
    if training:
        # grad_input = grad_out @ w, grad_weight = grad_out^T @ x
        bf16 += (_gemm(flops, 2 * (mn + kn + mk), t.bf16_flops, t)
                 + _gemm(flops, 2 * (mn + mk) + 4 * kn, t.bf16_flops, t))
        scale_back = 2 * 3 * mn + (2 * wb + 1) * kn + 3 * mk
        fp8 += (_gemm(flops, mn + kn + 2 * mk, t.fp8_flops, t)
                + _gemm(flops, mn + mk + 4 * kn, t.fp8_flops, t)
                + scale_back / t.bandwidth + 8 * t.launch_s)
    return bf16 / fp8


# --- the float8 linear -------------------------------------------------------------------------

def _matmul():
    global _MATMUL
    if _MATMUL is None:
        _MATMUL = _torchao()[1]
    return _MATMUL


_MATMUL = None


def _torchao():
    try:
        # torchao logs a warning per compiled extension it cannot load (its CUDA kernels, on a
        # CPU; float8 training does not use them), torch one per Enum torchao registers
        with quiet_loggers("torchao", "torch.utils._pytree"):
            import torchao.float8  # noqa: F401
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as exc:
        raise PolicyError(
            "fp8 runs torchao's float8 linear, and torchao is not importable here "
            f"({exc}). Install it (pip install torchao; amprewrite is tested with 0.18), or "
            "transform without fp8=."
        ) from None
    return Float8LinearConfig, matmul_with_hp_or_float8_args, LinearMMConfig, ScaledMMConfig


# torchao's config of each recipe and the LinearMMConfig its Float8Linear builds from it, made
# once (by the transform that chooses float8 linears) and read by :func:`linear` as a global:
# torch.compile reads a global dict as a constant it guards on, where it cannot build torchao's
# config objects itself.
_CONFIGS: dict[str, tuple] = {}


def configs(recipe: str) -> tuple:
    """(torchao's ``Float8LinearConfig``, ``LinearMMConfig``) of ``recipe``."""
    if recipe not in _CONFIGS:
        config_cls, _, mm_config, scaled = _torchao()
        c = config_cls.from_recipe_name(recipe)
        mm = mm_config(*(scaled(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
                         for g in (c.gemm_config_output, c.gemm_config_grad_input,
                                   c.gemm_config_grad_weight)))
        _CONFIGS[recipe] = (c, mm)
    return _CONFIGS[recipe]


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           recipe: str) -> torch.Tensor:
    """``F.linear`` in float8 with ``recipe``'s dynamic scaling, forward and backward: what
    ``torchao.float8.Float8Linear`` computes (its ``forward``, on the same weight). The output
    has ``input``'s dtype; ``weight`` may be the fp32 master weight (scaled from fp32, one
    rounding) or a bf16 copy."""
    config, mm = configs(recipe)
    # 2-D first, in the input's dtype: torchao flattens its float8 copy to 2-D anyway (the same
    # rows, so the same scales), and a copy of a float8 tensor with row scales is not supported
    # (a transposed attention input, diffusers' image attention)
    x = input.reshape(-1, input.shape[-1])
    out = _matmul().apply(x, weight.t(), mm, config)
    out = out.reshape(*input.shape[:-1], out.shape[-1])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def _exporting() -> bool:
    check = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.6
    return bool(check()) if check is not None else False


def graph_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 recipe: str) -> torch.Tensor:
    """What a transformed graph calls for a float8 linear: :func:`linear` (torchao's autograd
    function, the recipe's backward) where a gradient is asked for, else
    :func:`linear_inference` (plain ops, which ``torch.export`` takes: always while exporting).
    The same forward either way, bit for bit."""
    if torch.is_grad_enabled() and not _exporting() and any(
            t is not None and t.requires_grad for t in (input, weight, bias)):
        return linear(input, weight, bias, recipe)
    return linear_inference(input, weight, bias, recipe)


def _scaled(t: torch.Tensor, dim: int | None, round_pow2: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in e4m3 with its dynamic scale (one per tensor, or per slice along ``dim``), as
    torchao's ``hp_tensor_to_float8_dynamic`` makes them."""
    amax = t.abs().max() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = scale_of(amax, round_pow2)
    return to_e4m3(t, scale), scale


def scale_of(amax: torch.Tensor, round_pow2: bool = False) -> torch.Tensor:
    """The float8 (e4m3) scale of values whose largest magnitude is ``amax``, as torchao
    computes it (in float64, then float32; a power of two with ``round_pow2``).

    >>> scale_of(torch.tensor(448.0)).item(), scale_of(torch.tensor(3.0), True).item()
    (1.0, 128.0)
    """
    scale = (_E4M3_MAX / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    if round_pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def to_e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t * scale`` saturated to e4m3's range and rounded to e4m3."""
    return (t.to(torch.float32) * scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)


def linear_inference(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     recipe: str) -> torch.Tensor:
    """The forward of :func:`linear` in plain ops on ``torch._scaled_mm``, equal to torchao's bit
    for bit (tests/test_float8.py): what an eval-mode graph calls. torchao's float8 tensor
    subclass does not go through ``torch.export`` (torch 2.13: "Unable to cast NotImplemented to
    Tensor"), these ops do, so an fp8 graph exports to a ``.pt2``. No backward."""
    config, _ = configs(recipe)
    rowwise = recipe != "tensorwise"
    pow2 = config.round_scales_to_power_of_2
    x = input.reshape(-1, input.shape[-1])
    a, sa = _scaled(x, -1 if rowwise else None, pow2)
    b, sb = _scaled(weight.t(), 0 if rowwise else None, pow2)
    b = b.t().contiguous().t()  # column-major, as _scaled_mm takes its second operand
    fast = config.gemm_config_output.use_fast_accum
    if rowwise and not fast:  # torchao: the tensorwise kernel, then the row scales
        one = sa.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=input.dtype,
                               use_fast_accum=fast)
        out = out * (sa.reciprocal() * sb.reciprocal())
    else:
        out = torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                               out_dtype=input.dtype, use_fast_accum=fast)
    out = out.reshape(*input.shape[:-1], out.shape[-1])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def check_factor(gm: object) -> float:
    """How much looser the whole-graph checks (transform's verification, deploy's) hold a graph
    with float8 linears: e4m3 rounds 16 times coarser than bf16 (each linear was checked on its
    own first). 1.0 for a graph without them."""
    nodes = getattr(getattr(gm, "graph", None), "nodes", ())
    chosen = any(str(n.meta.get(M.FLOAT8, "")).startswith("fp8") for n in nodes)
    return E4M3_VS_BF16 if chosen else 1.0


def accepted(e_low: float, e_fp8: float, bound: float) -> tuple[bool, float]:
    """Is a float8 error within ``bound`` units of e4m3's ordinary error, and its ratio to the
    bf16 error (floored at 2**-12, so that a layer exact in bf16 is judged too)?"""
    ratio = e_fp8 / max(e_low, _ERROR_FLOOR)
    return math.isfinite(ratio) and ratio <= bound * E4M3_VS_BF16, ratio
