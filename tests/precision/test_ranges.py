"""Values are facts too: ranges recorded on the example inputs decide precision like op types.

The overflow cases are amprewrite.testing.overflow's: models whose fp32 values pass fp16's
65504 while their outputs stay finite. Errors are relative L2 against the fp32 model.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite import ModelError, NotVerifiedWarning
from amprewrite.capture.verify import float_leaves, rel_err
from amprewrite.precision.ranges import range_limit
from amprewrite.testing import overflow
from amprewrite.testing.zoo import call

from ..helpers import run_in_process, unchanged

FAST = ["t5_ff", "scores", "residual"]
REAL = ["gpt2", "llama", "t5"]


def _error(gm, case) -> float:
    refs = float_leaves(call(case.model, case.inputs))
    outs = float_leaves(call(gm, case.inputs))
    return max(rel_err(o, r) for o, r in zip(outs, refs))


# The goal on every case: the default plan keeps at least half of the matmul FLOPs in
# fp16 (GPT-2's two overflowing MLPs are 56% of them: overflow="auto" rescales the last one's
# up projection, 58% low, where overflow="fp32" leaves 44%).
FLOPS_LOW = 0.5


def _check_case(case) -> None:
    with unchanged(case.model):
        gm = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs)
    refs = float_leaves(call(case.model, case.inputs))
    assert all(bool(torch.isfinite(r).all()) for r in refs)
    error = _error(gm, case)  # inf where any output is not finite
    by_hand = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs,
                                   keep_fp32=case.by_hand, verify=False)
    hand_error = _error(by_hand, case)
    assert error <= 1.5 * hand_error + 1e-6, (error, hand_error)
    low, total = overflow.matmul_flops(gm)
    assert low >= FLOPS_LOW * total, (low, total)
    reasons = [d.reason for d in amprewrite.report(gm).decisions if d.reason.startswith("range:")]
    assert reasons and all("> fp16 max 65504 / headroom 16" in r for r in reasons), reasons


@pytest.mark.parametrize("name", FAST)
def test_overflow_is_fixed_from_the_example_inputs(name):
    case = overflow.CASES[name]()
    _check_case(case)


@pytest.mark.parametrize("name", ["scores", "residual"])
def test_without_example_inputs_the_same_models_overflow(name):
    # What the ranges add: the op-type plan alone returns inf on these (t5_ff's norm-free
    # feed-forward is kept finite by op type already: its overflowing linear reads fp32).
    case = overflow.CASES[name]()
    with pytest.warns(NotVerifiedWarning, match="ranges of its values are unknown"):
        gm = amprewrite.transform(case.model, "fp16")
    assert not all(bool(torch.isfinite(o).all()) for o in float_leaves(call(gm, case.inputs)))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "llama"
                                  else n for n in REAL])
def test_real_architectures_scaled_until_they_overflow(name):
    case = overflow.CASES[name]()
    _check_case(case)


@pytest.mark.parametrize("name", ["t5_ff", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_overflow_rescale_keeps_more_matmul_flops_low(name):
    case = overflow.CASES[name]()
    default = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs,
                                   overflow="fp32")
    gm = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs,
                              overflow="rescale")  # verified: within the bound, finite
    assert all(bool(torch.isfinite(o).all()) for o in float_leaves(call(gm, case.inputs)))
    low, total = overflow.matmul_flops(gm)
    assert low > overflow.matmul_flops(default)[0] and low >= 0.7 * total, (low, total)
    rescaled = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "rescale_matmuls"]
    assert rescaled and all("scaled back by 2^" in r.reason for r in rescaled)
    assert not any(r.pass_name == "rescale_matmuls" for r in amprewrite.report(default).rewrites)


def test_auto_rescales_from_the_output_backwards_until_half_the_flops_are_low():
    # Three T5-style feed-forwards; the up projections of the last two overflow (2e5), so
    # keeping every overflowing matmul fp32 leaves 1/3 of the FLOPs low. overflow="auto"
    # rescales the last up projection only (1/2 low) and keeps the second one fp32.
    torch.manual_seed(0)
    model, inputs = overflow.T5FeedForward(layers=3).eval(), (torch.randn(2, 32, 64),)
    overflow._scale_to(model, inputs, "wi.1", 2e5)
    overflow._scale_to(model, inputs, "wi.2", 2e5)
    by_hand = overflow.overflowing_modules(model, inputs)
    assert by_hand == ["wi.1", "wo.1", "norm.2", "wi.2", "wo.2"]
    plans = {mode: amprewrite.transform(model, "fp16", example_inputs=inputs, overflow=mode)
             for mode in ("fp32", "auto", "rescale")}
    shares = {mode: overflow.matmul_flops(gm) for mode, gm in plans.items()}
    assert shares["fp32"][0] == pytest.approx(shares["fp32"][1] / 3)
    assert shares["auto"][0] == pytest.approx(shares["auto"][1] / 2)
    rescaled = [r for r in amprewrite.report(plans["auto"]).rewrites
                if r.pass_name == "rescale_matmuls"]
    assert [r.module_path for r in rescaled] == ["wi.2"], rescaled
    assert "overflow='auto' (fp32 would leave under 50% of the matmul FLOPs" in rescaled[0].reason
    assert not any(r.pass_name == "rescale_matmuls"
                   for r in amprewrite.report(plans["fp32"]).rewrites)
    hand = amprewrite.transform(model, "fp16", example_inputs=inputs, keep_fp32=by_hand,
                                verify=False)
    refs = float_leaves(model(*inputs))
    errors = {mode: max(rel_err(o, r) for o, r in zip(float_leaves(gm(*inputs)), refs))
              for mode, gm in {**plans, "hand": hand}.items()}
    assert errors["fp32"] == errors["hand"]  # the same plan
    # Fewer fp16 roundings than rescaling both (measured 2.75e-4 against 4.5e-4). Not within
    # 1.5x of fp32's 1.0e-4: the last block's output is most of the output, and fp16 rounds
    # its input, weight and result (docs/guide.md, "overflow").
    assert errors["hand"] < errors["auto"] < errors["rescale"], errors


@pytest.mark.parametrize("mode", ["auto", "rescale"])
def test_allow_low_vouches_for_a_matmul_so_it_is_not_rescaled(mode):
    # allow_low runs the module as the model wrote it: no rescale (whose fp32 scale-back the
    # selector would otherwise make fp16 too), and auto counts it as fp16.
    case = overflow.t5_ff()
    gm = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs, overflow=mode,
                              allow_low=["wi.1"], verify=False)
    assert not any(r.pass_name == "rescale_matmuls" for r in amprewrite.report(gm).rewrites)
    linear = next(d for d in amprewrite.report(gm).decisions
                  if d.module_path == "wi.1" and d.family == "linear")
    assert linear.precision == "low" and "allow_low='wi.1'" in linear.reason, linear


def test_rescale_is_exact_in_fp32():
    # The rewrite alone (before any rounding): the graph with every op in fp32 (keep_fp32 of
    # each op family the model uses) equals the model's output to fp32's rounding.
    case = overflow.t5_ff()
    gm = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs,
                              overflow="rescale", keep_fp32=["linear", "relu", "layer_norm"],
                              verify=False)
    assert any(r.pass_name == "rescale_matmuls" for r in amprewrite.report(gm).rewrites)
    (x,) = case.inputs
    assert rel_err(gm(x), case.model(x)) < 1e-6


def test_reason_names_the_range_and_the_report_shows_ranges():
    case = overflow.scores()
    gm = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs)
    rep = amprewrite.report(gm)
    (scores,) = [d for d in rep.decisions if d.node == "scores"]
    assert scores.precision == "fp32" and scores.dtype == "torch.float32"
    assert scores.reason.startswith("range: |scores| up to 2.")
    assert "on the example inputs > fp16 max 65504 / headroom 16" in scores.reason
    assert scores.range is not None and 1e5 < scores.range.absmax < 1e6
    header = str(rep).split("precision decisions:\n")[1].splitlines()[0]
    assert "|x| max" in header
    # The matmuls that read q and k stay low: only the value past the range moved.
    lows = [d.node for d in rep.decisions if d.family == "linear" and d.precision == "low"]
    assert len(lows) == 4


def test_bf16_keeps_fp32s_range_so_ranges_change_nothing():
    case = overflow.scores()
    gm = amprewrite.transform(case.model, "bf16", example_inputs=case.inputs)
    assert not [d for d in amprewrite.report(gm).decisions if d.reason.startswith("range")]
    assert range_limit(torch.bfloat16) > 1e37


class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x)


def test_calibration_batches_widen_the_ranges():
    model = _Lin().eval()
    small = (torch.randn(4, 16),)
    big = (torch.randn(4, 16) * 1e4,)
    gm = amprewrite.transform(model, "fp16", example_inputs=small)
    assert [d.precision for d in amprewrite.report(gm).decisions if d.family == "linear"] == [
        "low"]
    with unchanged(model):
        gm = amprewrite.transform(model, "fp16", example_inputs=small, calibration=[big])
    (fc,) = [d for d in amprewrite.report(gm).decisions if d.family == "linear"]
    assert fc.precision == "fp32"
    assert "on the example inputs and 1 calibration batch >" in fc.reason
    assert torch.isfinite(gm(*big)).all()
    assert rel_err(gm(*big), model(*big)) < 1e-6  # fp32 arithmetic throughout
    # Calibration alone: its first batch is the example inputs.
    gm = amprewrite.transform(model, "fp16", calibration=[small, big])
    assert [d.precision for d in amprewrite.report(gm).decisions if d.family == "linear"] == [
        "fp32"]


def test_a_calibration_batch_that_does_not_fit_the_graph_is_a_clear_error():
    model = _Lin().eval()
    with pytest.raises(ModelError, match=r"calibration batch 0 .* same form as example_inputs"):
        amprewrite.transform(model, "fp16", example_inputs=(torch.randn(4, 16),),
                             calibration=[(torch.randn(4, 7),)])
    with pytest.raises(amprewrite.PolicyError, match="iterable of input batches"):
        amprewrite.transform(model, "fp16", calibration=torch.randn(4, 16))


def test_weight_past_fp16s_range_keeps_its_op_fp32_without_inputs():
    model = _Lin().eval()
    with torch.no_grad():
        model.fc.weight[0, 0] = 1e5
    gm = amprewrite.transform(model, "fp16", verify=False)
    (fc,) = [d for d in amprewrite.report(gm).decisions if d.family == "linear"]
    assert fc.precision == "fp32" and "reads weight 'fc.weight' with |x| up to 1e+05" in fc.reason
    x = torch.randn(4, 16)
    assert torch.isfinite(gm(x)).all() and rel_err(gm(x), model(x)) < 1e-6


def test_weight_fp16_would_store_subnormal_keeps_its_op_fp32():
    model = _Lin().eval()
    with torch.no_grad():
        model.fc.weight.mul_(1e-5)  # |w| <= 2.5e-6: below fp16's smallest normal, 6.1e-5
        model.fc.bias.zero_()  # the weight's product is the whole output
    x = torch.randn(4, 16)
    gm = amprewrite.transform(model, "fp16", example_inputs=(x,))
    (fc,) = [d for d in amprewrite.report(gm).decisions if d.family == "linear"]
    assert fc.precision == "fp32" and "mostly subnormal" in fc.reason
    # What rounding the weight to fp16 would cost, against fp32 arithmetic on it.
    rounded = torch.nn.functional.linear(x, model.fc.weight.half().float(), model.fc.bias)
    assert rel_err(gm(x), model(x)) < 1e-6 < rel_err(rounded, model(x))


def _tiny_biases(model: nn.Module, *names: str) -> nn.Module:
    """Biases of std 1e-6 (torchvision's ViT MLP init): below fp16's smallest normal, 6.1e-5."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(names):
                p.normal_(std=1e-6)
    return model


def _low_share(gm) -> float:
    low, total = overflow.matmul_flops(gm)
    return low / total


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class _Addmm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w, self.b = nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return torch.addmm(self.b, x, self.w)


@pytest.mark.parametrize("make,shape", [
    # The minimal case; then one matmul each, whose output at x = 0 is its bias.
    (lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), (8, 64)),
    (lambda: nn.Linear(64, 32), (8, 64)),
    (_Conv, (2, 3, 8, 8)),
    (_Addmm, (4, 16)),
])
def test_a_subnormal_bias_costs_its_add_not_its_matmul(make, shape):
    model = _tiny_biases(make().eval(), "bias", "b")
    x = torch.randn(shape)
    with unchanged(model):
        gm = amprewrite.transform(model, "fp16", example_inputs=(x,))
    rep = amprewrite.report(gm)
    assert _low_share(gm) == 1.0  # was 0.0: the bias kept every matmul fp32
    splits = [r for r in rep.rewrites if "mostly subnormal" in r.reason]
    assert splits and all("added after the product" in r.action for r in splits)
    if not isinstance(model, nn.Sequential):
        # The bias is added in fp32, never rounded: where the product is 0, the output is
        # the bias itself (fp16 would round 1e-6 to a multiple of 6e-8).
        zero = torch.zeros(shape)
        assert torch.equal(gm(zero), model(zero))
    # Against fp32 the error is fp16 matmuls' (relative L2 below 1e-3), no more than rounding
    # the biases into the fp16 matmuls gives (allow_low: the model as written, in fp16).
    as_written = amprewrite.transform(model, "fp16", example_inputs=(x,), verify=False,
                                      allow_low=["linear", "matmul", "conv"])
    x = torch.randn(shape)
    error, written = rel_err(gm(x), model(x)), rel_err(as_written(x), model(x))
    assert error < 1e-3 and error <= 1.1 * written, (error, written)


