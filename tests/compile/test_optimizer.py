"""amprewrite.optimizer: the training state stored as measured.

Each storage is chosen where its ratio of updates to ulp calls for it, keeps the updates it is
chosen for (against an fp32 run of the same update rule), and survives a checkpoint; the graph
``params="low"`` makes trains its own low weights and never the caller's model.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.compile import optimizer as O
from amprewrite.errors import PolicyError

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def _own_step_count(monkeypatch):
    """amprewrite.GradScaler.update counts steps for the plans in a process-wide counter
    (a re-plan's step): these tests' updates must not move another test's count."""
    from amprewrite.compile import block_plans

    monkeypatch.setattr(block_plans, "_STEP", [None])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 96), nn.LayerNorm(96), nn.GELU(), nn.Linear(96, 8))


def _low_graph(model: nn.Module, dtype=BF16) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amprewrite.transform(model.train(), dtype, params="low", verify=False)


def _sgd_run(value: float, update: float, numel: int, steps: int, dtype=BF16, **kw):
    """A weight at ``value`` moved by exactly ``update`` a step (SGD, gradient 1, lr =
    update): the ratio of update to ulp is known, and so is fp32's result."""
    w = nn.Parameter(torch.full((numel,), value, dtype=dtype))
    opt = amprewrite.optimizer([w], torch.optim.SGD, lr=update, **kw)
    for _ in range(steps):
        w.grad = torch.full_like(w, -1.0)
        opt.step()
    return w, opt


# ------------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_ulp_is_the_gap_to_the_next_value(dtype):
    torch.manual_seed(0)
    x = (torch.randn(4096) * torch.logspace(-6, 3, 4096)).to(dtype)
    x = torch.cat([x, torch.tensor([0.0, 1.0, torch.finfo(dtype).tiny], dtype=dtype)])
    up = torch.nextafter(x.abs(), torch.tensor(math.inf, dtype=dtype))
    assert torch.equal(O.ulp(x), (up.float() - x.abs().float()))


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_rounding_is_unbiased_seeded_and_exact_on_representable_values(dtype):
    step = O.ulp(torch.tensor([1.0]), dtype).item()
    x = torch.full((40000,), 1.0 + 0.3 * step)
    r1 = O.stochastic_round(x, dtype, torch.Generator().manual_seed(3))
    r2 = O.stochastic_round(x, dtype, torch.Generator().manual_seed(3))
    assert torch.equal(r1, r2)  # seeded: reproducible
    assert set(r1.float().unique().tolist()) == {1.0, 1.0 + step}  # the two neighbours only
    # mean 0.3 ulp above 1.0: binomial std of the share is 0.0023, the bound is 5 of them
    assert abs((r1.float().mean().item() - 1.0) / step - 0.3) < 0.012
    neg = O.stochastic_round(-x, dtype, torch.Generator().manual_seed(3)).float()
    assert abs((neg.mean().item() + 1.0) / step + 0.3) < 0.012
    exact = torch.randn(1000).to(dtype).float()
    assert torch.equal(O.stochastic_round(exact, dtype, torch.Generator()), exact.to(dtype))


# ------------------------------------------------------------------------- the decisions
@pytest.mark.parametrize(("update_ulps", "numel", "storage"), [
    (4.0, 16384, O.LOW),
    (0.7, 16384, O.SR),
    (0.05, 16384, O.KAHAN),
    (0.05, 64, O.MASTER),  # small: the master costs 256 bytes
    (0.002, 16384, O.MASTER),  # below what a bf16 compensation holds
])
def test_each_storage_is_chosen_where_the_updates_call_for_it(update_ulps, numel, storage):
    ulp = 2.0**-7  # bf16 at 1.0
    _, opt = _sgd_run(1.0, update_ulps * ulp, numel, steps=3, warmup=3)
    decision = opt.decisions["param 0"]
    assert decision.storage == storage, decision.reason
    assert f"ulp {ulp:.1e} at 1" in decision.reason


@pytest.mark.parametrize(("update_ulps", "numel"), [(0.7, 16384), (0.05, 16384), (0.05, 64),
                                                     (0.002, 16384)])
