"""Values are facts too: the range of every value on the example inputs, and the model's own
fp32 declarations (DESIGN.md, "Values are facts too").

A :class:`ValueRange` is what the fp32 graph produced at a node on the example inputs (and any
calibration batches): the largest magnitude and, for fp16, the share of nonzero values below
the smallest normal number. The pass :mod:`amprewrite.passes.record_ranges` runs the graph
once per batch to find them; :func:`tensor_range` reads a parameter's directly. The pass
:mod:`amprewrite.passes.paint_precision` reads them like a precision class: a value past
:func:`range_limit` is computed and stored in fp32.

fp16 stops at 65504. A value seen at ``|x| = 4,000`` on a handful of example inputs can pass
that on other inputs, and a weight trained on keeps growing, so the limit keeps a headroom of
:data:`HEADROOM` (16x, 4 bits of exponent) below the dtype's largest finite number. On the zoo
models with their example inputs no value a LOW op reads or writes passes it
(tests/test_ranges.py).

>>> range_limit(torch.float16)
4094
>>> r = tensor_range(torch.tensor([1e-6, 2e-6, 1.0, 0.0]), torch.float16)
>>> r.absmax, round(r.tiny_share, 3)
(1.0, 0.667)
>>> tensor_range(torch.zeros(3), torch.float16).absmax  # printed as 0 in reports, not -0
0.0
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HEADROOM", "TINY_SHARE", "ValueRange", "declared_fp32", "describe_limit", "merge",
           "narrower_than_fp32", "range_limit", "short_name", "tensor_range", "widest"]

HEADROOM = 16.0
"""How far below the low dtype's largest finite number a value must stay to be computed low."""

TINY_SHARE = 0.5
"""A weight with more than this share of its nonzero values below the low dtype's smallest
normal number would be stored mostly subnormal (a 1e-6 layer scale in fp16): it stays fp32."""


# Magnitudes from here on are sentinels for infinity (torch.finfo(torch.float32).min masks).
_SENTINEL = torch.finfo(torch.float32).max / 2


@dataclass(frozen=True)
class ValueRange:
    """The range of one value over the batches it was seen on.

    ``absmax``: the largest finite magnitude (inf and NaN of the fp32 model itself aside);
    ``tiny_share``: the share of nonzero values whose magnitude is below the low dtype's
    smallest normal number (0.0 for bfloat16, whose normal range is fp32's); ``batches``: how
    many batches the range was taken over (0 for a parameter, known without running).
    """

    absmax: float
    tiny_share: float = 0.0
    batches: int = 0


def narrower_than_fp32(low: torch.dtype) -> bool:
    """Can a value fp32 holds pass ``low``'s range? fp16: yes; bfloat16 (fp32's exponent): no,
    so ranges decide nothing there.

    >>> narrower_than_fp32(torch.float16), narrower_than_fp32(torch.bfloat16)
    (True, False)
    """
    return torch.finfo(low).max < torch.finfo(torch.float32).max / 2


def range_limit(low: torch.dtype) -> int:
    """The largest magnitude a value may reach to be computed and stored in ``low``."""
    return math.floor(torch.finfo(low).max / HEADROOM)