def test_a_subnormal_bias_of_a_vit_mlp_keeps_its_matmuls_in_fp16():
    from amprewrite.testing import zoo

    model, inputs = zoo.vit()
    _tiny_biases(model, "mlp.fc1.bias", "mlp.fc2.bias")
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs)
    assert _low_share(gm) == 1.0  # 0.59 before: the four MLP linears ran fp32
    assert not any(n.startswith("ranges:") for n in amprewrite.report(gm).notes)
    as_written = amprewrite.transform(model, "fp16", example_inputs=inputs, verify=False,
                                      allow_low=["linear"])
    torch.manual_seed(2)
    x = torch.randn(16, 3, 32, 32)
    ref = model(x).logits
    error, written = rel_err(gm(x).logits, ref), rel_err(as_written(x).logits, ref)
    # Measured over 4 bias seeds: 0.97-1.03x the rounded biases' error, ~7e-4.
    assert error < 2e-3 and error <= 1.1 * written, (error, written)


def test_the_report_says_when_ranges_keep_most_matmul_flops_fp32():
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    with torch.no_grad():
        model[0].weight.mul_(1e-5)  # stored mostly subnormal in fp16: its matmul stays fp32
    x = torch.randn(8, 64)
    gm = amprewrite.transform(model, "fp16", example_inputs=(x,))
    assert _low_share(gm) == 0.5
    assert not any(n.startswith("ranges:") for n in amprewrite.report(gm).notes)  # not > half
    with torch.no_grad():
        model[2].weight.mul_(1e-5)
    gm = amprewrite.transform(model, "fp16", example_inputs=(x,))
    assert _low_share(gm) == 0.0
    (note,) = [n for n in amprewrite.report(gm).notes if n.startswith("ranges:")]
    assert note.startswith("ranges: 100% of the matmul FLOPs stay fp32")
    assert "allow_low=['node:input_1', 'node:input_3']" in note


