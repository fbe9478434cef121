"""How much of PyTorch the op registry covers: every function and Tensor method in
``torch.overrides.get_overridable_functions()`` is in a family, on the reviewed list below of
names that fall to the fp32 default, or private.

>>> counts = coverage()
>>> counts["unreviewed"]
0
"""

from __future__ import annotations

import functools

import torch

from .ops import (
    FAMILIES,
    FP32_BY_DEFAULT,
    Family,
    Mixed,
    Precision,
    family_for_function,
    family_for_method,
)

__all__ = ["FP32_BY_DEFAULT", "coverage", "families_markdown", "overridable_ops", "torch_minor"]


def _name(fn: object) -> str:
    return getattr(fn, "__name__", None) or str(fn)


@functools.cache
def overridable_ops() -> tuple[tuple[str, str, object], ...]:
    """(namespace, name, callable) for every overridable function and Tensor method."""
    out = []
    for ns, fns in torch.overrides.get_overridable_functions().items():
        space = getattr(ns, "__name__", None)
        if not isinstance(space, str):
            continue  # Tensor properties (t.T, t.grad, ...): attributes, not calls
        for fn in fns:
            if not callable(fn):
                continue
            out.append((space, _name(fn), fn))
    return tuple(sorted(out, key=lambda t: (t[0], t[1])))


def status(space: str, name: str, fn: object) -> str:
    """'known' / 'not float' / 'fp32 by default' / 'private' / 'unreviewed'."""
    fam = family_for_method(name) if space == "Tensor" else family_for_function(fn)
    if fam is None and space != "Tensor" and name.endswith("_"):
        fam = family_for_function(getattr(torch, name[:-1], None))
    if fam is None and space != "Tensor":
        fam = family_for_method(name)
    if fam is not None:
        from .ops import Precision

        return "not float" if fam.precision == Precision.NONFLOAT else "known"
    if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
        return "private"
    if name in FP32_BY_DEFAULT:
        return "fp32 by default"
    return "unreviewed"


def coverage() -> dict[str, int]:
    """Counts per status over :func:`overridable_ops`."""
    counts = dict.fromkeys(("known", "not float", "fp32 by default", "private", "unreviewed"), 0)
    for space, name, fn in overridable_ops():
        counts[status(space, name, fn)] += 1
    return counts


def torch_minor() -> str:
    """This torch's ``major.minor`` (``"2.13"``)."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def families_markdown() -> str:
    """The op-family table as Markdown (docs/families.md is this output)."""
    def spell(f: Family) -> str:
        names = [f"`{_spelled(fn)}`" for fn in f.functions]
        names += [f"`Tensor.{m}`" for m in f.methods]
        names += [f"`nn.{m.__name__}`" for m in f.modules]
        names += [f"`torch.ops.{n.replace('::', '.')}`" if '::' in n else f"`{n}`"
                  for n in f.op_names]
        return ", ".join(names)

    counts = coverage()
    lines = [
        "# Op families and precision classes",
        "",
        f"Generated on torch {torch_minor()} from `amprewrite/precision/ops.py` by "
        "`amprewrite families > docs/families.md`;",
        "a test fails when this file and the registry disagree. On another torch the counts",
        "and the spellings that only one of the two torches has differ (torch 2.14 adds",
        "`torch.linalg.matrix_sqrth` and `torch.linalg.polar`).",
        "",
        "An op the registry does not know runs in **fp32** with its inputs cast up, and the",
        "report names it (`unknown op 'torch.foo': fp32; allow_low=['node:…'] to override`).",
        "Unknown leaf modules run in fp32 on their own fp32 parameters. `bounded` families end a",
        "position cone; `indices` families read integer inputs as indices, so they start none.",
        "Before a node runs in low precision, its kernel is probed once per (op, dtype, device):",
        "a missing or wrong low-precision kernel makes it an fp32 island.",
        "An FP32 family with a mixed signature (`reads low, writes low` or `reads low with",
        "dtype=float32`) computes in float32 from a low input without an fp32 copy of it, where",
        "the kernel probe confirms the signature on the target device (guide, \"Compute dtype",
        "and storage dtype\").",
        "",
        "## Coverage of `torch.overrides.get_overridable_functions()`",
        "",
        "| | functions and Tensor methods |",
        "|---|---|",
        f"| in a family, float results | {counts['known']} |",
        f"| in a family, no float results (`nonfloat`) | {counts['not float']} |",
        f"| fp32 by default (reviewed list in `amprewrite/precision/coverage.py`) | "
        f"{counts['fp32 by default']} |",
        f"| private (`_name`), not counted | {counts['private']} |",
        "",
    ]
    for cls in Precision:
        fams = [f for f in FAMILIES.values() if f.precision == cls]
        if not fams:
            continue
        lines += [f"## {cls.name}", "", "| family | notes | spellings |", "|---|---|---|"]
        for f in fams:
            notes = [n for n, on in (("bounded", f.bounded), ("indices", not f.numeric),
                                     ("per-node", f.classify is not None or f.refine is not None),
                                     ("random", f.random), ("needs float", f.needs_float))
                     if on]
            notes += [_MIXED_NOTE[m] for m in f.mixed]
            if f.why:
                notes.append(f.why)
            lines.append(f"| `{f.name}` | {', '.join(notes)} | {spell(f)} |")
        lines.append("")
    return "\n".join(lines)


_MIXED_NOTE = {Mixed.LOW_IO: "reads low, writes low (fp32 weights, computes in fp32)",
               Mixed.DTYPE_ARG: "reads low with dtype=float32",
               Mixed.FP32_HELPER: "else a runtime helper: reads and saves low, computes in fp32"}


# Where users reach the functions, searched in this order: a function is spelled by the first
# public name that holds it (``torch.linalg.inv``, not ``torch._C._linalg.linalg_inv``), a name
# that stays put when torch moves the code behind it (torch 2.14 moved ``torch.cholesky`` into
# ``torch._linalg_utils``).
_PUBLIC = (("torch", torch), ("torch.nn.functional", torch.nn.functional),
           ("torch.special", torch.special), ("torch.linalg", torch.linalg),
           ("torch.fft", torch.fft), ("torch._C._nn", torch._C._nn))


@functools.cache
def _public_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for prefix, space in _PUBLIC:
        for attr, value in vars(space).items():
            if callable(value) and not attr.startswith("_"):
                names.setdefault(id(value), f"{prefix}.{attr}")
    return names


def _spelled(fn: object) -> str:
    public = _public_names().get(id(fn))
    if public is not None:
        return public
    module = getattr(fn, "__module__", None) or "torch"
    module = {"_operator": "operator", "torch._C._VariableFunctions": "torch"}.get(module, module)
    return f"{module}.{getattr(fn, '__name__', fn)}"
