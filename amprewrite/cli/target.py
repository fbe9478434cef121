"""Load ``TARGET`` (``path/to/file.py:factory`` or ``package.module:factory``) and parse input
specs (``2x3x64x64``, ``int64:1x1024:0-512``) for the command line.

Checking a TARGET's form and file (:func:`check_target`) and an input spec
(:func:`check_input_spec`) imports no torch, so the command line reports such a usage error at
once; loading the model and making the tensors import it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AmpRewriteError, UsageError
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


@dataclass
class Target:
    model: object
    inputs: tuple | dict | None  # a dict: keyword inputs (model(**inputs))
    where: str  # what the inputs are, for messages: "--inputs 4x16" or "the inputs f() returns"
    flags: list[str] = field(default_factory=list)  # --inputs ... to repeat in suggestions


def load(args: argparse.Namespace, need_inputs: bool) -> Target:
    from ..capture.trace import check_model

    model, inputs = load_target(args.target)
    where = f"the example inputs {args.target}() returns"
    flags: list[str] = []
    if args.inputs:
        if inputs is not None:  # said, not silent: the factory's own inputs are set aside
            print(f"note: --inputs replaces the example inputs {args.target}() returns "
                  f"({describe(inputs)})", file=sys.stderr)
        inputs = tuple(parse_input(s, seed=i) for i, s in enumerate(args.inputs))
        where, flags = f"--inputs {' '.join(args.inputs)}", ["--inputs", *args.inputs]
    if need_inputs and inputs is None:
        raise UsageError(f"{args.target} gives no example inputs: pass --inputs, e.g. "
                         "--inputs 2x3x64x64 int64:2x16:0-1000.")
    check_model(model)  # a meta-device model is the model's problem, whatever the inputs
    return Target(model, inputs, where, flags)


def describe(inputs: object) -> str:
    import torch
    from torch.utils import _pytree as pytree

    shown = [f"{str(t.dtype).replace('torch.', '')}[{','.join(map(str, t.shape))}]"
             for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return ", ".join(shown) or "no tensors"


def plain_failure(target: Target) -> str | None:
    """Why the model fails on the inputs without amprewrite, or None when it runs."""
    import torch

    inputs = target.inputs
    try:
        with torch.no_grad():
            if isinstance(inputs, dict):
                target.model(**inputs)
            else:
                target.model(*inputs)
    except Exception as exc:
        return f"{type(exc).__name__}: {first_line(exc)}"
    return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def attempt(what: str, fn, target: Target):
    """Run a step; on failure say whose fault it is: the model's on these inputs (it fails
    without amprewrite too) or amprewrite's (it runs in fp32)."""
    try:
        return fn()
    except Exception as exc:
        if target.inputs is not None and not isinstance(exc, UsageError):
            plain = plain_failure(target)
            if plain is not None:
                fix = ("give --inputs the shapes and dtypes the model's forward takes (a dtype "
                       "prefix makes integers: int64:1x128:0-1000)" if target.flags else
                       "fix the model or the inputs the factory returns (or pass --inputs)")
                raise UsageError(
                    f"the model fails on {target.where} ({describe(target.inputs)}) without "
                    f"amprewrite, so this is not an amprewrite failure: {plain}. To fix it, "
                    f"{fix}.") from None
        if isinstance(exc, AmpRewriteError):
            raise
        raise UsageError(
            f"amprewrite failed while {what} a model that runs on these inputs in fp32: "
            f"{type(exc).__name__}: {first_line(exc)}. This is amprewrite's fault: please "
            "report it with this command line (AMPREWRITE_DEBUG=1 adds checks after each "
            "pass).") from None


def policy_of(args: argparse.Namespace, **changes):
    from ..precision.policy import Policy

    # dump shows the graph and check measures its error itself: neither stops at verification.
    return Policy(dtype=args.dtype, upsample=getattr(args, "upsample", "auto"), verify=False,
                  **{**selector_flags(args), **changes})


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def out_folder(out: str, flag: str = "--out") -> Path:
    """``out`` as a folder the command can write into, checked before any model work."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {shlex.quote(out)} is a file, and the command writes several "
                         f"files into a folder: give {flag} a folder name (new or existing).")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {shlex.quote(out)} lies under {shlex.quote(str(parent))}, "
                         f"which is a file: give {flag} a folder that can be made.")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {shlex.quote(out)}: {shlex.quote(str(parent))} is not "
                         f"writable; give {flag} a folder you can write to.")
    return path


def selector_flags(args: argparse.Namespace) -> dict:
    """transform's keep_fp32 / allow_low / calibration / overflow / fp8 / plan keywords from
    the common flags."""
    out: dict = {"keep_fp32": tuple(getattr(args, "keep_fp32", ()) or ()),
                 "allow_low": tuple(getattr(args, "allow_low", ()) or ()),
                 "overflow": getattr(args, "overflow", "auto")}
    spec = getattr(args, "calibration", None)
    if spec:
        from .target import load_batches

        out["calibration"] = load_batches(spec)
    if getattr(args, "plan", None):
        out["plan"] = args.plan
    recipe = getattr(args, "fp8", None)
    if recipe is not None or getattr(args, "fp8_any_size", False):
        out["fp8"] = {"recipe": recipe or "tensorwise",
                      **({"min_speedup": 0.0} if getattr(args, "fp8_any_size", False) else {})}
    return out