def test_allow_low_gives_back_what_a_range_took():
    case = overflow.scores()
    gm = amprewrite.transform(case.model, "fp16", example_inputs=case.inputs,
                              allow_low=["node:scores"], verify=False)
    (scores,) = [d for d in amprewrite.report(gm).decisions if d.node == "scores"]
    assert scores.precision == "low" and scores.reason.startswith("allow_low='node:scores'")
    assert not torch.isfinite(gm(*case.inputs)).all()  # the user's choice, as asked


def test_no_inputs_warning_names_ranges_in_fp16_only():
    model = _Lin()
    with pytest.warns(NotVerifiedWarning, match=r"calibration=\[\.\.\.\] gives them"):
        amprewrite.transform(model, "fp16")
    with pytest.warns(NotVerifiedWarning) as record:
        amprewrite.transform(model, "bf16")
    assert "ranges" not in str(record[0].message)


class _Declares(nn.Module):
    _keep_in_fp32_modules = ["wo"]
    _keep_in_fp32_modules_strict = ["gate.weight"]

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wi, self.wo, self.gate = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4, False)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x))), self.gate(x).softmax(-1)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_models_own_fp32_declarations_are_honoured(dtype):
    model = _Declares().eval()
    gm = amprewrite.transform(model, dtype, example_inputs=(torch.randn(4, 8),), params="low")
    by_module = {d.module_path: d for d in amprewrite.report(gm).decisions
                 if d.family == "linear"}
    assert by_module["gate"].precision == "fp32"
    assert by_module["gate"].reason == ("declared fp32 by the model "
                                        "(_keep_in_fp32_modules_strict): reads 'gate.weight'")
    assert by_module["wi"].precision == "low"
    if dtype == "fp16":  # _keep_in_fp32_modules applies to fp16 only, as in transformers
        assert by_module["wo"].reason.startswith("declared fp32 by the model "
                                                 "(_keep_in_fp32_modules)")
    else:
        assert by_module["wo"].precision == "low"
    state = gm.state_dict()
    assert state["gate.weight"].dtype == torch.float32  # params="low" stores it fp32
    assert state["wi.weight"].dtype != torch.float32


