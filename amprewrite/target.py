"""Load ``TARGET`` (``path/to/file.py:factory`` or ``package.module:factory``) and parse input
specs (``2x3x64x64``, ``int64:1x1024:0-512``) for the command line."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys

import torch
from torch import nn

from .errors import AmpRewriteError

__all__ = ["UsageError", "load_target", "parse_input"]


class UsageError(AmpRewriteError):
    """Bad command-line usage; the CLI prints it on one line and exits with status 2."""


_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float64": torch.float64, "int64": torch.int64,
           "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool,
           "uint8": torch.uint8}
_SPEC = re.compile(r"^(?:(?P<dtype>[a-z0-9]+):)?(?P<shape>\d+(?:x\d+)*)"
                   r"(?::(?P<lo>-?[\d.]+)-(?P<hi>-?[\d.]+))?$")


def parse_input(spec: str, seed: int = 0) -> torch.Tensor:
    """A tensor from ``[dtype:]AxBxC[:lo-hi]``: random normal floats, or uniform integers.

    >>> parse_input("2x3").shape
    torch.Size([2, 3])
    >>> t = parse_input("int64:1x8:0-5"); (t.dtype, int(t.min()) >= 0, int(t.max()) < 5)
    (torch.int64, True, True)
    """
    m = _SPEC.match(spec.strip())
    if m is None or (m["dtype"] and m["dtype"] not in _DTYPES):
        raise UsageError(
            f"bad input spec '{spec}': write [dtype:]AxBxC[:lo-hi], e.g. 2x3x64x64 or "
            f"int64:1x1024:0-512 (dtypes: {', '.join(sorted(_DTYPES))})."
        )
    dtype = _DTYPES[m["dtype"] or "float32"]
    shape = tuple(int(s) for s in m["shape"].split("x"))
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g)
        if m["lo"] is not None:
            lo, hi = float(m["lo"]), float(m["hi"])
            t = torch.rand(shape, generator=g) * (hi - lo) + lo
        return t.to(dtype)
    lo, hi = (int(float(m["lo"])), int(float(m["hi"]))) if m["lo"] is not None else (0, 2)
    if hi <= lo:
        raise UsageError(f"bad input spec '{spec}': the range {lo}-{hi} is empty.")
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def load_target(target: str) -> tuple[nn.Module, tuple | None]:
    """Call the factory named by ``target``; return (model, example inputs or None)."""
    if ":" not in target:
        raise UsageError(f"TARGET '{target}' must be path/to/file.py:factory or "
                         "package.module:factory.")
    where, name = target.rsplit(":", 1)
    try:
        if where.endswith(".py") or os.sep in where:
            if not os.path.isfile(where):
                raise UsageError(f"no such file: {where}")
            spec = importlib.util.spec_from_file_location(
                f"amprewrite_target_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"cannot import {where}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UsageError(f"{where} has no factory function '{name}'.")
    try:
        made = factory()
    except Exception as exc:
        raise UsageError(f"{target}() failed: {type(exc).__name__}: {exc}") from None
    model, inputs = (made if isinstance(made, tuple) and len(made) == 2
                     and isinstance(made[0], nn.Module) else (made, None))
    if not isinstance(model, nn.Module):
        raise UsageError(f"{target}() returned {type(model).__name__}, not an nn.Module or "
                         "(model, example_inputs).")
    if inputs is not None and not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return model, tuple(inputs) if inputs is not None else None
