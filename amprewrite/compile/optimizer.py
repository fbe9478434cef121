"""``amprewrite.optimizer``: any torch optimizer, with each tensor of the training state stored
in the cheapest dtype that loses none of its updates.

``transform(model, dtype, params="low")`` in train mode stores the weights that only
low-precision ops read (matmul, conv, embedding tables) as low-precision Parameters: half the
bytes, no cast in each forward, low gradients. Updating them in place in the low dtype is what
goes wrong by hand: an update smaller than half a unit in the last place (ulp) of its weight is
rounded away (a norm weight at 1.0 holds bf16 steps of 2^-7 = 7.8e-3; AdamW at lr 1e-4 moves it
1e-4 a step, so it never moves), and a second moment updated by ``beta2 = 0.999`` in bf16 never
changes once the gradient settles. So the optimizer measures before it decides:

- **Warm-up** (``warmup`` steps, 10 by default): every low weight keeps an fp32 master and
  every state is fp32, so these steps are fp32's. Each step records, per tensor, the ratio of
  its updates to the ulp its stored value would have.
- **Decision**, per tensor, the cheapest storage that keeps its updates:

  ==================  ==========================  =============================================
  storage             bytes (bf16 weight)          chosen when
  ==================  ==========================  =============================================
  ``low``             2                            90% of updates are at least 1 ulp and at
                                                   most 1% are below half an ulp
  ``low+sr``          2 (a seeded generator)       updates are at least a quarter of an ulp
                                                   (median): stochastic rounding keeps their
                                                   mean, its noise a random walk of at most
                                                   half an ulp a step
  ``fp32 master``     6                            smaller updates in a tensor of at most 4096
                                                   elements (the copy costs next to nothing)
  ``low+kahan``       4 (one more low tensor)      updates down to 1/64 ulp (median): the
                                                   compensation keeps what rounding drops
  ``fp32 master``     6                            smaller updates still
  ==================  ==========================  =============================================

  The optimizer's states (AdamW's moments, SGD's momentum) are stored in bfloat16 (fp32's
  range: fp16's smallest normal, 6.1e-5, is above a second moment's typical 1e-8) rounded to
  nearest where their updates survive it, stochastically where not. Weights the plan computes in
  fp32 (norm scales the plan keeps fp32) stay fp32, with fp32 states.
- **Again** every ``check_every`` steps: a tensor whose updates changed scale is moved to the
  storage its new ratio calls for (the report names the step and the ratio), as a plan re-plans
  on overflow.

The update rule itself is the wrapped optimizer's, run in fp32 one parameter at a time: the
weight, its gradient (unscaled, clipped) and its states are materialised in fp32, the torch
optimizer steps them, and each is stored back by its choice. The fp32 copies live for one
parameter's step only.

>>> import torch, amprewrite
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).train()
>>> gm = amprewrite.transform(model, "bf16", params="low")
>>> opt = amprewrite.optimizer(gm, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
>>> opt.param_groups[0]["lr"], [p.dtype for p in gm.parameters()]
(0.001, [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32])
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..errors import PolicyError
from ..precision.report import REPORT_KEY, StateDecision

__all__ = ["Optimizer", "optimizer", "stochastic_round", "ulp"]

LOW, SR, KAHAN, MASTER, FP32 = "low", "low+sr", "low+kahan", "fp32 master", "fp32"
STATE_DTYPE = torch.bfloat16  # fp32's range in half the bytes; see the module docstring
SMALL = 4096  # at most this many elements: an fp32 master costs less than the decision is worth
_SAMPLE = 1 << 16  # elements a ratio's quantiles are read from


@dataclass
class Ratio:
    """What one step's updates of one tensor were, against the ulp of its stored dtype."""

    update: float  # median |update| over the elements that changed
    value: float  # median |value|
    ulp: float  # the ulp at that median value
    q10: float  # 10th percentile of |update| / ulp
    median: float  # median of |update| / ulp
    lost: float  # share of changed elements whose update is below half an ulp

    def __str__(self) -> str:
        return (f"updates ~{self.update:.1e}, ulp {self.ulp:.1e} at {self.value:.2g}"
                f" ({self.median:.2g} ulp median, {self.lost:.0%} below half an ulp)")


