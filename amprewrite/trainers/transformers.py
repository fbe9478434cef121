"""transformers' ``Trainer`` with amprewrite's plan: one line after the Trainer is made.

::

    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), ...)
    amprewrite.trainers.transformers.enable(trainer)
    trainer.train()

What it does, and why each step (DESIGN.md, "Where people train"):

- **The model is compiled in place** with the amprewrite backend (``model.compile(backend=...)``,
  torch's ``nn.Module.compile``): its ``forward`` and its signature stay the model's, so
  ``remove_unused_columns`` keeps the columns it should; its ``state_dict`` keys stay the
  model's (no ``_orig_mod.``), so checkpoints, ``resume_from_checkpoint`` and
  ``save_pretrained``/``from_pretrained`` work as without amprewrite. (``torch_compile=True``
  with ``torch_compile_backend="amprewrite"`` cannot work: accelerate accepts only the backends
  of its own enum.)
- **The dtype is the Trainer's**: ``fp16=True`` plans in float16, ``bf16=True`` in bfloat16.
- **accelerate's autocast is turned off** (its ``AutocastKwargs(enabled=False)``): the plan's
  casts are explicit, and autocast's would undo them (the graphs also turn an enclosing
  autocast off themselves; this keeps the code between graphs fp32 too).
- **In fp16 the loss scaler is** :class:`amprewrite.GradScaler`: torch's recipe, and a step
  whose gradients overflow also makes the plan record its ranges again, so training goes on
  after one lost step where torch's scaler would skip every later step. accelerate unscales the
  gradients before ``max_grad_norm`` clipping and saves the scaler in checkpoints as usual. On
  a CPU, where accelerate has no fp16 autocast and ``Trainer(fp16=True)`` alone trains in fp32
  with no scaler, this is what makes fp16 training happen at all.
- **With** ``params="low"`` the weights the plan reads low (linear, convolution, embedding)
  are stored low in the model (:func:`amprewrite.compile.low_params.store_low`) and the
  Trainer's optimizer (its ``optim`` and hyperparameters, its weight-decay groups) becomes an
  :func:`amprewrite.optimizer`: fp32 masters, compensations or stochastic rounding where a low
  weight would lose its updates, bf16 states. Checkpoints hold the low weights;
  ``from_pretrained(dir, dtype=torch.float32)`` loads them into an fp32 model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..compile.backend import backend
from ..compile.low_params import check_params, from_torch, store_low
from ..errors import PolicyError
from .accelerate import plan_instead_of_autocast
from .inner import inner_for

__all__ = ["enable"]


def enable(trainer: object, *, dtype: torch.dtype | str | None = None,
           inner: str | Callable = "auto", params: str = "fp32",
           **options: object) -> object:
    """Train ``trainer`` (a ``transformers.Trainer``) with amprewrite's plan; returns it.

    Args:
        trainer: made, not yet trained (call this before ``trainer.train()``).
        dtype: the low dtype; default the Trainer's (``fp16=True``: float16, ``bf16=True``:
            bfloat16).
        inner: the backend that compiles the planned graphs: ``"auto"`` (default) runs them
            as they are (``"eager"``) on a CPU, where inductor's compile of a training graph
            takes minutes, and compiles them with ``"inductor"`` on a GPU
            (:mod:`amprewrite.trainers.inner`); or any backend name or callable, as given.
        params: ``"fp32"`` (fp32 weights, cast in the graph) or ``"low"`` (stored low and
            trained by :func:`amprewrite.optimizer`; see the module docstring).
        options: the backend's other options (``keep_fp32``, ``allow_low``, ``overflow``, ...;
            docs/guide.md, "The torch.compile backend").

    Example (a tiny LLaMA, bf16 on a CPU)::

        >>> import torch, amprewrite.trainers.transformers as amp
        >>> from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=2, vocab_size=64))
        >>> ids = torch.randint(0, 64, (4, 8))
        >>> data = [{"input_ids": i, "labels": i} for i in ids]
        >>> args = TrainingArguments("/tmp/amp-doctest", bf16=True, use_cpu=True, max_steps=1,
        ...                          report_to=[], save_strategy="no", disable_tqdm=True)
        >>> trainer = amp.enable(Trainer(model=model, args=args, train_dataset=data))
        >>> trainer.train().training_loss > 0  # it prints its metrics  # doctest: +ELLIPSIS
        {...}
        True
    """
    from transformers.utils import logging as hf_logging  # optional dependency: here only

    del hf_logging
    args = trainer.args
    low = dtype if dtype is not None else (
        torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None)
    if low is None:
        raise PolicyError(
            "amprewrite.trainers.transformers.enable takes its dtype from the Trainer: set "
            "fp16=True or bf16=True in TrainingArguments, or pass dtype=torch.float16 / "
            "torch.bfloat16.")
    if getattr(args, "torch_compile", False):
        raise PolicyError(
            "TrainingArguments(torch_compile=True) compiles the model again with accelerate's "
            "backend around amprewrite's; leave torch_compile off: enable() compiles the model "
            "with the amprewrite backend itself.")
    from ..precision.policy import parse_dtype

    low = parse_dtype(low)
    model = trainer.model
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise PolicyError(
            f"{type(model).__name__} is compiled already (model.compile()); give the Trainer "
            "the model as it is and let enable() compile it with the amprewrite backend.")
    if check_params(params, "amprewrite.trainers.transformers.enable") == "low":
        store_low(model, low, options.get("keep_fp32", ()))  # type: ignore[arg-type]
        _optimizer_keeps_updates(trainer)
    model.compile(backend=backend(inner=inner_for(inner), dtype=low, **options))
    plan_instead_of_autocast(trainer.accelerator, low)
    return trainer


def _optimizer_keeps_updates(trainer: object) -> None:
    """The Trainer's optimizer, made as the Trainer makes it, then an amprewrite.optimizer."""
    if trainer.optimizer is not None:  # Trainer(optimizers=(opt, scheduler)): swap it now
        trainer.optimizer = from_torch(trainer.optimizer, trainer.model)
        return
    make = trainer.create_optimizer

    def create_optimizer(*args: object, **kwargs: object) -> torch.optim.Optimizer:
        made = make(*args, **kwargs)
        trainer.optimizer = from_torch(made, trainer.model)
        return trainer.optimizer

    trainer.create_optimizer = create_optimizer
