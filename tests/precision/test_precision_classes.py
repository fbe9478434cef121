"""Every FP32 and LOW op family earns its class: a test fails when the class is flipped.

For each FP32 family (DESIGN.md, "Precision classes"), a tiny model feeds the op the output of
a LOW op (a 1x1 identity Linear: the op's inputs are ``dtype`` tensors whose values are exact,
so the error measured is the op's own) on an input where computing the op in ``dtype`` is
measurably worse: fp16 overflow (``exp(12)``, ``x * x`` above 256, sums above 65504),
cancellation after the op (``exp(x) - 1``, ``log(x) - log(y)``, ``1 - softmax``, ``1 - cos``),
large means and large sums. The transformed model's relative error against float64 must be at
most :data:`BOUND`; the same model with the family flipped to PROMOTE (computed in its inputs'
precision, as autocast runs an op it does not list) must exceed ``10 * BOUND`` on the same
input, which the test checks too, so each case demonstrably tells the two classes apart.

For each LOW family, the op must be planned in ``dtype`` and its error at most autocast's (or,
where autocast computes it in fp32, an all-``dtype`` run's) x 1.1 + :data:`SLACK`.

The few FP32 families where no input can tell the classes apart on CPU (no low-precision kernel,
so the kernel probe makes them fp32 anyway; complex values; functions capture traces through)
carry their reason as ``why=`` in ``amprewrite/precision/ops.py``, and the test checks it is there
and that the flip indeed changes nothing.

``python -m benchmarks mutants`` flips each family in turn and runs this file (docs/testing.md,
"Mutation testing of the precision classes").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amprewrite
from amprewrite.precision.ops import FAMILIES, Precision, override_families
from amprewrite.show.numerics import rel_err

LOW_DTYPES = [torch.bfloat16, torch.float16]
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# amprewrite's relative error bound on the FP32 cases: the op computed in fp32 from exact
# inputs, rounded once to fp32 (measured at most 8e-6, on the cancellation cases); the op in
# bf16 or fp16 rounds its result to 2^-9 or 2^-12, or overflows.
BOUND = 1e-5
# LOW cases: absolute slack on top of 1.1x the reference error (a tenth of fp16's roundoff).
SLACK = 5e-5


# --- inputs -----------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def uniform(shape: tuple[int, ...], lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    return torch.rand(shape, generator=_gen(seed)) * (hi - lo) + lo


def normal(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed))


def signs(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=_gen(seed)).float() * 2 - 1


def classes(shape: tuple[int, ...], n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, n, shape, generator=_gen(seed))


# --- the model: float inputs through a LOW op, integer inputs as buffers -----------------------


class Exact(nn.Module):
    """``fn`` of the inputs, each float input first through a 1x1 identity Linear (a LOW op that
    returns the same values in the low dtype); integer inputs are buffers, so their dtype is
    known when tracing."""

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor]):
        super().__init__()
        self.fn = fn
        self.low = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.low.weight.fill_(1.0)
        self.kinds = [x.is_floating_point() for x in inputs]
        for i, x in enumerate(inputs):
            if not x.is_floating_point():
                self.register_buffer(f"int{i}", x)

    def _call(self, *floats: torch.Tensor) -> torch.Tensor:
        it = iter(floats)
        args = [self.low(next(it).unsqueeze(-1)).squeeze(-1) if is_float
                else getattr(self, f"int{i}") for i, is_float in enumerate(self.kinds)]
        return self.fn(*args)


class Exact1(Exact):
    def forward(self, a):
        return self._call(a)


class Exact2(Exact):
    def forward(self, a, b):
        return self._call(a, b)


class Exact3(Exact):
    def forward(self, a, b, c):
        return self._call(a, b, c)


_BY_ARITY = {1: Exact1, 2: Exact2, 3: Exact3}  # by number of float inputs


def per_row(loss: Callable[..., torch.Tensor], rows: int = 4) -> Callable[..., torch.Tensor]:
    """``loss(...)`` of each of the first ``rows`` slices, stacked: several roundings of a sum
    rather than one (a single bf16 rounding can land close to the exact value by chance)."""
    return lambda *xs: torch.stack([loss(*(x[i] for x in xs)) for i in range(rows)])


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    fn: Callable[..., torch.Tensor]
    inputs: Callable[[], list[torch.Tensor]]
    what: str  # why the op in low precision is worse on this input
    example: bool = False  # transform with example_inputs (dynamo): the probe sees real shapes
    xfail: str = ""  # a known gap: the flip is not observable yet (strict: fixing it fails)

    def id(self) -> str:
        return self.family

    def param(self) -> object:
        marks = [pytest.mark.xfail(strict=True, reason=self.xfail)] if self.xfail else []
        return pytest.param(self, id=self.family, marks=marks)


def _sum(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return per_row(lambda *xs: loss(*xs, reduction="sum"))


# Large sums: every per-row total below is above fp16's 65504.
FP32_CASES = [
    Case("batch_norm", lambda x: F.batch_norm(x, None, None, training=True),
         lambda: [1000 + 30 * normal((64, 4, 16))], "statistics of values with a large mean"),
    Case("instance_norm", lambda x: F.instance_norm(x),
         lambda: [1000 + 30 * normal((4, 4, 256))], "statistics of values with a large mean"),
    Case("group_norm", lambda x: F.group_norm(x, 2),
         lambda: [1000 + 30 * normal((4, 4, 256))], "statistics of values with a large mean"),
    Case("layer_norm", lambda x: F.layer_norm(x, (256,)),
         lambda: [1000 + 30 * normal((16, 256))], "statistics of values with a large mean"),
    Case("rms_norm", lambda x: F.rms_norm(x, (256,)),
         lambda: [300 + 30 * normal((16, 256))], "mean of squares above 65504"),
    Case("normalize", lambda x: F.normalize(x, dim=-1),
         lambda: [300 + 30 * normal((16, 256))], "sum of squares above 65504"),
    Case("softmax", lambda x: 1 - F.softmax(x, -1).amax(-1),
         lambda: [torch.cat([6 + uniform((64, 1), 0, 2), normal((64, 31))], -1)],
         "1 - p of a confident prediction: cancellation"),
    Case("log_softmax", lambda x: F.log_softmax(x, -1),
         lambda: [20 * normal((64, 32))], "large logits"),
    Case("softmin", lambda x: 1 - F.softmin(x, -1).amax(-1),
         lambda: [-torch.cat([6 + uniform((64, 1), 0, 2), normal((64, 31))], -1)],
         "1 - p of a confident prediction: cancellation"),
    Case("exp", lambda x: torch.exp(x) - 1,
         lambda: [uniform((256,), 0.002, 0.02)], "exp(x) - 1 near 0: cancellation"),
    Case("expm1", torch.expm1, lambda: [uniform((256,), 8, 14)], "fp16 overflow above 11.1"),
    Case("log", lambda x, y: torch.log(x) - torch.log(y),
         lambda: [uniform((256,), 200, 250, 1), uniform((256,), 200, 250, 2)],
         "log ratio: cancellation"),
    Case("log1p", lambda x, y: torch.log1p(x) - torch.log1p(y),
         lambda: [uniform((256,), 200, 250, 1), uniform((256,), 200, 250, 2)],
         "log ratio: cancellation"),
    Case("pow", lambda x, y: x * x - y * y,
         lambda: [uniform((256,), 280, 300, 1), uniform((256,), 280, 300, 2)],
         "x * x above 65504 in fp16; difference of squares"),
    Case("reciprocal", lambda x, y: x.reciprocal() - y.reciprocal(),
         lambda: [uniform((256,), 3, 3.5, 1), uniform((256,), 3, 3.5, 2)],
         "difference of reciprocals: cancellation"),
    Case("rsqrt", lambda x, y: x.rsqrt() - y.rsqrt(),
         lambda: [uniform((256,), 3, 3.5, 1), uniform((256,), 3, 3.5, 2)],
         "difference of rsqrt: cancellation"),
    Case("softplus", lambda x: F.softplus(x) - x,
         lambda: [uniform((256,), 3, 8)], "softplus(x) - x = log1p(exp(-x)): cancellation"),
    Case("trig", lambda x: 1 - torch.cos(x),
         lambda: [uniform((256,), 0.05, 0.2)], "1 - cos(x) near 0: cancellation"),
    Case("special", lambda x, y: torch.lgamma(x) - torch.lgamma(y),
         lambda: [uniform((256,), 90, 100, 1), uniform((256,), 90, 100, 2)],
         "lgamma ratio: cancellation"),
    Case("sum", lambda x: x.sum(-1), lambda: [torch.ones(4, 100_000)],
         "sum of 1e5 ones: above 65504, and bf16 spacing 512 there"),
    Case("prod", lambda x: x.prod(-1), lambda: [uniform((16, 32), 1, 2)],
         "product above 65504"),
    Case("cumsum", lambda x: x.cumsum(-1), lambda: [torch.ones(4, 100_000)],
         "running sum of 1e5 ones"),
    Case("mean", lambda x: x - x.mean(-1, keepdim=True),
         lambda: [1000 + 30 * normal((16, 256))], "centering values with a large mean"),
    Case("var", lambda x: x.var(-1), lambda: [1000 + 30 * normal((16, 256))],
         "variance of values with a large mean"),
    Case("logsumexp", lambda x: torch.logsumexp(x, -1) - x.amax(-1),
         lambda: [4 + uniform((64, 8), 0, 1)], "logsumexp - max: cancellation"),
    Case("norm", lambda x: torch.linalg.vector_norm(x, dim=-1),
         lambda: [300 + 30 * normal((16, 256))], "sum of squares above 65504"),
    Case("angle", torch.angle, lambda: [-uniform((64,), 1, 2)], "pi rounded to the low dtype"),
    Case("sampling", lambda t: F.affine_grid(t, [2, 1, 16, 16], align_corners=False),
         lambda: [torch.tensor([[[0.9, 0.1, 0.05], [-0.1, 0.9, 0.02]]] * 2)],
         "sampling coordinates (positions) rounded to the low dtype", example=True),
    # Losses (autocast computes most in fp32 too): per-row sums above 65504.
    Case("binary_cross_entropy", lambda p, t: F.binary_cross_entropy(p, t, reduction="sum"),
         lambda: [uniform((100_000,), 0.05, 0.95, 1), uniform((100_000,), 0, 1, 2).round()],
         "large sum"),
    Case("binary_cross_entropy_with_logits", _sum(F.binary_cross_entropy_with_logits),
         lambda: [4 * normal((4, 50_000), 1), uniform((4, 50_000), 0, 1, 2).round()],
         "large sum"),
    Case("cross_entropy", _sum(F.cross_entropy),
         lambda: [4 * normal((4, 20_000, 8), 1), F.softmax(normal((4, 20_000, 8), 2), -1)],
         "large sum (probability targets)"),
    Case("linear_cross_entropy",
         lambda x, w, t: F.linear_cross_entropy(x, w, t, reduction="sum"),
         lambda: [4 * normal((20_000, 8), 1), normal((8, 8), 2), classes((20_000,), 8, 3)],
         "large sum"),
    Case("nll_loss", lambda x, t: F.nll_loss(x, t, reduction="sum"),
         lambda: [-uniform((20_000, 8), 1, 10, 1), classes((20_000,), 8, 2)], "large sum"),
    Case("mse_loss", _sum(F.mse_loss),
         lambda: [4 * normal((4, 20_000), 1), 4 * normal((4, 20_000), 2)], "large sum"),
    Case("l1_loss", _sum(F.l1_loss),
         lambda: [4 * normal((4, 20_000), 1), 4 * normal((4, 20_000), 2)], "large sum"),
    Case("smooth_l1_loss", _sum(F.smooth_l1_loss),
         lambda: [4 * normal((4, 20_000), 1), 4 * normal((4, 20_000), 2)], "large sum"),
    Case("huber_loss", _sum(F.huber_loss),
         lambda: [4 * normal((4, 20_000), 1), 4 * normal((4, 20_000), 2)], "large sum"),
    Case("kl_div", _sum(F.kl_div),
         lambda: [-uniform((4, 50_000), 1, 5, 1), uniform((4, 50_000), 0.5, 1, 2)],
         "large sum"),
    Case("poisson_nll_loss", _sum(F.poisson_nll_loss),
         lambda: [uniform((4, 50_000), 0, 3, 1), uniform((4, 50_000), 0, 3, 2).round()],
         "large sum"),
    Case("gaussian_nll_loss", _sum(F.gaussian_nll_loss),
         lambda: [4 * normal((4, 50_000), 1), 4 * normal((4, 50_000), 2),
                  uniform((4, 50_000), 0.5, 1, 3)], "large sum"),
    Case("cosine_embedding_loss",
         lambda a, b, t: F.cosine_embedding_loss(a, b, t, reduction="sum"),
         lambda: [normal((200_000, 4), 1), normal((200_000, 4), 2), signs((200_000,), 3)],
         "large sum"),
    Case("hinge_embedding_loss", _sum(F.hinge_embedding_loss),
         lambda: [uniform((4, 50_000), 0, 8, 1), signs((4, 50_000), 3)], "large sum"),
    Case("margin_ranking_loss", _sum(F.margin_ranking_loss),
         lambda: [4 * normal((4, 50_000), 1), 4 * normal((4, 50_000), 2), signs((4, 50_000), 3)],
         "large sum"),
    Case("multilabel_soft_margin_loss", _sum(F.multilabel_soft_margin_loss),
         lambda: [20 * normal((4, 20_000, 8), 1), uniform((4, 20_000, 8), 0, 1, 2).round()],
         "large sum"),
    Case("soft_margin_loss", lambda x, t: F.soft_margin_loss(x, t, reduction="sum"),
         lambda: [4 * normal((100_000,), 1), signs((100_000,), 3)], "large sum"),
    Case("triplet_margin_loss", _sum(F.triplet_margin_loss),
         lambda: [4 * normal((4, 20_000, 4), 1), 4 * normal((4, 20_000, 4), 2),
                  4 * normal((4, 20_000, 4), 3)], "large sum"),
    Case("triplet_margin_with_distance_loss", _sum(F.triplet_margin_with_distance_loss),
         lambda: [4 * normal((4, 20_000, 4), 1), 4 * normal((4, 20_000, 4), 2),
                  4 * normal((4, 20_000, 4), 3)], "large sum"),
]

# FP32 families where no input tells the classes apart on CPU: each has a ``why=`` in ops.py,
# and flipping it changes nothing (the model shows that; a new low kernel would make it fail).
WHY_ONLY = [
    Case("local_response_norm", lambda x: F.local_response_norm(x, 2),
         lambda: [normal((2, 8, 16))], "no low-precision avg_pool3d kernel on CPU"),
    Case("quantile", lambda x: torch.quantile(x, 0.3, dim=-1), lambda: [normal((8, 64))],
         "no low-precision kernel"),
    Case("linalg", torch.linalg.inv, lambda: [normal((4, 4)) + 4 * torch.eye(4)],
         "no low-precision kernel"),
    Case("linalg_tuple", lambda x: torch.linalg.slogdet(x)[1],
         lambda: [normal((4, 4)) + 4 * torch.eye(4)], "no low-precision kernel"),
    Case("fft", lambda x: torch.fft.rfft(x).abs(), lambda: [normal((4, 64))],
         "complex output: its inputs keep the model's dtype"),
    Case("ifft_real", lambda x: torch.fft.irfft(torch.fft.rfft(x)), lambda: [normal((4, 64))],
         "complex input"),
    Case("complex", lambda x: torch.view_as_complex(x).abs(), lambda: [normal((4, 64, 2))],
         "complex output"),
    Case("multi_margin_loss", lambda x, t: F.multi_margin_loss(x, t),
         lambda: [normal((64, 8)), classes((64,), 8)], "no low-precision kernel"),
    Case("multilabel_margin_loss", lambda x, t: F.multilabel_margin_loss(x, t),
         lambda: [normal((64, 8)), torch.randint(-1, 8, (64, 8), generator=_gen(3))],
         "no low-precision kernel"),
    Case("ctc_loss", lambda lp, t, il, tl: F.ctc_loss(lp, t, il, tl),
         lambda: [F.log_softmax(normal((50, 16, 6)), -1), classes((16, 10), 5) + 1,
                  torch.full((16,), 50), torch.full((16,), 10)], "no low-precision kernel"),
]


# --- helpers ----------------------------------------------------------------------------------


@contextlib.contextmanager
def flipped(family: str, to: Precision) -> Iterator[None]:
    """The registry with ``family`` in class ``to`` (restored afterwards)."""
    with override_families(**{family: to}):
        yield


def _model_and_inputs(case: Case, dtype: torch.dtype) -> tuple[Exact, list[torch.Tensor]]:
    # Float inputs rounded to ``dtype`` first: the LOW identity then passes them on exactly.
    xs = [x.to(dtype).float() if x.is_floating_point() else x for x in case.inputs()]
    model = _BY_ARITY[sum(x.is_floating_point() for x in xs)](case.fn, xs)
    return model, [x for x in xs if x.is_floating_point()]


def _transform(model: nn.Module, dtype: torch.dtype, xs: list[torch.Tensor] | None = None
               ) -> torch.fx.GraphModule:
    return amprewrite.transform(model, dtype=dtype, verify=False,
                                example_inputs=tuple(xs) if xs is not None else None)


@torch.no_grad()
def _errors(case: Case, dtype: torch.dtype) -> dict[str, float]:
    model, xs = _model_and_inputs(case, dtype)
    ref = copy.deepcopy(model).double()(*(x.double() for x in xs))
    example = xs if case.example else None
    out = {"amprewrite": rel_err(_transform(model, dtype, example)(*xs), ref)}
    with torch.autocast("cpu", dtype=dtype):
        out["autocast"] = rel_err(model(*xs), ref)
    with flipped(case.family, Precision.PROMOTE):
        out["flipped"] = rel_err(_transform(model, dtype, example)(*xs), ref)
    return out


# --- FP32 families ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("case", [c.param() for c in FP32_CASES])
def test_fp32_family_beats_its_flipped_class(case, dtype):
    err = _errors(case, dtype)
    # The input shows the risk: the op computed in its inputs' precision is clearly worse.
    assert err["flipped"] > 10 * BOUND, (case.what, err)
    assert err["amprewrite"] <= BOUND, (case.what, err)
    assert err["amprewrite"] <= 1.1 * err["autocast"] + 1e-6, (case.what, err)


@pytest.mark.parametrize("case", [c.param() for c in WHY_ONLY])
def test_fp32_family_without_a_telling_input_says_why(case):
    assert FAMILIES[case.family].why, f"{case.family}: FP32 without a test needs why= in ops.py"
    model, xs = _model_and_inputs(case, torch.bfloat16)
    with torch.no_grad():
        out = amprewrite.transform(model, dtype=torch.bfloat16, verify=False)(*xs)
        with flipped(case.family, Precision.PROMOTE):
            out_flipped = amprewrite.transform(model, dtype=torch.bfloat16, verify=False)(*xs)
    # Nothing observable changes (the reason is exactly that); a new low kernel would fail here.
    assert torch.equal(out, out_flipped), case.what


# --- LOW families -----------------------------------------------------------------------------


class LowOp(nn.Module):
    def __init__(self, family: str):
        super().__init__()
        self.family = family
        torch.manual_seed(0)
        self.linear = nn.Linear(64, 64)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.conv_t = nn.ConvTranspose2d(4, 8, 3)
        self.w = nn.Parameter(torch.randn(64, 32) / 8)
        self.bw = nn.Parameter(torch.randn(8, 16, 16) / 16)
        self.w_ih = nn.Parameter(torch.randn(96, 64) / 8)
        self.w_hh = nn.Parameter(torch.randn(96, 32) / 8)

    def forward(self, x):
        f = self.family
        if f == "linear":
            return self.linear(x)
        if f == "bilinear":
            return F.bilinear(x[:, :16], x[:, 16:32], self.bw)
        if f == "conv":
            return self.conv(x.reshape(4, 4, 8, 8))
        if f == "conv_transpose":
            return self.conv_t(x.reshape(4, 4, 8, 8))
        if f == "matmul":
            return x @ self.w
        if f == "rnn_cell":
            return torch.gru_cell(x, x[:, :32], self.w_ih, self.w_hh)
        if f == "scaled_dot_product_attention":
            q = x.reshape(2, 2, 16, 16)
            return F.scaled_dot_product_attention(q, q.flip(-1), q * 0.5)
        if f == "flex_attention":
            from torch.nn.attention.flex_attention import flex_attention

            q = x.reshape(2, 2, 16, 16)
            return flex_attention(q, q.flip(-1), q * 0.5)
        raise AssertionError(f)


LOW_CASES = ["linear", "bilinear", "conv", "conv_transpose", "matmul", "rnn_cell",
             "scaled_dot_product_attention", "flex_attention"]


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("family", LOW_CASES)
@torch.no_grad()
def test_low_family_is_planned_low_and_accurate(family, dtype):
    model = LowOp(family)
    x = normal((16, 64), 5)
    # With example inputs: the kernel probe runs gru_cell on its real shapes (guessed ones
    # do not fit its weights, which would make it an fp32 island); flex_attention is a
    # higher-order op only dynamo captures.
    gm = _transform(model, dtype, [x] if family in ("rnn_cell", "flex_attention") else None)
    planned = [(d.precision, d.dtype) for d in amprewrite.report(gm).decisions
               if d.family == family]
    assert planned and all(p == ("low", str(dtype)) for p in planned), planned
    ref = copy.deepcopy(model).double()(x.double())
    err = rel_err(gm(x), ref)
    with torch.autocast("cpu", dtype=dtype):
        err_autocast = rel_err(model(x), ref)
    err_all_low = rel_err(copy.deepcopy(model).to(dtype)(x.to(dtype)), ref)
    # Where autocast computes the op in fp32 (bilinear, rnn cells on CPU), compare with an
    # all-``dtype`` run instead.
    assert err <= 1.1 * max(err_autocast, err_all_low) + SLACK, (err, err_autocast, err_all_low)


# --- the registry: every FP32 and LOW family is covered ----------------------------------------


def test_every_fp32_and_low_family_has_a_case():
    covered = {c.family for c in FP32_CASES + WHY_ONLY} | set(LOW_CASES)
    # ``recompute``: the call recompute_islands writes into finished graphs; transforming such a
    # graph again inlines its body first, so no pass ever paints it
    # (tests/passes/test_recompute_islands.py::test_transforming_again_inlines_the_regions).
    covered.add("recompute")
    missing = sorted(n for n, f in FAMILIES.items()
                     if f.precision in (Precision.FP32, Precision.LOW) and n not in covered)
    assert not missing, (f"families without a case in tests/precision/test_precision_classes.py: "
                         f"{missing}: add an input where the op in low precision is worse "
                         "(FP32_CASES), a LOW case, or a why= and a WHY_ONLY entry")
    assert not covered - set(FAMILIES), covered - set(FAMILIES)


# --- the policy's intent, against fixed expectations --------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8 * 8 * 8, 32)
        self.ln = nn.LayerNorm(32)
        self.w = nn.Parameter(torch.randn(32, 32))

    def forward(self, x, y):
        h = torch.relu(self.gn(self.bn(self.conv(x))))
        h = self.ln(F.gelu(self.fc(h.flatten(1))))
        att = torch.softmax(h @ self.w, -1)
        loss = F.mse_loss(att, y) + F.cross_entropy(att, y.softmax(-1))
        return att.exp().sum(-1) + torch.log(att + 1).mean() + loss


INTENT = {"conv": "low", "batch_norm": "fp32", "group_norm": "fp32", "relu": "neutral",
          "linear": "low", "activation": "promote", "layer_norm": "fp32", "matmul": "low",
          "softmax": "fp32", "mse_loss": "fp32", "cross_entropy": "fp32", "exp": "fp32",
          "sum": "fp32", "log": "fp32", "mean": "fp32"}


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_classes_are_the_policys_intent(dtype):
    gm = amprewrite.transform(Net(), dtype=dtype, verify=False)
    planned: dict[str, set[str]] = {}
    for d in amprewrite.report(gm).decisions:
        if d.family in INTENT:
            planned.setdefault(d.family, set()).add(d.precision)
    assert planned == {f: {p} for f, p in INTENT.items()}
