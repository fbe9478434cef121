"""The one table of dtype names: every flag and keyword that takes a dtype reads it here, so
``--dtype float16``, ``--inputs float16:2x3`` and ``transform(dtype="half")`` accept the same
spellings.

>>> dtype_from_name("half")
torch.float16
>>> low_dtype("BF16")
torch.bfloat16
>>> low_dtype(torch.float16)
torch.float16
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "LOW_DTYPES", "dtype_from_name", "low_dtype", "low_dtype_names"]

# Names as torch spells them (``torch.float16``, ``"float16"``, the alias ``"half"``) plus the
# short forms in common use (``fp16``, ``bf16``). Lower case; lookups fold case.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64,
    "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "short": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}

LOW_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes amprewrite converts models to."""


def dtype_from_name(name: str | torch.dtype) -> torch.dtype | None:
    """The dtype ``name`` spells (``"fp16"``, ``"float16"``, ``"torch.float16"``, ``"half"``,
    any case), a dtype as it is, or None for a name not in :data:`DTYPE_NAMES`."""
    if isinstance(name, torch.dtype):
        return name
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return DTYPE_NAMES.get(key[len("torch."):] if key.startswith("torch.") else key)


def low_dtype_names() -> list[str]:
    """The names of bfloat16 and float16 in :data:`DTYPE_NAMES`, bfloat16's first."""
    return [n for d in LOW_DTYPES for n, v in DTYPE_NAMES.items() if v == d]


def low_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """The low-precision dtype ``name`` spells (bfloat16 or float16), else None."""
    dtype = dtype_from_name(name)
    return dtype if dtype in LOW_DTYPES else None