def short_name(low: torch.dtype) -> str:
    """``"fp16"`` / ``"bf16"``, as reasons name the dtype."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(low, str(low))


def describe_limit(low: torch.dtype) -> str:
    """``"fp16 max 65504 / headroom 16"``: how :func:`range_limit` was made, for reasons."""
    return f"{short_name(low)} max {torch.finfo(low).max:.6g} / headroom {HEADROOM:g}"


def tensor_range(t: torch.Tensor, low: torch.dtype, batches: int = 0,
                 sample: int | None = None) -> ValueRange:
    """The :class:`ValueRange` of one float tensor (its values, not its dtype's).

    The largest magnitude is exact (one pass, ``aminmax``); with ``sample``, the subnormal
    share is estimated from at most that many evenly spaced values (within about 0.5% at
    65,536: what a report shows, at a fraction of the passes over a large activation)."""
    with torch.no_grad():
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            return ValueRange(0.0, 0.0, batches)
        lo, hi = torch.aminmax(flat)
        absmax = max(float(hi), -float(lo))  # hi first: +0.0, never -0.0, for all zeros
        if not absmax < _SENTINEL:  # inf, NaN or a sentinel among the values: leave them out
            # Over the finite values: an inf or NaN the fp32 model itself makes (a -inf mask)
            # is the same in any dtype, and says nothing about the other values' range. So is
            # a value at fp32's own end (a torch.finfo(torch.float32).min mask): it stands for
            # infinity, and becomes the infinity it stands for in a narrower dtype.
            a = flat.abs()
            a = a[torch.isfinite(a) & (a < _SENTINEL)]
            absmax = float(a.amax()) if a.numel() else 0.0
        tiny_share = 0.0
        if low == torch.float16:
            if sample is not None and flat.numel() > sample:
                flat = flat[::flat.numel() // sample]
            a = flat.abs()
            nonzero = int(torch.count_nonzero(a))
            if nonzero:
                tiny = int(torch.count_nonzero(a < torch.finfo(low).tiny)) - (a.numel() - nonzero)
                tiny_share = tiny / nonzero
    return ValueRange(absmax, tiny_share, batches)


def merge(a: ValueRange | None, b: ValueRange) -> ValueRange:
    """The range over the batches of both."""
    if a is None:
        return b
    absmax = max(a.absmax, b.absmax)
    total = a.batches + b.batches
    share = ((a.tiny_share * a.batches + b.tiny_share * b.batches) / total if total
             else max(a.tiny_share, b.tiny_share))
    return ValueRange(absmax, share, total)


def widest(a: ValueRange | None, b: ValueRange) -> ValueRange:
    """The range a plan must hold for when ``a`` and ``b`` are the same value on different
    blocks, ranks or steps: the larger magnitude and the larger subnormal share.

    >>> widest(ValueRange(3.0, 0.1, 1), ValueRange(2.0, 0.4, 1))
    ValueRange(absmax=3.0, tiny_share=0.4, batches=2)
    """
    if a is None:
        return b
    return ValueRange(max(a.absmax, b.absmax), max(a.tiny_share, b.tiny_share),
                      a.batches + b.batches)


# --- the model authors' own declarations -----------------------------------------------------
_DECLARATIONS = (
    # (attribute, the dtypes it applies to): transformers' PreTrainedModel._get_dtype_plan.
    ("_keep_in_fp32_modules_strict", (torch.float16, torch.bfloat16)),
    ("_keep_in_fp32_modules", (torch.float16,)),
)


def declared_fp32(model: nn.Module, low: torch.dtype) -> dict[str, str]:
    """Parameter and buffer names of ``model`` its authors declare fp32 for ``low``, each with
    the attribute that declares it (``"_keep_in_fp32_modules_strict"`` first).

    transformers' models declare them in ``_keep_in_fp32_modules`` (applied when loading in
    fp16) and ``_keep_in_fp32_modules_strict`` (fp16 and bf16); ``from_pretrained`` matches each
    entry against the parameter names as a regular expression search with ``*`` for any text
    (``PreTrainedModel._get_dtype_plan`` and ``build_glob_alternation``). The same rule here.

    >>> class Net(nn.Module):
    ...     _keep_in_fp32_modules = ["wo"]
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.wi, self.wo = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> declared_fp32(Net(), torch.float16)
    {'wo.weight': '_keep_in_fp32_modules', 'wo.bias': '_keep_in_fp32_modules'}
    >>> declared_fp32(Net(), torch.bfloat16)
    {}
    """
    out: dict[str, str] = {}
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    for attr, dtypes in _DECLARATIONS:
        globs = getattr(model, attr, None)
        if not globs or low not in dtypes:
            continue
        pattern = re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in sorted(globs)))
        for name in names:
            if name not in out and pattern.search(name):
                out[name] = attr
    return out
