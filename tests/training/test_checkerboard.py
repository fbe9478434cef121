"""Training end to end: through amprewrite, the checkerboard example follows autocast's loss curve.

The fast tests train a small configuration (width 16, a 16 x 16 grid, 60 Adam steps at lr 5e-3)
over SEEDS, each seed from the same initialisation with autocast and with amprewrite, and
compare the loss curves step by step; and they check that the graph ran the policy's classes
(convolutions low, BatchNorm and the MSE loss in fp32), which a loss curve cannot tell apart
from an fp32-everywhere graph.

Measured once (torch 2.13 CPU, seeds 0-4), the relative area between two loss curves,
sum_t |a_t - b_t| / sum_t b_t:
  amprewrite bf16 (transform and backend alike) vs autocast bf16, same seed: 0.0020-0.0042
  amprewrite fp16 + GradScaler vs autocast fp16 + GradScaler, same seed:      0.0014-0.0081
  fp32 vs autocast bf16, same seed:                                          0.005-0.018
  autocast bf16, one seed against another:                                   0.044-0.285
                 (fp16 + GradScaler:                                          0.043-0.291)
Final losses, mean over seeds 0-4: autocast bf16 0.1054 (sd across seeds 0.0147), amprewrite
0.1045; fp16 + GradScaler autocast 0.1098 (sd 0.0173), amprewrite 0.1086. From 0.526 at step 0.
Run time: about 6 s of CPU for all fast tests (one thread; the backend's dynamo captures most).

The full-size runs (width 256, 64 x 64, 300 steps; 400-500 s each on a 2-core AVX2 machine)
are marked slow. Measured there: fp32 0.0485, autocast(bf16) 0.0431, transform(bf16) 0.0496,
transform(fp16)+GradScaler 0.0435, torch.compile(backend="amprewrite") 0.0430.
"""

from __future__ import annotations

import math

import pytest
import torch

from ..helpers import assert_policy_intent
from .checkerboard import train

SEEDS = range(5)
SMALL = {"steps": 60, "width": 16, "size": 16, "lr": 5e-3, "threads": 1}
# Per seed, amprewrite's curve may differ from autocast's by at most CURVE_MARGIN (relative
# area): under half of what separates the two closest seeds (0.044), 2.5x amprewrite's largest
# measured difference (0.0081).
CURVE_MARGIN = 0.02
# Mean final loss over the seeds: at most autocast's mean plus one standard error of a mean of
# len(SEEDS) seeds (sd 0.0173, the larger of the two measured).
FINAL_MARGIN = 0.0173 / math.sqrt(len(SEEDS))
# What the graph must run: the policy's intent, not amprewrite's own classes.
EXPECT = {"conv": "low", "batch_norm": "fp32", "mse_loss": "fp32"}


def _area(curve: list[float], ref: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(curve, ref)) / sum(ref)


@pytest.fixture(scope="module")
def autocast_curves() -> dict[str, list[list[float]]]:
    return {name: [train(name, seed=s, **SMALL) for s in SEEDS]
            for name in ("autocast_bf16", "autocast_fp16_scaler")}


def _check_follows(variant: str, reference: list[list[float]], dtype: torch.dtype) -> None:
    curves = []
    for seed, ref in zip(SEEDS, reference):
        graphs: list = []
        curve = train(variant, seed=seed, graphs=graphs, **SMALL)
        assert len(curve) == len(ref) and all(math.isfinite(v) for v in curve), (seed, curve)
        assert _area(curve, ref) <= CURVE_MARGIN, (seed, _area(curve, ref))
        gm, inputs = graphs[0]
        assert_policy_intent(gm, *inputs, low=dtype, expect=EXPECT)
        curves.append(curve)
    final, ref_final = (sum(c[-1] for c in cs) / len(cs) for cs in (curves, reference))
    assert final <= ref_final + FINAL_MARGIN, (final, ref_final)
    assert final < 0.5 * curves[0][0]  # and it learned: from 0.53 to about 0.1


@pytest.mark.parametrize("variant", ["transform_bf16", "backend_bf16"])
def test_training_follows_autocasts_loss_curve(variant, autocast_curves):
    _check_follows(variant, autocast_curves["autocast_bf16"], torch.bfloat16)


def test_fp16_with_grad_scaler_follows_autocast(autocast_curves):
    """fp16 needs loss scaling: GradScaler works on the transformed graph as with autocast."""
    _check_follows("transform_fp16_scaler", autocast_curves["autocast_fp16_scaler"],
                   torch.float16)


@pytest.fixture(scope="module")
def fp32_loss() -> float:
    return train("fp32")[-1]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["transform_bf16", "compile_amprewrite"])
def test_mixed_precision_reaches_fp32_loss_full_width(variant, fp32_loss):
    """The full recipe: a mixed-precision run may end lower than fp32 (autocast does, by 11%),
    but not more than 10% higher."""
    loss = train(variant)[-1]
    assert loss <= 1.10 * fp32_loss, (variant, loss, fp32_loss)


@pytest.mark.slow
def test_fp16_with_grad_scaler_full(fp32_loss):
    loss = train("transform_fp16_scaler")[-1]
    assert loss <= 1.10 * fp32_loss, (loss, fp32_loss)