def test_the_chosen_storage_keeps_the_updates_that_plain_bf16_loses(update_ulps, numel):
    """After 100 steps of ``update`` each, fp32 has moved 100 * update. Plain bf16 (round to
    nearest, as ``model.to(bf16)`` + a torch optimizer) is off by more than a quarter of that
    (it never moves below half an ulp, and moves a whole ulp for 0.7); the chosen storage has
    moved as fp32 did, to within one ulp or 2% (stochastic rounding: the mean of 16384 random
    walks of 100 steps has a std of 0.04 ulp)."""
    update = update_ulps * 2.0**-7
    w, opt = _sgd_run(1.0, update, numel, steps=100, warmup=3)
    moved = opt._materialise(w, opt.state[w]).mean().item() - 1.0
    plain = torch.full((numel,), 1.0, dtype=BF16)
    for _ in range(100):
        plain += torch.tensor(update).to(BF16)
    expected = 100 * update
    assert abs(plain.float().mean().item() - 1.0 - expected) > 0.25 * expected  # lost
    assert abs(moved - expected) < max(2.0**-7, 0.02 * expected), (moved, expected)


def test_the_warm_up_steps_are_fp32_adamws_bit_for_bit():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 64).to(BF16))
    ref = nn.Parameter(w.detach().float().clone())
    opt = amprewrite.optimizer([w], torch.optim.AdamW, lr=1e-3, weight_decay=0.1, warmup=5)
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1, foreach=False)
    for _ in range(4):
        g = torch.randn(64, 64).to(BF16)
        w.grad, ref.grad = g, g.float()
        opt.step()
        ref_opt.step()
    assert torch.equal(opt.state[w]["master"], ref)
    assert torch.equal(w, ref.to(BF16))


def test_re_decides_when_the_updates_shrink():
    """A learning rate cut 100x (a scheduler's decay) turns 4-ulp updates into 0.04-ulp ones:
    the next check moves the weight from low to a compensation, and says when and why."""
    w, opt = _sgd_run(1.0, 4 * 2.0**-7, 16384, steps=4, warmup=4, check_every=5)
    key = "param 0"
    assert opt.decisions[key].storage == O.LOW
    opt.param_groups[0]["lr"] /= 100
    before = opt._materialise(w, opt.state[w]).clone()
    for _ in range(16):
        w.grad = torch.full_like(w, -1.0)
        opt.step()
    d = opt.decisions[key]
    assert d.storage == O.KAHAN and d.step == 5, d
    assert d.reason.startswith("re-decided at step 5 (was low)")
    # step 5 rounded its update away; from step 6 on nothing is lost: 15 steps of 0.04 ulp
    moved = (opt._materialise(w, opt.state[w]) - before).mean().item()
    assert abs(moved - 15 * 4 * 2.0**-7 / 100) < 0.02 * 2.0**-7