def test_allow_low_overrides_the_non_strict_declaration_only():
    model = _Declares().eval()
    gm = amprewrite.transform(model, "fp16", example_inputs=(torch.randn(4, 8),),
                              allow_low=["wo", "gate"])
    by_module = {d.module_path: d for d in amprewrite.report(gm).decisions
                 if d.family == "linear"}
    assert by_module["wo"].precision == "low"
    assert by_module["gate"].precision == "fp32"


def test_training_with_grad_scaler_loses_no_step_to_forward_overflow():
    case = overflow.residual()
    model = case.model.train()
    (x,) = case.inputs
    target = torch.randn(x.shape[0], 16)
    with unchanged(model):
        gm = amprewrite.transform(model, "fp16", example_inputs=(x,))
    assert any(d.reason.startswith("range:") for d in amprewrite.report(gm).decisions)
    opt = torch.optim.SGD(gm.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(gm(x), target)
        assert torch.isfinite(loss)
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in gm.parameters()]
        scaler.step(opt)
        scaler.update()
        # The step was taken: the scaler found no inf or NaN in the gradients.
        assert any(not torch.equal(b, p) for b, p in zip(before, gm.parameters()))
    assert scaler.get_scale() == 2.0**10


# --- the command line ------------------------------------------------------------------------
_CLI_MODELS = '''
import torch
from amprewrite.testing import overflow


def scores():
    case = overflow.scores()
    return case.model, case.inputs


def lin():
    torch.manual_seed(0)
    return torch.nn.Linear(16, 16).eval(), (torch.randn(4, 16),)


def batches():
    return [(torch.randn(4, 16) * 1e4,)]
'''


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return run_in_process(*args, cwd=cwd)


