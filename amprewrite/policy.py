"""The options of a transform, as one validated dataclass shared by the API, backend and CLI."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from .errors import PolicyError

__all__ = ["Policy", "parse_dtype"]

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
}

Selector = str | type
"""A module path (``"encoder.layer.0"``), a module type (``nn.LayerNorm``) or a family name."""


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the low-precision dtype named by ``dtype`` (``torch.bfloat16``, ``"bf16"``, ...).

    >>> parse_dtype("fp16")
    torch.float16
    """
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    elif dtype in (torch.bfloat16, torch.float16):
        return dtype
    raise PolicyError(
        f"amprewrite converts models to bfloat16 or float16, got dtype={dtype!r}. "
        "Pass dtype=torch.bfloat16 (or 'bf16') or dtype=torch.float16 (or 'fp16'); "
        "for a pure fp32 model there is nothing to rewrite."
    )


def _selectors(name: str, value: object) -> tuple[Selector, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        value = (value,)
    if not isinstance(value, Iterable):
        raise PolicyError(
            f"{name} must be a list of module paths, module types or family names, got {value!r}."
        )
    out = []
    for item in value:
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            out.append(item)
        else:
            raise PolicyError(
                f"{name} entries must be module paths like 'encoder.layer.0', nn.Module "
                f"subclasses like nn.LayerNorm, or op family names like 'softmax'; got {item!r}."
            )
    return tuple(out)


@dataclass(frozen=True)
class Policy:
    """How a model is converted. Built by :func:`amprewrite.transform` from its keywords.

    >>> Policy(dtype="bf16").dtype
    torch.bfloat16
    >>> Policy(dtype=torch.float16, keep_fp32=["head"]).keep_fp32
    ('head',)
    """

    dtype: torch.dtype = torch.bfloat16
    keep_fp32: tuple[Selector, ...] = field(default=())
    allow_low: tuple[Selector, ...] = field(default=())
    params: Literal["fp32", "low"] = "fp32"
    keep_io_dtype: bool = True
    upsample: Literal["auto", "always", "never"] = "auto"
    device: torch.device | None = None  # the device the graph will run on (for kernel probes)
    # With example inputs: what a call with inputs the graph was not captured for does.
    on_new_shape: Literal["transform", "error"] = "transform"
    # With example inputs: compare the graph against fp32 and autocast before returning it.
    verify: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        keep = _selectors("keep_fp32", self.keep_fp32)
        allow = _selectors("allow_low", self.allow_low)
        both = set(keep) & set(allow)
        if both:
            raise PolicyError(
                f"{sorted(map(str, both))} appear in both keep_fp32 and allow_low; "
                "name each module, type or family in one of them only."
            )
        object.__setattr__(self, "keep_fp32", keep)
        object.__setattr__(self, "allow_low", allow)
        if self.params not in ("fp32", "low"):
            raise PolicyError(
                f"params must be 'fp32' (share the model's fp32 weights, cast in the graph) or "
                f"'low' (store low-precision copies of weights used only by low ops), "
                f"got {self.params!r}."
            )
        if self.upsample not in ("auto", "always", "never"):
            raise PolicyError(
                f"upsample must be 'auto' (rewrite nearest upsampling the target has no kernel "
                f"for), 'always' or 'never', got {self.upsample!r}."
            )
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError):
                raise PolicyError(f"device must name a torch device such as 'cuda' or 'cpu', "
                                  f"got {self.device!r}.") from None
        if self.on_new_shape not in ("transform", "error"):
            raise PolicyError(
                f"on_new_shape must be 'transform' (transform again, once per new shape class, "
                f"when called with inputs the graph was not captured for) or 'error' (raise "
                f"ShapeError instead), got {self.on_new_shape!r}."
            )
        if not isinstance(self.verify, bool):
            raise PolicyError(f"verify must be True or False, got {self.verify!r}.")
        if not isinstance(self.keep_io_dtype, bool):
            raise PolicyError(f"keep_io_dtype must be True or False, got {self.keep_io_dtype!r}.")
