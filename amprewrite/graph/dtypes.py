"""The one table of dtype names: every flag and keyword that takes a dtype reads it here, so
``--dtype float16``, ``--inputs float16:2x3`` and ``transform(dtype="half")`` accept the same
spellings.

>>> import torch
>>> dtype_from_name("half")
torch.float16
>>> low_dtype("BF16")
torch.bfloat16
>>> low_dtype(torch.float16)
torch.float16
>>> low_dtype_name("half")  # without torch: what the command line checks its flags with
'float16'

The names themselves are a table of strings, so that the command line parses and checks its
flags (and answers ``--help``) without importing torch; :data:`DTYPE_NAMES` and
:data:`LOW_DTYPES` import it on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "LOW_DTYPES", "NAMES", "dtype_from_name", "dtype_name", "low_dtype",
           "low_dtype_name", "low_dtype_names"]

# Names as torch spells them (``torch.float16``, ``"float16"``, the alias ``"half"``) plus the
# short forms in common use (``fp16``, ``bf16``), each with the torch attribute it names. Lower
# case; lookups fold case.
NAMES: dict[str, str] = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64",
    "int64": "int64", "long": "int64",
    "int32": "int32", "int": "int32",
    "int16": "int16", "short": "int16",
    "int8": "int8", "uint8": "uint8",
    "bool": "bool",
}

_LOW = ("bfloat16", "float16")  # the dtypes amprewrite converts models to, bfloat16's first

# Declared, not assigned: module __getattr__ makes them on first use (importing torch).
DTYPE_NAMES: dict[str, torch.dtype]
LOW_DTYPES: tuple[torch.dtype, ...]


def __getattr__(name: str) -> object:
    # Only these two import torch (the import system asks for others, such as __path__).
    if name not in ("DTYPE_NAMES", "LOW_DTYPES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    torch = importlib.import_module("torch")
    if name == "DTYPE_NAMES":  # name -> torch.dtype, as before the table became strings
        value: object = {n: getattr(torch, attr) for n, attr in NAMES.items()}
    else:  # the dtypes amprewrite converts models to
        value = tuple(getattr(torch, attr) for attr in _LOW)
    globals()[name] = value
    return value


def dtype_name(name: object) -> str | None:
    """The torch attribute ``name`` spells (``"fp16"``, ``"torch.float16"``, ``"half"``, any
    case: ``"float16"``), or None for a name not in :data:`NAMES`. Imports no torch."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return NAMES.get(key[len("torch."):] if key.startswith("torch.") else key)


def dtype_from_name(name: str | torch.dtype) -> torch.dtype | None:
    """The dtype ``name`` spells (``"fp16"``, ``"float16"``, ``"torch.float16"``, ``"half"``,
    any case), a dtype as it is, or None for a name not in :data:`NAMES`."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    attr = dtype_name(name)
    return None if attr is None else getattr(torch, attr)


def low_dtype_names() -> list[str]:
    """The names of bfloat16 and float16 in :data:`NAMES`, bfloat16's first."""
    return [n for low in _LOW for n, attr in NAMES.items() if attr == low]


def low_dtype_name(name: str) -> str | None:
    """``"bfloat16"`` or ``"float16"`` for a name of either, else None. Imports no torch."""
    attr = dtype_name(name)
    return attr if attr in _LOW else None


def low_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """The low-precision dtype ``name`` spells (bfloat16 or float16), else None."""
    dtype = dtype_from_name(name)
    return dtype if dtype is not None and str(dtype).replace("torch.", "") in _LOW else None