def test_cli_check_fixes_overflow_and_calibration_widens_ranges(tmp_path):
    models = tmp_path / "my models.py"  # a path with a space: flags are shell-quoted
    models.write_text(_CLI_MODELS)
    done = _cli("check", f"{models}:scores", "--dtype", "fp16", cwd=tmp_path)
    assert done.returncode == 0 and "check passed" in done.stdout, done.stdout + done.stderr
    out = tmp_path / "dump"
    done = _cli("dump", f"{models}:lin", "--dtype", "fp16", "--calibration",
                f"{models}:batches", "--out", str(out), "--format", "text", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = "\n".join(p.read_text() for p in out.rglob("*.txt"))
    assert "on the example inputs and 1 calibration batch > fp16 max 65504" in text


def test_cli_prints_selector_advice_as_flags():
    from amprewrite.cli.flags import cli_wording

    said = cli_wording("Transformed again with keep_fp32=['wi', 'my block.fc'], it passes")
    assert said == "Transformed again with --keep-fp32 wi --keep-fp32 'my block.fc', it passes"
    assert cli_wording("keep_fp32=[<module path>]") == "keep_fp32=[<module path>]"


# --- constants the model makes ---------------------------------------------------------------
class _LogProb(nn.Module):
    """A Normal's log_prob with a small fixed scale: it divides by the scale's square, so a
    scale rounded to fp16 (0.01 -> 0.010002) moves every output."""

    def __init__(self, fill: float = 0.01, method: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.fill, self.method = nn.Linear(4096, 64), fill, method

    def forward(self, x, y):
        h = self.fc(x)
        scale = (h.new_full(h.shape, self.fill) if self.method
                 else torch.full_like(h, self.fill))
        return torch.distributions.Normal(h, scale, validate_args=False).log_prob(y)


@pytest.mark.parametrize("method", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_fill_the_low_dtype_cannot_hold_is_made_in_fp32(dtype, method):
    model = _LogProb(method=method).eval()
    x, y = torch.randn(8, 4096), torch.randn(8, 64)
    ref = model.double()(x.double(), y.double())
    model.float()
    gm = amprewrite.transform(model, dtype, example_inputs=(x, y))
    low = torch.float16 if dtype == "fp16" else torch.bfloat16
    with torch.autocast("cpu", dtype=low):
        autocast = model(x, y)
    ours, theirs = rel_err(gm(x, y), ref), rel_err(autocast, ref)
    assert ours <= 1.1 * theirs, (ours, theirs)  # measured 1.01x (fp16), 0.91x (bf16)
    (fill,) = [d for d in amprewrite.report(gm).decisions if "fill value 0.01" in d.reason]
    assert fill.storage == "torch.float32"


def test_a_fill_the_low_dtype_holds_follows_its_input():
    model = _LogProb(fill=0.5).eval()
    gm = amprewrite.transform(model, "fp16", example_inputs=(torch.randn(8, 4096),
                                                             torch.randn(8, 64)))
    (fill,) = [d for d in amprewrite.report(gm).decisions if d.family == "factory"]
    assert fill.storage == "torch.float16" and "fill value" not in fill.reason


def test_overflow_option_is_checked():
    with pytest.raises(amprewrite.PolicyError, match="overflow must be 'auto'"):
        amprewrite.transform(_Lin(), "fp16", overflow="clip")


# --- the torch.compile backend -----------------------------------------------------------------
def _compiled(model, *inputs, dynamic=None):
    """Compile with the backend (eager inside); returns (output, transformed graphs)."""
    gms = []

    def record(gm, example_inputs):
        gms.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=amprewrite.backend(dtype="fp16", inner=record),
                        dynamic=dynamic)(*inputs)
    return out, gms


@pytest.mark.parametrize("dynamic", [False, True])
def test_backend_rescales_what_transform_rescales(dynamic):
    # The backend's graphs take the parameters as inputs: a placeholder the call hands an
    # nn.Parameter is a weight auto may scale (it read none before: fp32 left 1/3 low).
    torch.manual_seed(0)
    model, inputs = overflow.T5FeedForward(layers=3).eval(), (torch.randn(2, 32, 64),)
    overflow._scale_to(model, inputs, "wi.1", 2e5)
    overflow._scale_to(model, inputs, "wi.2", 2e5)
    out, (gm,) = _compiled(model, *inputs, dynamic=dynamic)
    low, total = overflow.matmul_flops(gm)
    assert low == pytest.approx(total / 2)
    rescaled = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "rescale_matmuls"]
    assert [r.module_path for r in rescaled] == ["wi.2"], rescaled
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs, verify=False)
    assert rel_err(out, model(*inputs)) <= 1.01 * rel_err(gm(*inputs), model(*inputs))


