"""The built-in check (``verify=``) in train mode, and graphs it cannot check.

A model fresh from its constructor is in train mode, so the check must run there: the fp32
model, autocast and the graph start from one random state with dropout masks drawn as fp32
draws them, and every buffer is restored after each run, so BatchNorm statistics, the caller's
model and the generators end as they began. A graph with nothing to run on says so in the
report and with a ``NotVerifiedWarning``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from amprewrite import NotVerifiedWarning, VerificationError
from amprewrite.capture.verify import _DropoutMasksInFp32
from amprewrite.show.numerics import check_numerics, verify_bound, verify_graph

from ..helpers import corrupt_a_linear, count_calls, unchanged


def _net() -> nn.Module:
    """Linear, BatchNorm (running statistics move in train mode), Dropout(0.5), Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(32, 8)).train()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _verify_note(gm) -> str:
    notes = [n for n in amprewrite.report(gm).notes if n.startswith("verify")]
    assert len(notes) == 1, notes
    return notes[0]


def test_train_mode_graph_is_verified_and_the_note_gives_the_errors():
    model = _net()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(64, 16),))
    assert gm.training
    note = _verify_note(gm)
    assert note.startswith("verify: output error ") and "(autocast: " in note, note
    assert "train mode" in note and "skipped" not in note
    assert "verify" in amprewrite.report(gm).timings


def test_batchnorm_statistics_model_and_rng_are_untouched_in_train_mode():
    model = _net()
    x = torch.randn(64, 16)
    stats = _buffers(model)  # running_mean, running_var, num_batches_tracked
    assert set(stats) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    rng = torch.get_rng_state()
    with unchanged(model):  # every tensor bitwise, modes, identities
        gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
        check_numerics(model, (x,), torch.bfloat16, gm=gm)  # the diagnosis path restores too
    for name, value in model.named_buffers():
        assert value.dtype == stats[name].dtype and torch.equal(value, stats[name]), name
    # Verifying consumed none of the caller's random numbers.
    assert torch.equal(torch.get_rng_state(), rng)
    # The graph still shares the model's statistics (params="fp32"): its next training step
    # moves them, as the model's own would.
    with torch.no_grad():
        gm(x)
    assert int(model[1].num_batches_tracked) == int(stats["1.num_batches_tracked"]) + 1
    assert not torch.equal(model[1].running_mean, stats["1.running_mean"])


def test_dropout_in_train_mode_verifies_with_equal_masks():
    model = _net()
    x = torch.randn(64, 16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,), verify=False)
    errors = verify_graph(model, gm, (x,), torch.bfloat16)
    # Equal masks: both errors are bf16 rounding of two linears (about 4e-3 here). Masks that
    # differed would zero different halves of the activations, an error near 1.
    assert errors["error"] < 2e-2 and errors["autocast_error"] < 2e-2, errors
    assert errors["error"] <= verify_bound(errors["autocast_error"], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["dropout", "dropout2d", "bernoulli_", "native_dropout"])
def test_dropout_draws_the_fp32_mask_whatever_the_dtype(name, dtype):
    # bf16-representable values and p=0.5 (a scale of 2): the low result is exact, so the low
    # and the fp32 outputs are bitwise equal exactly when the masks are.
    x = (torch.rand(4, 8, 16, 16) + 1.0).to(dtype).float()  # no zeros: a zero means dropped
    ops = {
        "dropout": lambda t: F.dropout(t, 0.5, True),
        "dropout2d": lambda t: F.dropout2d(t, 0.5, True),
        "bernoulli_": lambda t: t * torch.empty_like(t).bernoulli_(0.5),
        "native_dropout": lambda t: torch.native_dropout(t, 0.5, True)[0],
    }
    outs = []
    for t in (x, x.to(dtype)):
        torch.manual_seed(0)
        with torch.no_grad(), _DropoutMasksInFp32():
            outs.append(ops[name](t))
    assert outs[1].dtype == dtype
    assert torch.equal(outs[1].float(), outs[0])
    assert 0.4 < float((outs[0] == 0).float().mean()) < 0.6  # it did drop


