"""``amprewrite.GradScaler``: ``torch.amp.GradScaler`` that also tells the plans of an overflow.

``torch.amp.GradScaler`` scales the loss so that fp16 *gradients* stay in range, and skips a
step whose gradients are not finite. It cannot help a *forward* that overflows: the activations
are not scaled, so when a model's values outgrow the ranges its plan was made from, every later
step overflows again and is skipped, silently. This drop-in subclass does what torch's does and,
in ``update()``, when that step found inf, marks every amprewrite plan stale
(:func:`amprewrite.compile.block_plans.mark_overflow`): each compiled block records its ranges
again on its next call and plans again where they grew, so training goes on after one lost step.

A subclass is needed because ``torch.amp.GradScaler`` exposes no hook on ``found_inf``; the flag
it reads is already on the host after ``step()`` (torch's ``step`` syncs on it), so this costs no
extra device sync. Under ``torch.distributed`` the flag is reduced across ranks (one small
all-reduce per step) so that every rank plans again at the same call, as the plans' range
reduction requires.
"""

from __future__ import annotations

import torch

from . import block_plans as plans

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for models compiled with ``backend="amprewrite"`` in fp16:
    the same arguments and recipe; a step whose gradients overflow also makes the plans
    record their ranges again on the next forward (see the module docstring).

    >>> import torch, amprewrite
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = amprewrite.GradScaler("cpu")
    >>> loss = model(torch.randn(2, 4)).sum()
    >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    >>> scaler.overflows
    0
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.overflows = 0  # steps whose gradients were not finite

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict:
        # torch refuses fp16 gradients here (an fp16 master would lose them); amprewrite's
        # optimizer stores fp16 weights on purpose and keeps fp32 masters where they are needed
        from .optimizer import Optimizer

        return super()._unscale_grads_(optimizer, inv_scale, found_inf,
                                       allow_fp16 or isinstance(optimizer, Optimizer))

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """``torch.amp.GradScaler.update``; first, where this step found inf, mark the plans."""
        if self._enabled and self._per_optimizer_states:
            found = [v for state in self._per_optimizer_states.values()
                     for v in state["found_inf_per_device"].values()]
            if found and _any_rank(torch.stack([v.reshape(()) for v in found]).sum()):
                self.overflows += 1
                plans.mark_overflow()
        plans.count_step()
        super().update(new_scale)


def _any_rank(flag: torch.Tensor) -> bool:
    """Whether ``flag`` is nonzero on any rank (on this one outside torch.distributed)."""
    if plans.distributed():
        flag = flag.clone().float()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