def test_states_are_bf16_and_a_settled_second_moment_is_rounded_stochastically():
    """AdamW's second moment moves by (1 - beta2) (g^2 - v): 0.01% of itself once the
    gradients have settled at 10% noise, far below half a bf16 ulp (0.2%), so round-to-nearest
    would freeze it. The moments are set to a settled run's (step 10^4) after the first step."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(128, 128).to(BF16))
    opt = amprewrite.optimizer([w], torch.optim.AdamW, lr=1e-3, warmup=6)
    g0 = torch.randn(128, 128)
    for step in range(6):
        w.grad = (g0 * (1 + 0.1 * torch.randn(128, 128))).to(BF16)
        opt.step()
        if step == 0:
            inner = opt.state[w]["inner"]
            inner["exp_avg_sq"], inner["exp_avg"] = g0.square(), g0.clone()
            inner["step"].fill_(1e4)
    assert opt.decisions["param 0:exp_avg_sq"].storage == O.SR
    assert opt.state[w]["inner"]["exp_avg_sq"].dtype == BF16
    assert opt.state[w]["inner"]["exp_avg"].dtype == BF16
    v = opt.state[w]["inner"]["exp_avg_sq"].float()
    w.grad = g0.to(BF16)
    opt.step()  # g^2 - v is 0.1% of v at most here: rounded to nearest, v would not move
    assert not torch.equal(opt.state[w]["inner"]["exp_avg_sq"].float(), v)


@pytest.mark.parametrize("optimizer_class, kw, states", [
    (torch.optim.AdamW, {"lr": 1e-3}, {"exp_avg", "exp_avg_sq"}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, {"momentum_buffer"}),
])
def test_any_torch_optimizer_steps_as_in_fp32(optimizer_class, kw, states):
    """The graph of an MLP with params='low', 40 steps on a fixed regression task: the loss
    follows an fp32 run of the same optimizer to within 3% (measured 0.1-2.4%: bf16 weights
    in the forward), closer than ``model.to(bf16)`` with the same optimizer, and every state
    of the wrapped class is stored and decided."""
    model = _mlp()
    gm = _low_graph(model)
    opt = amprewrite.optimizer(gm, optimizer_class, warmup=5, **kw)
    runs = {"amprewrite": (gm, opt)}
    for name, dtype in (("fp32", torch.float32), ("naive", BF16)):
        other = copy.deepcopy(model).train().to(dtype)
        runs[name] = (other, optimizer_class(other.parameters(), **kw))
    torch.manual_seed(1)
    x, y = torch.randn(64, 96), torch.randn(64, 8)
    final = {}
    for name, (net, o) in runs.items():
        for _ in range(40):
            loss = (net(x.to(BF16) if name == "naive" else x).float() - y).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
        final[name] = loss.item()
    gap = abs(final["amprewrite"] - final["fp32"])
    assert gap < 0.03 * final["fp32"] and gap < abs(final["naive"] - final["fp32"]), final
    low = [n for n, p in gm.named_parameters() if p.dtype == BF16]
    assert low == ["0.weight", "0.bias", "3.weight", "3.bias"]
    decided = {d.tensor for d in opt.decisions.values() if d.param in low}
    assert decided == {"weight", *states}


# ------------------------------------------------------------------ the graph and the model
def test_params_low_trains_the_graph_and_never_the_callers_model():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    gm = _low_graph(model)
    ours = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    assert not ours & ({id(p) for p in gm.parameters()} | {id(b) for b in gm.buffers()})
    assert {n: p.dtype for n, p in gm.named_parameters()} == {
        "0.weight": BF16, "0.bias": BF16, "1.weight": torch.float32, "1.bias": torch.float32,
        "3.weight": BF16, "3.bias": BF16}
    opt = amprewrite.optimizer(gm, torch.optim.AdamW, lr=1e-2, warmup=2)
    for _ in range(3):
        gm(torch.randn(8, 96)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not torch.equal(gm.get_parameter("1.weight"), before["1.weight"])  # trained
    assert not torch.equal(gm.get_parameter("0.weight").float(), before["0.weight"])


def test_bytes_of_the_training_state_per_parameter():
    """AdamW on 2 bf16 weights of 16384 elements: 16 bytes a parameter in the warm-up (bf16
    weight and gradient, fp32 master and moments); 8 after it (bf16 weight, gradient and
    moments; these updates need no master)."""
    ws = [nn.Parameter((torch.randn(128, 128) * 0.05).to(BF16)) for _ in range(2)]
    opt = amprewrite.optimizer(ws, torch.optim.AdamW, lr=1e-2, warmup=3)
    for step in range(4):
        for w in ws:
            w.grad = torch.randn_like(w)
        opt.step()
        if step == 1:
            during = opt.state_bytes()
    assert during["total"] / during["params"] == 2 + 2 + 4 + 8
    after = opt.state_bytes()
    assert after == {"weights": 65536, "grads": 65536, "states": 131072, "masters": 0,
                     "compensations": 0, "total": 262144, "params": 32768}


# ---------------------------------------------------------------- scaling, clipping, steps
def test_grad_scaler_unscales_in_fp32_and_skips_a_step_that_overflowed():
    """Gradients of 1e-6 (fp16 subnormals unscaled) arrive scaled by 2^12 in fp16 and are
    unscaled in fp32 inside the step: the warm-up step equals fp32 AdamW's on those unscaled
    values bit for bit. A step whose gradients are inf changes nothing and halves the scale."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 64).to(FP16))
    ref = nn.Parameter(w.detach().float().clone())
    opt = amprewrite.optimizer([w], torch.optim.AdamW, lr=1e-3, warmup=5)
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, foreach=False)
    scaler = amprewrite.GradScaler("cpu", init_scale=2.0**12)
    g = torch.randn(64, 64) * 1e-6
    scaler.scale((w.float() * g).sum()).backward()
    scaler.step(opt)
    scaler.update()
    ref.grad = w.grad.float() * 2.0**-12
    ref_opt.step()
    assert torch.equal(opt.state[w]["master"], ref)
    opt.zero_grad()
    scaler.scale((w.float() * math.inf).sum()).backward()
    kept = opt.state[w]["master"].clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(opt.state[w]["master"], kept) and scaler.get_scale() == 2.0**11
    assert opt.steps == 1 and scaler.overflows == 1


