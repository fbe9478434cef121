"""Load ``TARGET`` (``path/to/file.py:factory`` or ``package.module:factory``) and parse input
specs (``2x3x64x64``, ``int64:1x1024:0-512``) for the command line.

Checking a TARGET's form and file (:func:`check_target`) and an input spec
(:func:`check_input_spec`) imports no torch, so the command line reports such a usage error at
once; loading the model and making the tensors import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..graph.dtypes import NAMES, dtype_name

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["UsageError", "check_input_spec", "check_target", "is_input_spec", "load_batches",
           "load_target", "parse_input"]


_SPEC = re.compile(r"^(?:(?P<dtype>[A-Za-z0-9.]+):)?(?P<shape>\d+(?:x\d+)*)"
                   r"(?::(?P<lo>-?[\d.]+(?:e-?\d+)?)-(?P<hi>-?[\d.]+(?:e-?\d+)?))?$")

_FLOATS = ("bfloat16", "float16", "float32", "float64")


def is_input_spec(text: str) -> bool:
    """Whether ``text`` has the form of an input spec (``int64:1x8:0-5``), not of a TARGET.

    >>> is_input_spec("int64:1x8:0-5"), is_input_spec("models.py:mlp")
    (True, False)
    """
    return _SPEC.match(text.strip()) is not None


def check_input_spec(spec: str) -> tuple[str, tuple[int, ...], tuple[float, float] | None]:
    """The dtype (torch's attribute name), shape and value range (or None) that ``spec``
    describes; a :class:`UsageError` for a spec :func:`parse_input` would refuse. Imports no
    torch.

    >>> check_input_spec("int64:1x8:0-5")
    ('int64', (1, 8), (0, 5))
    """
    m = _SPEC.match(spec.strip())
    dtype = dtype_name(m["dtype"] or "float32") if m is not None else None
    if m is None or dtype is None:
        raise UsageError(
            f"bad input spec '{spec}': write [dtype:]AxBxC[:lo-hi], e.g. 2x3x64x64 or "
            f"int64:1x1024:0-512 (dtypes: {', '.join(NAMES)})."
        )
    shape = tuple(int(s) for s in m["shape"].split("x"))
    if 0 in shape:
        raise UsageError(f"bad input spec '{spec}': a dimension of size 0 makes an empty "
                         "tensor; give every dimension a size of 1 or more.")
    if m["lo"] is None:
        return dtype, shape, None
    try:
        lo, hi = float(m["lo"]), float(m["hi"])
    except ValueError:
        raise UsageError(f"bad input spec '{spec}': the range must be two numbers, "
                         "lo-hi, e.g. 0-512 or -1-1.") from None
    if dtype not in _FLOATS:
        lo, hi = int(lo), int(hi)
    if hi <= lo:
        raise UsageError(f"bad input spec '{spec}': the range {m['lo']}-{m['hi']} is empty "
                         "(it must be lo-hi with lo < hi, e.g. 0-512).")
    return dtype, shape, (lo, hi)


def parse_input(spec: str, seed: int = 0) -> torch.Tensor:
    """A tensor from ``[dtype:]AxBxC[:lo-hi]``: random normal floats, or uniform integers.

    >>> parse_input("2x3").shape
    torch.Size([2, 3])
    >>> t = parse_input("int64:1x8:0-5"); (t.dtype, int(t.min()) >= 0, int(t.max()) < 5)
    (torch.int64, True, True)
    """
    import torch

    name, shape, bounds = check_input_spec(spec)
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        if bounds is None:
            return torch.randn(shape, generator=g).to(dtype)
        lo, hi = bounds
        return (torch.rand(shape, generator=g) * (hi - lo) + lo).to(dtype)
    lo, hi = bounds if bounds is not None else (0, 2)
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


def check_target(target: str) -> None:
    """A :class:`UsageError` for a TARGET that cannot name a factory (no ``:``) or whose file
    does not exist, before anything is imported. Imports no torch."""
    if ":" not in target:
        raise UsageError(f"TARGET '{target}' must be path/to/file.py:factory or "
                         "package.module:factory.")
    where = target.rsplit(":", 1)[0]
    if (where.endswith(".py") or os.sep in where) and not os.path.isfile(where):
        raise UsageError(f"no such file: {where}")


def load_target(target: str) -> tuple[nn.Module, tuple | dict | None]:
    """Call the factory named by ``target``; return (model, example inputs or None).

    The factory returns a model, or ``(model, example_inputs)`` with ``example_inputs`` a
    tuple (or list) of positional inputs, one input, or a dict of keyword inputs
    (``{"input_ids": ids, "attention_mask": mask}``, called as ``model(**inputs)``), the forms
    :func:`amprewrite.transform` takes. A dict stays a dict.
    """
    from torch import nn

    check_target(target)
    where, name = target.rsplit(":", 1)
    module = _import(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        import difflib

        functions = [n for n, v in vars(module).items()
                     if callable(v) and not isinstance(v, type) and not n.startswith("_")]
        close = difflib.get_close_matches(name, functions, n=1)
        raise UsageError(f"{where} has no factory function '{name}'"
                         + (f"; did you mean '{close[0]}'?" if close else "."))
    try:
        made = factory()
    except Exception as exc:
        raise UsageError(f"{target}() failed: {type(exc).__name__}: {exc}") from None
    model, inputs = (made if isinstance(made, tuple) and len(made) == 2
                     and isinstance(made[0], nn.Module) else (made, None))
    if not isinstance(model, nn.Module):
        raise UsageError(f"{target}() returned {type(model).__name__}, not an nn.Module or "
                         "(model, example_inputs).")
    if inputs is None:
        return model, None
    if isinstance(inputs, Mapping):  # keyword inputs, as transform(example_inputs={...})
        if not all(isinstance(k, str) for k in inputs):
            raise UsageError(f"{target}() returned a dict of example inputs whose keys are not "
                             "all strings: a dict holds keyword inputs, keyed by the names of "
                             "the model's forward arguments.")
        return model, dict(inputs)
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
