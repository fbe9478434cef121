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

from .dtypes import DTYPE_NAMES, dtype_from_name
from .errors import AmpRewriteError

__all__ = ["UsageError", "is_input_spec", "load_batches", "load_target", "parse_input"]


class UsageError(AmpRewriteError):
    """Bad command-line usage; the CLI prints it on one line and exits with status 2."""


_SPEC = re.compile(r"^(?:(?P<dtype>[A-Za-z0-9.]+):)?(?P<shape>\d+(?:x\d+)*)"
                   r"(?::(?P<lo>-?[\d.]+(?:e-?\d+)?)-(?P<hi>-?[\d.]+(?:e-?\d+)?))?$")


def is_input_spec(text: str) -> bool:
    """Whether ``text`` has the form of an input spec (``int64:1x8:0-5``), not of a TARGET.

    >>> is_input_spec("int64:1x8:0-5"), is_input_spec("models.py:mlp")
    (True, False)
    """
    return _SPEC.match(text.strip()) is not None


def parse_input(spec: str, seed: int = 0) -> torch.Tensor:
    """A tensor from ``[dtype:]AxBxC[:lo-hi]``: random normal floats, or uniform integers.

    >>> parse_input("2x3").shape
    torch.Size([2, 3])
    >>> t = parse_input("int64:1x8:0-5"); (t.dtype, int(t.min()) >= 0, int(t.max()) < 5)
    (torch.int64, True, True)
    """
    m = _SPEC.match(spec.strip())
    dtype = dtype_from_name(m["dtype"] or "float32") if m is not None else None
    if m is None or dtype is None:
        raise UsageError(
            f"bad input spec '{spec}': write [dtype:]AxBxC[:lo-hi], e.g. 2x3x64x64 or "
            f"int64:1x1024:0-512 (dtypes: {', '.join(DTYPE_NAMES)})."
        )
    shape = tuple(int(s) for s in m["shape"].split("x"))
    if 0 in shape:
        raise UsageError(f"bad input spec '{spec}': a dimension of size 0 makes an empty "
                         "tensor; give every dimension a size of 1 or more.")
    g = torch.Generator().manual_seed(seed)
    if m["lo"] is not None:
        try:
            lo, hi = float(m["lo"]), float(m["hi"])
        except ValueError:
            raise UsageError(f"bad input spec '{spec}': the range must be two numbers, "
                             "lo-hi, e.g. 0-512 or -1-1.") from None
        if not dtype.is_floating_point:
            lo, hi = int(lo), int(hi)
        if hi <= lo:
            raise UsageError(f"bad input spec '{spec}': the range {m['lo']}-{m['hi']} is empty "
                             "(it must be lo-hi with lo < hi, e.g. 0-512).")
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g)
        if m["lo"] is not None:
            t = torch.rand(shape, generator=g) * (hi - lo) + lo
        return t.to(dtype)
    if m["lo"] is None:
        lo, hi = 0, 2
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def load_batches(spec: str) -> tuple:
    """``--calibration FILE.py:NAME``: the input batches NAME gives (called if callable)."""
    where, _, name = spec.rpartition(":")
    if not where:
        raise UsageError(f"--calibration '{spec}' must be path/to/file.py:NAME or "
                         "package.module:NAME, NAME an iterable of input batches or a "
                         "function returning one.")
    value = getattr(_import(where), name, None)
    if value is None:
        raise UsageError(f"{where} has no '{name}' for --calibration.")
    try:
        batches = value() if callable(value) else value
        return tuple(batches)
    except Exception as exc:
        raise UsageError(f"--calibration {spec} failed: {type(exc).__name__}: {exc}") from None


def _import(where: str):
    try:
        if where.endswith(".py") or os.sep in where:
            if not os.path.isfile(where):
                raise UsageError(f"no such file: {where}")
            spec = importlib.util.spec_from_file_location(
                f"amprewrite_target_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(where)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"cannot import {where}: {type(exc).__name__}: {exc}") from None


def load_target(target: str) -> tuple[nn.Module, tuple | None]:
    """Call the factory named by ``target``; return (model, example inputs or None)."""
    if ":" not in target:
        raise UsageError(f"TARGET '{target}' must be path/to/file.py:factory or "
                         "package.module:factory.")
    where, name = target.rsplit(":", 1)
    module = _import(where)
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