def ulp(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The unit in the last place of each element of ``x`` in ``dtype`` (``x``'s own by
    default), as fp32; subnormals and zero get the dtype's smallest step.

    >>> ulp(torch.tensor([1.0, 0.02]), torch.bfloat16).tolist()
    [0.0078125, 0.0001220703125]
    """
    dtype = dtype or x.dtype
    info = torch.finfo(dtype)
    x = x.detach().float().abs()
    _, exp = torch.frexp(x)
    lowest = math.frexp(info.tiny)[1]  # the exponent of the smallest normal; below it, its ulp
    exp = torch.where(x == 0, lowest, exp.clamp(min=lowest))
    mantissa = round(-math.log2(info.eps))  # bits after the point: bf16 7, fp16 10
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp - 1 - mantissa)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype`` up or down at random, with the probability that makes
    the result's mean ``x``: an update below half an ulp is kept on average instead of lost.

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.full((20000,), 1.0 + 2**-9)          # a quarter of a bf16 ulp above 1.0
    >>> r = stochastic_round(x, torch.bfloat16, g).float()
    >>> sorted(set(r.tolist())), round((r.mean().item() - 1) / 2**-9, 1)
    ([1.0, 1.0078125], 1.0)
    """
    x = x.float()
    if dtype is torch.bfloat16:  # bf16 is fp32's top half: add noise below it, then truncate
        noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device,
                              dtype=torch.int32)
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(dtype)
    near = x.to(dtype)
    toward = torch.where(near.float() > x, -math.inf, math.inf).to(dtype)
    other = torch.nextafter(near, toward)
    lo, hi = torch.minimum(near, other), torch.maximum(near, other)
    span = hi.float() - lo.float()
    up = (x - lo.float()) / torch.where(span > 0, span, 1.0)
    draw = torch.rand(x.shape, generator=generator, device=x.device)
    return torch.where(near.float() == x, near, torch.where(draw < up, hi, lo))


def measure(before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype) -> Ratio | None:
    """The ratio of one step's updates (``after - before``, fp32) to the ulp of ``after`` in
    ``dtype``; None where nothing changed."""
    delta = (after - before).flatten()
    changed = delta != 0
    if not bool(changed.any()):
        return None
    delta, value = delta[changed].abs(), after.flatten()[changed]
    if delta.numel() > _SAMPLE:  # a strided sample: quantiles of 64k elements are enough
        stride = delta.numel() // _SAMPLE
        delta, value = delta[::stride], value[::stride]
    units = ulp(value, dtype)
    ratio = delta / units
    q = torch.quantile(ratio, torch.tensor([0.1, 0.5], device=ratio.device))
    mid = value.abs().median()
    return Ratio(update=float(delta.median()), value=float(mid),
                 ulp=float(ulp(mid.reshape(1), dtype)), q10=float(q[0]), median=float(q[1]),
                 lost=float((ratio < 0.5).float().mean()))


def choose_weight(ratio: Ratio | None, numel: int) -> tuple[str, str]:
    """The storage of a low weight and its reason, from its updates' ratio to its ulp."""
    if ratio is None:
        return LOW, "no update in the measured steps: low storage loses nothing"
    if ratio.q10 >= 1 and ratio.lost <= 0.01:
        return LOW, f"{ratio}: round-to-nearest keeps them"
    if ratio.median >= 0.25:
        return SR, f"{ratio}: stochastic rounding keeps their mean"
    if numel <= SMALL:
        return MASTER, f"{ratio}: fp32 master ({numel} elements: {4 * numel} bytes)"
    if ratio.median >= 1 / 64:
        return KAHAN, f"{ratio}: a low compensation keeps what rounding drops"
    return MASTER, f"{ratio}: below what a low compensation holds"


def choose_state(ratio: Ratio | None) -> tuple[str, str]:
    """The storage of an optimizer state (always bfloat16, see the module docstring)."""
    if ratio is None or (ratio.q10 >= 1 and ratio.lost <= 0.01):
        return LOW, f"{ratio or 'no update'}: bf16, round-to-nearest keeps them"
    return SR, f"{ratio}: bf16 with stochastic rounding keeps their mean"