def test_backend_reads_the_ranges_of_the_call_it_compiles_for():
    case = overflow.scores()
    out, (gm,) = _compiled(case.model, *case.inputs)
    assert torch.isfinite(out).all()
    assert rel_err(out, case.model(*case.inputs)) < 2e-3  # transform's: 8.4e-4
    assert any(d.reason.startswith("range: |") for d in amprewrite.report(gm).decisions)


def test_backend_honours_the_models_declarations():
    model = _Declares().eval()
    _, (gm,) = _compiled(model, torch.randn(4, 8))
    reasons = {d.reason for d in amprewrite.report(gm).decisions if d.family == "linear"}
    assert "declared fp32 by the model (_keep_in_fp32_modules_strict): reads 'gate.weight'" in (
        reasons)
    assert any(r.startswith("declared fp32 by the model (_keep_in_fp32_modules)") for r in reasons)


@pytest.mark.parametrize("name", ["llama", "gpt2", "resnet"])
def test_on_the_zoo_no_range_decides_anything(name):
    # Their example inputs reach nowhere near 65504 / 16 where a LOW op reads or writes: the
    # fp16 graph is the op-type plan (the 48 zoo dumps were identical; this keeps three).
    from amprewrite.testing import zoo

    model, inputs = zoo.MODELS[name]()
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs, verify=False)
    decisions = amprewrite.report(gm).decisions
    assert any(d.range is not None for d in decisions if d.family)  # ranges were recorded
    assert not [d.node for d in decisions if d.reason.startswith(("range", "declared"))]


