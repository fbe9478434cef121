"""accelerate's ``Accelerator`` with amprewrite's plan: one line before ``accelerator.prepare``.

::

    accelerator = Accelerator(mixed_precision="fp16")
    amprewrite.trainers.accelerate.enable(accelerator, model)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    # the loop as usual: accelerator.backward(loss), accelerator.clip_grad_norm_(...),
    # optimizer.step(), accelerator.save_state(...) / load_state(...)

The model is compiled in place with the amprewrite backend in the Accelerator's dtype
(``mixed_precision="fp16"``: float16, ``"bf16"``: bfloat16); accelerate's autocast is turned off
(its casts would undo the plan's); in fp16 its loss scaler is :class:`amprewrite.GradScaler`,
which also makes the plan record its ranges again after a step whose gradients overflow.
accelerate unscales the gradients before ``clip_grad_norm_`` and saves the scaler with
``save_state`` as it does its own. transformers' ``Trainer`` trains through an ``Accelerator``:
:func:`amprewrite.trainers.transformers.enable` does this for it.

With ``params="low"`` the weights the plan reads low are stored low in ``model``
(:func:`amprewrite.compile.low_params.store_low`), and each torch optimizer
``accelerator.prepare`` is given becomes an :func:`amprewrite.optimizer` with the same class,
groups and hyperparameters (use the optimizer ``prepare`` returns, as usual; a scheduler made
on the torch optimizer drives the new one's learning rate).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..compile.backend import backend
from ..compile.low_params import check_params, from_torch, store_low
from ..compile.scaler import GradScaler
from ..errors import PolicyError
from ..precision.policy import parse_dtype
from .inner import inner_for

__all__ = ["enable", "plan_instead_of_autocast"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def enable(accelerator: object, model: nn.Module, *, dtype: torch.dtype | str | None = None,
           inner: str | Callable = "auto", params: str = "fp32",
           **options: object) -> nn.Module:
    """Compile ``model`` in place with the amprewrite backend and make ``accelerator`` train it
    with the plan instead of autocast; returns ``model``. Call it before
    ``accelerator.prepare``.

    Args:
        accelerator: an ``accelerate.Accelerator``; its ``mixed_precision`` gives the dtype.
        model: the fp32 model, not compiled yet.
        dtype: the low dtype where ``mixed_precision`` is ``"no"``.
        inner: the backend that compiles the planned graphs: ``"auto"`` (default) ``"eager"``
            on a CPU, ``"inductor"`` on a GPU (:mod:`amprewrite.trainers.inner`); or any
            backend name or callable, as given.
        params: ``"fp32"`` or ``"low"`` (see the module docstring).
        options: the backend's other options (``keep_fp32``, ``allow_low``, ...).
    """
    low = dtype if dtype is not None else _DTYPES.get(str(accelerator.mixed_precision))
    if low is None:
        raise PolicyError(
            "amprewrite.trainers.accelerate.enable takes its dtype from the Accelerator: make it "
            "with mixed_precision='fp16' or 'bf16', or pass dtype=torch.float16 / "
            "torch.bfloat16.")
    low = parse_dtype(low)
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise PolicyError(
            f"{type(model).__name__} is compiled already (model.compile()); pass the model as it "
            "is and let enable() compile it with the amprewrite backend.")
    if getattr(model, "_original_forward", None) is not None:
        raise PolicyError(
            "the model was prepared already (accelerator.prepare wrapped its forward in "
            "autocast): call enable() before accelerator.prepare.")
    if check_params(params, "amprewrite.trainers.accelerate.enable") == "low":
        store_low(model, low, options.get("keep_fp32", ()))  # type: ignore[arg-type]
        prepare = accelerator.prepare_optimizer

        def prepare_optimizer(optimizer: torch.optim.Optimizer, *args: object,
                              **kwargs: object) -> object:
            return prepare(from_torch(optimizer, model), *args, **kwargs)

        accelerator.prepare_optimizer = prepare_optimizer
    model.compile(backend=backend(inner=inner_for(inner), dtype=low, **options))
    plan_instead_of_autocast(accelerator, low)
    return model


def plan_instead_of_autocast(accelerator: object, low: torch.dtype) -> None:
    """accelerate's autocast off and, in fp16, :class:`amprewrite.GradScaler` in place of
    torch's (with its settings)."""
    from accelerate.utils import AutocastKwargs  # optional dependency: here only

    accelerator.autocast_handler = AutocastKwargs(enabled=False)
    if low == torch.float16:
        old = accelerator.scaler
        settings = {} if old is None else {
            "init_scale": old.get_scale() if old.is_enabled() else 2.0 ** 16,
            "growth_factor": old.get_growth_factor(),
            "backoff_factor": old.get_backoff_factor(),
            "growth_interval": old.get_growth_interval()}
        accelerator.scaler = GradScaler(accelerator.device.type, **settings)
        # accelerate unscales before clipping only where it runs its own fp16 amp, which it
        # does not on a CPU: with autocast off, saying it does changes nothing else.
        accelerator.native_amp = True