def test_unscale_then_clip_with_fp16_gradients():
    """torch's GradScaler refuses to unscale fp16 gradients; amprewrite's unscales them for its
    optimizer, so the usual unscale_ / clip_grad_norm_ / step recipe works."""
    w = nn.Parameter(torch.randn(32, 32).to(FP16))
    opt = amprewrite.optimizer([w], torch.optim.SGD, lr=0.1, warmup=2)
    scaler = amprewrite.GradScaler("cpu", init_scale=256.0)
    scaler.scale((w.float() * 3.0).sum()).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_([w], 1.0)
    assert norm.item() == pytest.approx(3.0 * 32, rel=1e-3)
    before = w.detach().float().clone()
    scaler.step(opt)
    scaler.update()
    assert (opt.state[w]["master"] - before).norm().item() == pytest.approx(0.1, rel=1e-3)


def test_clip_grad_norm_in_fp32_under_a_scaler():
    w = nn.Parameter(torch.zeros(16, 16, dtype=FP16))
    opt = amprewrite.optimizer([w], torch.optim.SGD, lr=1.0, warmup=2)
    scaler = amprewrite.GradScaler("cpu", init_scale=64.0)
    scaler.scale((w.float() * 2.0).sum()).backward()
    scaled = opt.clip_grad_norm_(0.5)
    assert scaled.item() == pytest.approx(2.0 * 64 * 16)
    scaler.step(opt)
    assert opt.state[w]["master"].norm().item() == pytest.approx(0.5, rel=1e-4)


def test_gradient_accumulation_matches_one_large_batch():
    model = _mlp()
    one, two = _low_graph(copy.deepcopy(model)), _low_graph(copy.deepcopy(model))
    opt1 = amprewrite.optimizer(one, torch.optim.AdamW, lr=1e-3, warmup=2)
    opt2 = amprewrite.optimizer(two, torch.optim.AdamW, lr=1e-3, warmup=2)
    torch.manual_seed(2)
    x, y = torch.randn(32, 96), torch.randn(32, 8)
    (one(x) - y).pow(2).mean().backward()
    for half in (slice(0, 16), slice(16, 32)):
        ((two(x[half]) - y[half]).pow(2).mean() / 2).backward()
    opt1.step()
    opt2.step()
    for (n, a), b in zip(opt1.state.items(), opt2.state.values()):
        # gradients summed in bf16 over two halves: within a few bf16 roundings of one batch's
        torch.testing.assert_close(opt1._materialise(n, a), opt2._materialise(n, b),
                                   atol=1e-3 * 1.0001, rtol=0)


# --------------------------------------------------------------------------- checkpoints
def _tiny_llama():
    from amprewrite.testing import zoo

    return zoo.llama_lm(vocab=128, hidden=96, intermediate=192, layers=1, positions=64)


def _batches(n: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (2, 24), generator=g) for _ in range(n)]