class Optimizer(torch.optim.Optimizer):
    """A torch optimizer whose weights and states are stored as measured (module docstring).

    Made by :func:`optimizer`. ``param_groups`` carry the wrapped optimizer's hyperparameters,
    so learning-rate schedulers work; ``state_dict()`` holds every stored tensor, master,
    compensation and generator, so a resumed run continues the uninterrupted one; torch's and
    amprewrite's ``GradScaler`` unscale in fp32 inside :meth:`step`.
    """

    _step_supports_amp_scaling = True  # GradScaler hands grad_scale / found_inf to step()

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 defaults: dict[str, Any], *, names: dict[torch.Tensor, str], warmup: int,
                 check_every: int, seed: int, kwargs: dict[str, Any],
                 graph: nn.Module | None = None) -> None:
        super().__init__(params, defaults)
        self._kwargs = kwargs  # what the wrapped class was called with (its defaults add keys)
        self.optimizer_class = optimizer_class
        self.warmup, self.check_every, self.seed = warmup, check_every, seed
        self.steps = 0
        self.decisions: dict[str, StateDecision] = {}
        self._names = names or {p: f"param {i}" for i, p in enumerate(_params(self))}
        self._graph = graph
        self._inner: dict[torch.Tensor, tuple[torch.optim.Optimizer, torch.Tensor]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._clip: float | None = None

    # --------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient; skipped when a GradScaler found
        inf (as torch's optimizers do under it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item()):
            return loss
        scale = getattr(self, "grad_scale", None)
        inv = None if scale is None else float(scale.double().reciprocal())
        self.steps += 1
        measuring = self.steps <= self.warmup or (self.steps % self.check_every == 0)
        clip = self._clip_factor(inv)
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, hyper, inv, clip, measuring)
        if measuring and self.steps >= self.warmup:
            self._decide()
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the next step's gradients to a total 2-norm of ``max_norm``, the norm computed
        in fp32 from the unscaled gradients inside :meth:`step` (so it also holds under a
        GradScaler). ``torch.nn.utils.clip_grad_norm_`` works too, in the gradients' dtype.
        Returns the gradients' norm as they are now (scaled, under a GradScaler)."""
        self._clip = float(max_norm)
        return self._grad_norm()

    def _grad_norm(self) -> torch.Tensor:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return torch.zeros(())
        squares = torch.stack([_local(g).float().square().sum() for g in grads]).sum()
        if any(_local(g) is not g for g in grads) and torch.distributed.is_initialized():
            torch.distributed.all_reduce(squares)  # FSDP2 shards: the sum over every rank's
        return squares.sqrt()

    def _clip_factor(self, inv: float | None) -> float:
        max_norm, self._clip = self._clip, None
        if max_norm is None:
            return 1.0
        norm = float(self._grad_norm()) * (inv or 1.0)
        return min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0

    def _step_one(self, p: torch.Tensor, hyper: dict[str, Any], inv: float | None,
                  clip: float, measuring: bool) -> None:
        st = self.state[p]
        if not st:
            self._start(p, st)
        inner, work = self._inner_of(p, hyper)
        weight = self._materialise(p, st)
        before = weight.clone() if measuring and st["storage"] != FP32 else None
        grad = _local(p.grad)
        grad = grad.float() if grad.dtype != torch.float32 else grad
        if inv is not None or clip != 1.0:
            grad = grad * ((inv or 1.0) * clip)
        local = _local(p)
        states = {k: (v.float() if _like(v, local) else v) for k, v in st["inner"].items()}
        olds = {k: v.clone() for k, v in states.items()
                if before is not None and _like(v, local)}
        work.data, work.grad = weight, grad
        inner.state[work] = states
        inner.step()
        states = inner.state.pop(work)
        work.data, work.grad = torch.empty(0), None
        self._store_weight(p, st, weight, before)
        for k, v in states.items():
            st["inner"][k] = self._store_state(p, st, k, v, olds.get(k))

    def _start(self, p: torch.Tensor, st: dict[str, Any]) -> None:
        st["inner"], st["inner_storage"], st["ratios"] = {}, {}, {}
        if p.dtype == torch.float32:
            st["storage"] = FP32
            self._say(p, "weight", FP32, p.dtype,
                      "the plan reads it in fp32: stored as it is, with fp32 states")
        else:
            st["storage"] = MASTER  # the warm-up: fp32's steps while the ratios are measured
            st["master"] = _local(p).detach().float()
            self._say(p, "weight", MASTER, p.dtype,
                      f"warm-up: fp32 master for {self.warmup} steps while updates are measured")

    def _inner_of(self, p: torch.Tensor, hyper: dict[str, Any]
                  ) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        if p not in self._inner:
            work = torch.zeros(1, device=p.device)
            self._inner[p] = (self.optimizer_class([work], **self._kwargs), work)
        inner, work = self._inner[p]
        inner.param_groups[0].update(hyper)  # a scheduler changed the outer group's lr
        return inner, work

    def _materialise(self, p: torch.Tensor, st: dict[str, Any]) -> torch.Tensor:
        """The weight in fp32: the parameter itself, its master, or low value + compensation."""
        if st["storage"] == FP32:
            return _local(p).detach()
        if "master" in st:
            return st["master"]
        weight = _local(p).detach().float()
        return weight.add_(st["comp"].float()) if "comp" in st else weight

    def _store_weight(self, p: torch.Tensor, st: dict[str, Any], weight: torch.Tensor,
                      before: torch.Tensor | None) -> None:
        storage = st["storage"]
        if storage == FP32:
            return
        if before is not None:
            st["ratios"].setdefault("weight", []).append(measure(before, weight, p.dtype))
        local = _local(p)
        if storage == SR:
            local.copy_(stochastic_round(weight, p.dtype, self._generator(local.device)))
        else:
            local.copy_(weight)  # round to nearest (exact where the master is kept)
        if storage == KAHAN:
            st["comp"].copy_(weight - local.float())

    def _store_state(self, p: torch.Tensor, st: dict[str, Any], key: str, value: Any,
                     before: torch.Tensor | None) -> Any:
        if not _like(value, _local(p)):
            return value
        if st["storage"] == FP32:
            st["inner_storage"][key] = FP32
            return value
        if before is not None:
            st["ratios"].setdefault(key, []).append(measure(before, value, STATE_DTYPE))
        storage = st["inner_storage"].setdefault(key, FP32)  # fp32 until the warm-up ends
        return self._stored(value, storage, p.device)

    def _stored(self, state: torch.Tensor, storage: str, device: torch.device) -> torch.Tensor:
        """An optimizer state as ``storage`` keeps it: fp32, bf16 rounded to nearest, or bf16
        rounded stochastically."""
        if storage == FP32:
            return state
        if storage == SR:
            return stochastic_round(state, STATE_DTYPE, self._generator(device))
        return state.to(STATE_DTYPE)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[key]

    # ------------------------------------------------------------------------ decisions
    def _decide(self) -> None:
        """After the warm-up and at each check: every tensor's storage from its ratio."""
        self._agree()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st or st["storage"] == FP32 or not st["ratios"]:
                    continue
                ratios = {k: _typical(v) for k, v in st["ratios"].items()}
                st["ratios"] = {}
                storage, reason = choose_weight(ratios.get("weight"), p.numel())
                self._move(p, st, storage)
                self._say(p, "weight", storage, p.dtype, reason)
                for key in st["inner"]:
                    if _like(st["inner"][key], _local(p)):
                        storage, reason = choose_state(ratios.get(key))
                        if p.dtype == torch.float16:
                            reason += ("; bf16, not the weight's fp16: a moment's values fall "
                                       "below fp16's smallest normal (6.1e-05), bf16 has fp32's "
                                       "range")
                        st["inner_storage"][key] = storage
                        st["inner"][key] = self._stored(st["inner"][key].float(), storage,
                                                        p.device)
                        self._say(p, key, storage, STATE_DTYPE, reason)
        self._publish()

    def _agree(self) -> None:
        """Sharded parameters (FSDP2's DTensors): the ratios of every rank's shard, averaged
        over the ranks in one all-reduce, so that every rank stores a parameter's shards
        alike and says the same reason. Every rank steps every parameter (FSDP2 and DDP
        do), so the tensors line up."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        params = [p for g in self.param_groups for p in g["params"]
                  if self.state.get(p) and self.state[p]["storage"] != FP32]
        if not any(_local(p) is not p for p in params):
            return
        slots = [(self.state[p], key) for p in params
                 for key in ["weight", *sorted(k for k, v in self.state[p]["inner"].items()
                                               if _like(v, _local(p)))]]
        fields = [f.name for f in dataclasses.fields(Ratio)]
        table = torch.zeros(len(slots), 1 + len(fields), dtype=torch.float64)
        for i, (st, key) in enumerate(slots):
            r = _typical(st["ratios"].get(key, []))
            if r is not None:
                table[i] = torch.tensor([1.0, *(getattr(r, f) for f in fields)])
        device = _local(params[0]).device
        table = table.to(device)
        torch.distributed.all_reduce(table)
        for (st, key), row in zip(slots, table.cpu().tolist()):
            st["ratios"][key] = [Ratio(**{f: v / row[0] for f, v in zip(fields, row[1:])})
                                 if row[0] else None]

    def _move(self, p: torch.Tensor, st: dict[str, Any], storage: str) -> None:
        """Change a weight's storage without losing what the old one held."""
        if storage == st["storage"]:
            return
        weight = self._materialise(p, st).clone()
        st.pop("master", None)
        st.pop("comp", None)
        if storage == MASTER:
            st["master"] = weight
        local = _local(p)
        local.copy_(weight)
        if storage == KAHAN:
            st["comp"] = (weight - local.float()).to(p.dtype)
        st["storage"] = storage

    def _say(self, p: torch.Tensor, tensor: str, storage: str, dtype: torch.dtype,
             reason: str) -> None:
        name = self._names.get(p) or f"param {_params(self).index(p)}"
        key = name if tensor == "weight" else f"{name}:{tensor}"
        old = self.decisions.get(key)
        if old is not None and old.step >= self.warmup and old.storage != storage:
            reason = f"re-decided at step {self.steps} (was {old.storage}): {reason}"
        elif old is not None and old.step >= self.warmup and old.storage == storage:
            return  # the same choice again: the reason stays the one of the step that made it
        self.decisions[key] = StateDecision(param=name, tensor=tensor, storage=storage,
                                            dtype=str(dtype).replace("torch.", ""),
                                            reason=reason, step=self.steps)

    def _publish(self) -> None:
        report = getattr(self._graph, "meta", {}).get(REPORT_KEY)  # a GraphModule's report
        if report is not None:
            report.training_state = list(self.decisions.values())

    # ------------------------------------------------------------------------- accounting
    def state_bytes(self) -> dict[str, int]:
        """Bytes the training state holds now: ``weights``, ``grads``, ``states``,
        ``masters``, ``compensations``, their ``total`` and the ``params`` counted."""
        out = dict.fromkeys(("weights", "grads", "states", "masters", "compensations"), 0)
        count = 0
        for group in self.param_groups:
            for p in group["params"]:
                shard = _local(p)  # on its rank, a DTensor's bytes are its shard's
                count += shard.numel()
                out["weights"] += _nbytes(shard)
                st = self.state.get(p, {})
                # a gradient is as large as its weight while backward and step run, even where
                # zero_grad() has freed it since
                out["grads"] += _nbytes(shard) if p.grad is not None or st else 0
                out["masters"] += _nbytes(st["master"]) if "master" in st else 0
                out["compensations"] += _nbytes(st["comp"]) if "comp" in st else 0
                out["states"] += sum(_nbytes(v) for v in st.get("inner", {}).values()
                                     if _like(v, shard))
        out["total"] = sum(out.values())
        out["params"] = count
        return out

    def report(self) -> str:
        """One line per stored tensor: parameter, tensor, storage, dtype, reason."""
        from ..precision.report import text_table

        columns = [f.name for f in dataclasses.fields(StateDecision) if f.name != "step"]
        rows = [columns] + [[getattr(d, c) for c in columns] for d in self.decisions.values()]
        per = self.state_bytes()
        parts = ", ".join(f"{k} {v:,}" for k, v in per.items() if k not in ("total", "params"))
        head = (f"training state after {self.steps} steps: "
                f"{per['total'] / max(per['params'], 1):.2f} bytes a parameter ({parts})")
        return head + "\n" + text_table(rows)

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every stored tensor (weights' masters and compensations, states as stored), the
        choices, the step count and the generators: what a resumed run needs."""
        index = {p: i for i, p in enumerate(_params(self))}
        state = {index[p]: {k: (dict(v) if isinstance(v, dict) and k != "ratios" else v)
                            for k, v in st.items() if k != "ratios"}
                 for p, st in self.state.items() if p in index}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[p] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups,
                "amprewrite": {"steps": self.steps, "seed": self.seed,
                               "generators": {k: g.get_state()
                                              for k, g in self._generators.items()},
                               "decisions": [asdict(d) for d in self.decisions.values()]}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output onto the same parameters (in the same order)."""
        params = _params(self)
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(h["params"]) for g, h in zip(groups, self.param_groups)):
            raise PolicyError(
                "amprewrite.optimizer.load_state_dict: the saved optimizer has "
                f"{[len(g['params']) for g in groups]} parameters per group and this one "
                f"{[len(g['params']) for g in self.param_groups]}: load a state saved from an "
                "optimizer over the same parameters (made from the same model the same way)")
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self.state.clear()
        for i, st in state_dict["state"].items():
            p = params[int(i)]
            self.state[p] = {k: (_to(v, p.device) if k != "inner" else
                                 {n: _to(t, p.device) for n, t in v.items()})
                             for k, v in st.items()}
            self.state[p]["inner_storage"] = dict(st.get("inner_storage", {}))
            self.state[p]["ratios"] = {}
        extra = state_dict.get("amprewrite", {})
        self.steps = int(extra.get("steps", 0))
        self._generators = {k: torch.Generator(k) for k in extra.get("generators", {})}
        for k, g in self._generators.items():
            g.set_state(extra["generators"][k])
        self.decisions = {(d["param"] if d["tensor"] == "weight" else
                           f"{d['param']}:{d['tensor']}"): StateDecision(**d)
                          for d in extra.get("decisions", [])}
        self._publish()


def _typical(ratios: list[Ratio | None]) -> Ratio | None:
    """Of the measured steps, the one whose median ratio is the median: the first steps are
    not typical (AdamW's first moves rows an embedding has not seen yet by weight decay
    alone), and a later change of scale is what the checks every ``check_every`` steps see."""
    seen = sorted((r for r in ratios if r is not None), key=lambda r: r.median)
    return seen[len(seen) // 2] if seen else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2's sharded parameters and gradients), or ``t``: the
    update rules are elementwise, so each rank steps its own shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _like(value: Any, p: torch.Tensor) -> bool:
    """A state tensor shaped like its parameter (a moment, a momentum), not a step count."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.shape == p.shape)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def optimizer(params: nn.Module | Iterable[Any],
              optimizer_class: type[torch.optim.Optimizer], *, warmup: int = 10,
              check_every: int = 100, seed: int = 0, module: nn.Module | None = None,
              **hyperparameters: Any) -> Optimizer:
    """``optimizer_class`` (any ``torch.optim`` optimizer: AdamW, Adam, SGD, ...) over
    ``params`` (a module, such as :func:`amprewrite.transform`'s GraphModule with
    ``params="low"``, or parameters / param groups as torch optimizers take), storing each
    weight and state as measured (see :mod:`amprewrite.compile.optimizer`). The
    hyperparameters are the wrapped optimizer's. ``warmup``: the steps measured (in fp32)
    before the first decision; ``check_every``: the steps between later decisions; ``seed``:
    the stochastic rounding's generators; ``module``: where ``params`` are param groups, the
    module whose names (and report) they take.

    >>> import torch, amprewrite
    >>> lin = torch.nn.Linear(64, 64).bfloat16()
    >>> opt = amprewrite.optimizer(lin, torch.optim.AdamW, lr=1e-3, warmup=3)
    >>> for _ in range(3):
    ...     lin(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    ...     opt.step(); opt.zero_grad()
    >>> sorted({d.storage for d in opt.decisions.values()})  # weights and moments
    ['low', 'low+sr']
    >>> opt.state_bytes()["masters"]  # none of these updates needs an fp32 master
    0
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class,
                                                             torch.optim.Optimizer)):
        raise PolicyError(
            f"amprewrite.optimizer: optimizer_class must be a torch.optim.Optimizer class such "
            f"as torch.optim.AdamW, not {optimizer_class!r}: pass the class, and its "
            "hyperparameters as keywords (amprewrite.optimizer(gm, torch.optim.AdamW, lr=1e-4))")
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer):
        raise PolicyError("amprewrite.optimizer: optimizer_class is already an amprewrite "
                          "optimizer; pass the torch optimizer class it should wrap")
    for name, value in (("warmup", warmup), ("check_every", check_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PolicyError(f"amprewrite.optimizer: {name} must be a positive int (steps), "
                              f"not {value!r}")
    graph = params if isinstance(params, nn.Module) else module
    names: dict[torch.Tensor, str] = {}
    if graph is not None:
        names = {p: n for n, p in graph.named_parameters()}
    if isinstance(params, nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    params = list(params)
    if not params:
        raise PolicyError("amprewrite.optimizer: no parameters to optimize (the module has none "
                          "that require grad, or the list is empty)")
    try:
        probe = optimizer_class([torch.zeros(1)], **hyperparameters)
    except (TypeError, ValueError) as e:
        raise PolicyError(
            f"amprewrite.optimizer: {optimizer_class.__name__} refused the hyperparameters "
            f"{sorted(hyperparameters)}: {e}. Pass the keywords "
            f"{optimizer_class.__name__} takes "
            f"({', '.join(list(inspect.signature(optimizer_class).parameters)[1:])})") from None
    return Optimizer(params, optimizer_class, dict(probe.defaults), names=names, warmup=warmup,
                     check_every=check_every, seed=seed, kwargs=hyperparameters,
                     graph=graph)