class _SeenDtypes(TorchDispatchMode):
    """Records the dtype of the first argument of each random op that reaches the kernels."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen.append((str(func.overloadpacket), args[0].dtype))
        return func(*args, **(kwargs or {}))


def test_mask_ops_reach_the_kernel_in_fp32():
    # On CPU the masks above agree even without the mode (today's kernels draw dtype-blind),
    # so this pins what the mode does: the draw itself runs on fp32 (entered first, the
    # recorder sits below the mode and sees what it passes on).
    x = torch.rand(4, 8, 16).bfloat16()
    with torch.no_grad(), _SeenDtypes() as below, _DropoutMasksInFp32():
        out = F.dropout(x, 0.5, True)
        native, mask = torch.native_dropout(x, 0.5, True)
    assert below.seen == [("aten.bernoulli_", torch.float32), ("aten.native_dropout",
                                                               torch.float32)]
    assert out.dtype == native.dtype == torch.bfloat16 and mask.dtype == torch.bool


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fused_dropout_draws_the_fp32_mask():
    # CUDA's fused dropout draws a different mask for bf16 than for fp32 from one generator
    # state (measured on an H100); verification needs them equal.
    x = (torch.rand(8, 64, 33, device="cuda") + 1.0).bfloat16().float()
    outs = []
    for t in (x, x.bfloat16()):
        torch.manual_seed(0)
        with torch.no_grad(), _DropoutMasksInFp32():
            outs.append(F.dropout(t, 0.5, True))
    assert torch.equal(outs[1].float(), outs[0])


class _WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(3.0)
        return self.lin(x)


def test_a_model_writing_its_input_is_checked_on_the_inputs_as_given():
    # Each run gets its own copy of the inputs: the caller's example stays as it was, and no
    # run sees the inputs another run wrote (that would be an error of about 2, far above).
    x = torch.randn(4, 8)
    example = x.clone()
    model = _WritesItsInput().eval()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(example,))
    assert torch.equal(example, x)
    errors = verify_graph(model, gm, (example,), torch.bfloat16)
    assert errors["error"] < 2e-2, errors


def test_wrong_graph_in_train_mode_raises_and_leaves_the_model_as_it_was(monkeypatch):
    # The last linear: BatchNorm would normalise the first one's error away.
    corrupted = corrupt_a_linear(monkeypatch, last=True)
    model = _net()
    stats = _buffers(model)
    with unchanged(model), pytest.raises(VerificationError) as err:
        amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(64, 16),))
    assert f"first node that departs from fp32 is '{corrupted[0]}'" in str(
        err.value)
    for name, value in model.named_buffers():
        assert torch.equal(value, stats[name]), name
    # The printed advice, applied as printed, passes (and still leaves the model as it was).
    keep = err.value.keep_fp32
    assert keep and f"keep_fp32={keep!r}, it passes this check" in str(err.value)
    with unchanged(model):
        amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(64, 16),),
                             keep_fp32=keep)
    for name, value in model.named_buffers():
        assert torch.equal(value, stats[name]), name


def test_no_example_inputs_warns_once_with_the_advice_and_notes_it():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with pytest.warns(NotVerifiedWarning, match=r"pass example_inputs=\(\.\.\.\) to transform"
                      ) as record:
        gm = amprewrite.transform(model, torch.bfloat16)
    assert len(record) == 1
    assert record[0].filename == __file__  # points at the caller's line, not into amprewrite
    note = _verify_note(gm)
    assert note.startswith("verify: not run") and "example_inputs=(...)" in note
    # Python's default filter shows it once per calling line.
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for _ in range(3):
            amprewrite.transform(model, torch.bfloat16)
    assert sum(issubclass(w.category, NotVerifiedWarning) for w in seen) == 1


def test_verify_false_is_a_choice_and_stays_quiet():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotVerifiedWarning)
        gm = amprewrite.transform(model, torch.bfloat16, verify=False)
    assert not [n for n in amprewrite.report(gm).notes if n.startswith("verify")]


class _LogOfPositions(nn.Module):
    """T5's relative-position buckets in small: ``log`` of the distances, -inf at distance 0 in
    fp32 as in the graph, then clamped to a finite bucket."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        distance = torch.arange(8, device=x.device).float()
        bucket = torch.log(distance / 2).clamp(min=0)  # log(0) = -inf, clamped away
        return self.fc(x) + bucket


def test_a_value_fp32_also_makes_infinite_is_no_error_and_not_the_first_non_finite_node():
    """check (and --fix) read a node that holds the same -inf as fp32 as agreeing with fp32:
    its error is over the other elements (it read inf, and was the "first non-finite node"
    that --fix would try to move)."""
    torch.manual_seed(0)
    model, x = _LogOfPositions().eval(), torch.randn(4, 8)
    result = check_numerics(model, (x,), torch.bfloat16)
    logs = [r for r in result.nodes if r.family == "log"]
    assert logs and all(not r.finite for r in logs)  # it is -inf, in fp32 as here
    assert all(r.rel_err is not None and r.rel_err < 2.0**-7 for r in logs), logs
    assert result.first_nonfinite is None and result.passed(1e-2)
    assert all(r.rel_err < 1e-2 for r in result.nodes if r.rel_err is not None)