class _ConvStack(nn.Module):
    """Two 3x3 convolutions and a 1x1 head; the second's output passes fp16's range (3e4 times
    its weight) and the head brings it back (1e-5 times its weight)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 64, 3, padding=1)
        self.head = nn.Conv2d(64, 4, 1)
        with torch.no_grad():
            self.b.weight.mul_(3e4)
            self.b.bias.mul_(3e4)
            self.head.weight.mul_(1e-5)

    def forward(self, x):
        return self.head(self.b(torch.relu(self.a(x))))


def test_a_convolution_is_rescaled_like_a_matmul_and_counted_by_its_kernel():
    torch.manual_seed(0)
    model, x = _ConvStack().eval(), torch.randn(2, 3, 16, 16)
    gm = amprewrite.transform(model, "fp16", example_inputs=(x,), overflow="rescale")
    (rescaled,) = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "rescale_matmuls"]
    assert rescaled.module_path == "b" and "weight * 2^-" in rescaled.reason, rescaled
    ref = model(x)
    assert rel_err(gm(x), ref) < 2e-3  # fp16's class of error, and finite
    kept = amprewrite.transform(model, "fp16", example_inputs=(x,), overflow="fp32")
    # FLOPs: 2 x output elements x (in-channels x kernel), e.g. b: 2 x (2 x 64 x 16 x 16) x 16 x 9
    low, total = overflow.matmul_flops(kept)
    flops = {"a": 2 * 2 * 16 * 256 * 3 * 9, "b": 2 * 2 * 64 * 256 * 16 * 9,
             "head": 2 * 2 * 4 * 256 * 64}
    assert total == sum(flops.values())
    assert low == flops["a"]  # the head reads b's value, past the range: fp32 either way
    assert overflow.matmul_flops(gm)[0] == flops["a"] + flops["b"]


def test_auto_adds_no_rounding_where_half_the_flops_are_out_of_reach():
    # The big conv's output is read by a wider conv, which reads a value past the range and
    # stays fp32 either way (no activation is scaled): rescaling b would bring 22% of the
    # FLOPs to fp16, not half, so overflow="auto" keeps the accurate plan.
    torch.manual_seed(0)
    model, x = _ConvStack().eval(), torch.randn(2, 3, 16, 16)
    model.head = nn.Conv2d(64, 256, 3, padding=1)
    gm = amprewrite.transform(model, "fp16", example_inputs=(x,), overflow="fp32")
    low, total = overflow.matmul_flops(gm)
    assert low < 0.05 * total
    rescaled = amprewrite.transform(model, "fp16", example_inputs=(x,), overflow="rescale")
    assert 0.05 * total < overflow.matmul_flops(rescaled)[0] < 0.5 * total
    auto = amprewrite.transform(model, "fp16", example_inputs=(x,))
    assert not [r for r in amprewrite.report(auto).rewrites if r.pass_name == "rescale_matmuls"]
    assert torch.equal(auto(x), gm(x))