def _fresh(model):
    ids = torch.zeros(2, 24, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.transform(copy.deepcopy(model), "bf16",
                                  example_inputs={"input_ids": ids, "labels": ids},
                                  params="low", verify=False)
    return gm, amprewrite.optimizer(gm, torch.optim.AdamW, lr=3e-3, weight_decay=0.1,
                                    warmup=2, check_every=3)


def _train(gm, opt, batches):
    losses = []
    for ids in batches:
        loss = gm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_resumed_run_gives_the_uninterrupted_runs_losses_and_the_checkpoint_loads_in_fp32():
    model = _tiny_llama()
    batches = _batches(8)
    gm, opt = _fresh(model)
    straight = _train(gm, opt, batches)
    assert any(d.storage == O.SR for d in opt.decisions.values())  # generators in play

    gm, opt = _fresh(model)
    first = _train(gm, opt, batches[:4])
    buf = io.BytesIO()
    torch.save({"model": gm.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    gm, opt = _fresh(model)
    gm.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    assert first + _train(gm, opt, batches[4:]) == straight

    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    plain = copy.deepcopy(model)  # train mode, as the graph was captured (LLaMA has no dropout)
    plain.load_state_dict(gm.state_dict())  # bf16 values into the fp32 model
    ids = batches[0]
    torch.testing.assert_close(plain(ids).logits, gm(input_ids=ids, labels=ids).logits,
                               atol=0.05, rtol=0.05)


def test_the_report_gives_each_choice_its_reason():
    gm = _low_graph(_mlp())
    opt = amprewrite.optimizer(gm, torch.optim.AdamW, lr=1e-4, warmup=2)
    for _ in range(2):
        gm(torch.randn(8, 96)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    text = str(amprewrite.report(gm))
    assert "training state (amprewrite.optimizer):" in text
    assert "1.weight: fp32 (float32, step 1) — the plan reads it in fp32" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("0.weight: "))
    assert "updates ~" in line and "ulp" in line and "step 2" in line
    assert "bytes a parameter" in opt.report()


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("args", "kw", "match"), [
    ((torch.optim.AdamW(nn.Linear(2, 2).parameters()),), {}, "must be a torch.optim.Optimizer "
                                                            "class"),
    ((torch.optim.AdamW,), {"learning_rate": 1e-3}, r"AdamW refused the hyperparameters "
                                                    r"\['learning_rate'\].*lr"),
    ((torch.optim.AdamW,), {"warmup": 0}, "warmup must be a positive int"),
])
def test_bad_arguments_are_one_clear_error(args, kw, match):
    with pytest.raises(PolicyError, match=match):
        amprewrite.optimizer(nn.Linear(2, 2), *args, **kw)


def test_a_state_from_other_parameters_is_refused():
    opt = amprewrite.optimizer(nn.Linear(2, 2), torch.optim.AdamW)
    other = amprewrite.optimizer(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
                                 torch.optim.AdamW)
    with pytest.raises(PolicyError, match="same parameters"):
        opt.load_state_dict(other.state_dict())


class _Tied(nn.Module):
    """An embedding whose table is also the head's weight (GPT-2, T5, tied LLaMAs)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm = nn.Embedding(50, 16), nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


@pytest.mark.parametrize("capture", ["symbolic_trace", "dynamo"])
def test_a_tied_weight_is_one_low_parameter_under_both_names(capture):
    model = _Tied().train()
    ids = torch.randint(0, 50, (4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.transform(model, "bf16", params="low", verify=False,
                                  **({"example_inputs": (ids,)} if capture == "dynamo" else {}))
    assert gm.get_parameter("head.weight") is gm.get_parameter("emb.weight")
    assert gm.get_parameter("emb.weight").dtype == BF16
    opt = amprewrite.optimizer(gm, torch.optim.AdamW, lr=1e-2, warmup=2)
    for _ in range(3):
        nn.functional.cross_entropy(gm(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    plain = _Tied()
    plain.load_state_dict(gm.state_dict())
    assert torch.equal(plain.head.weight, gm.get_parameter("emb.weight").float())
    assert not torch.equal(plain.head.weight, model.head.weight)  # trained, in both names