def test_a_node_non_finite_only_in_low_precision_is_still_named():
    """fp16 overflow inside the graph (fp32 stays finite): the node's error is inf and it is
    the first non-finite node, as before."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight.fill_(1e3)
    x = torch.full((2, 8), 1e2)
    result = check_numerics(model, (x,), torch.float16, allow_low=["0", "2"])
    assert result.first_nonfinite is not None
    bad = {r.node: r for r in result.nodes}[result.first_nonfinite.node]
    assert not bad.finite and (bad.rel_err is None or bad.rel_err == float("inf"))


def test_check_numerics_captures_once_and_its_reference_is_that_capture(monkeypatch):
    """The fp32 reference graph is the one the transform captured (kept before its passes),
    not a second capture: one capture for check_numerics, one for all the rounds of
    find_fp32_nodes; the per-node errors equal those against a capture of its own."""
    from amprewrite.capture import trace
    from amprewrite.capture.verify import compare

    captures = count_calls(monkeypatch, trace, "_with_inputs")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    x = (torch.randn(4, 8),)
    with unchanged(model):
        result = check_numerics(model, x, torch.bfloat16)
    assert len(captures) == 1
    captures.clear()
    exported = check_numerics(model, x, torch.bfloat16, capture="export")  # kept by its method
    assert len(captures) == 1 and exported.output_error == result.output_error
    captures.clear()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=x, verify=False)
    alone = compare(model, gm, x)  # outside keep_captured: the reference captured afresh
    assert len(captures) == 2
    assert [(r.node, r.rel_err) for r in alone.nodes] == [(r.node, r.rel_err)
                                                          for r in result.nodes]
    assert alone.output_error == result.output_error

    captures.clear()
    big = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        big[0].weight.fill_(1e3)
    keep = amprewrite.find_fp32_nodes(big, (torch.full((2, 8), 1e2),), dtype=torch.float16,
                                      allow_low=["0", "2"])
    # Three rounds (a node kept in each of two, the round that passed), one capture: it was
    # one a round (checked on the old code).
    assert len(keep) == 2 and len(captures) == 1


def test_transforms_inside_keep_captured_start_from_one_capture(monkeypatch):
    """Inside keep_captured (check --fix, find_fp32_nodes, dump), a transform of the model it
    captured on the same inputs object starts from that capture: one capture for several
    policies, and graphs that compute bit for bit what fresh captures give, with the same
    report. Another train/eval mode, other dynamic shapes, another inputs object or another
    capture method capture again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from amprewrite.capture import trace

    captures = count_calls(monkeypatch, trace, "_with_inputs")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)).eval()
    inputs = (torch.randint(0, 64, (2, 16)),)
    policies = [{"dtype": torch.bfloat16, "verify": False},  # compared below, bit for bit
                {"dtype": torch.float16, "keep_fp32": ["lm_head"], "verify": False}]
    with trace.keep_captured():
        reused = [amprewrite.transform(model, example_inputs=inputs, **p) for p in policies]
    assert len(captures) == 1
    # The second graph started from the copy the first transform's passes left as captured.
    fresh = amprewrite.transform(model, example_inputs=inputs, **policies[1])
    assert len(captures) == 2 and reused[0].graph is not reused[1].graph
    with torch.no_grad():
        assert torch.equal(reused[1](*inputs).logits, fresh(*inputs).logits)
    ra, rb = amprewrite.report(reused[1]), amprewrite.report(fresh)
    assert [(d.node, d.precision) for d in ra.decisions] == [
        (d.node, d.precision) for d in rb.decisions]
    assert len(ra.casts) == len(rb.casts) > 0

    captures.clear()
    net, x = _net().eval(), (torch.randn(4, 16),)
    with trace.keep_captured():
        amprewrite.transform(net, torch.bfloat16, example_inputs=x)
        amprewrite.transform(net, torch.float16, example_inputs=x)  # reused
        assert len(captures) == 1
        amprewrite.transform(net, torch.bfloat16, example_inputs=x, dynamic_shapes=None)
        amprewrite.transform(net, torch.bfloat16, example_inputs=(x[0],))  # another tuple
        amprewrite.transform(net, torch.bfloat16, example_inputs=x, capture="export")
        net.train()
        amprewrite.transform(net, torch.bfloat16, example_inputs=x)
        assert len(captures) == 5
