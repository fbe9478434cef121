"""Every way an integer tensor becomes floats starts a position cone, whatever its spelling.

The spellings are enumerated from torch itself: the overloads of ``aten::to``, ``aten::type_as``
and ``aten::copy_`` (their schemas say which argument is what), ``Tensor.type``'s argument
forms, every ``Tensor.new_*`` factory, and every op with a ``dtype=`` argument that reads a
tensor's values (found by calling it). Each one turns positions 0..4095 into floats that feed
a matmul; in bf16 only 769 of them would stay distinct. The transformed graph must keep as many
distinct values as the fp32 model, in train and eval mode, with and without example inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.errors import CaptureError
from amprewrite.graph import meta as M

N = 4096  # positions 0..N-1; bf16 keeps 769 of them distinct, fp32 all
F32 = torch.float32
Spelling = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (positions, fp32 buffer)


def _schema_call(schema: torch._C.FunctionSchema, op: str) -> tuple[list, dict] | None:
    """Arguments (after ``self``) that convert to fp32 for one overload, or None."""
    args, kwargs = [], {}
    for a in schema.arguments[1:]:
        source = "POS" if op == "copy_" else "BUF"  # copy_'s other/src is what it writes
        value = {"dtype": F32, "other": source, "src": source,
                 "device": torch.device("cpu")}.get(a.name)
        if value in ("POS", "BUF") and "Tensor" not in str(a.type):
            return None  # an overload for scalars (copy_.int): no integer tensor to convert
        if value is None:
            if a.has_default_value():
                continue
            return None  # an overload for scalars (copy_.int): no integer tensor to convert
        if a.name == "dtype" and a.kwarg_only and not str(a.type).startswith("Optional"):
            return None
        (kwargs.__setitem__(a.name, value) if a.kwarg_only else args.append(value))
    return args, kwargs


def _bind(values: list | dict, pos: torch.Tensor, buf: torch.Tensor):
    pick = {"BUF": buf, "POS": pos}
    if isinstance(values, dict):
        return {k: pick.get(v, v) if isinstance(v, str) else v for k, v in values.items()}
    return [pick.get(v, v) if isinstance(v, str) else v for v in values]


def _overloads(op: str) -> dict[str, Spelling]:
    out: dict[str, Spelling] = {}
    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{op}"):
        call = _schema_call(schema, op)
        if call is None:
            continue
        args, kwargs = call
        name = f"{op}.{schema.overload_name or 'default'}"
        if op == "copy_":  # writes the positions into a fresh fp32 tensor
            def fn(pos, buf, a=args, k=kwargs):
                return torch.empty(pos.shape[0], device=pos.device).copy_(
                    *_bind(a, pos, buf), **_bind(k, pos, buf))
        else:
            def fn(pos, buf, op=op, a=args, k=kwargs):
                return getattr(pos, op)(*_bind(a, pos, buf), **_bind(k, pos, buf))
        out[name] = fn
    return out


def _type_forms() -> dict[str, Spelling]:
    """``Tensor.type`` takes a dtype, a tensor type or its name (``Tensor.type.__doc__``)."""
    tensor_type = next(t for t in torch._tensor_classes if t.dtype == F32
                       and t.__module__ == "torch")
    forms = {"dtype": F32, "class": tensor_type,
             "name": f"{tensor_type.__module__}.{tensor_type.__name__}"}
    return {f"type({k})": (lambda pos, buf, v=v: pos.type(v)) for k, v in forms.items()}


def _new_factories() -> dict[str, Spelling]:
    """Every ``Tensor.new_*``: the new fp32 tensor is given the positions' values."""
    out: dict[str, Spelling] = {}
    for name in sorted(m for m in dir(torch.Tensor) if m.startswith("new_")):
        if name == "new_tensor":
            out[name] = lambda pos, buf: buf.new_tensor(pos)
        elif name in ("new_empty", "new_empty_strided"):
            extra = ((1,),) if name == "new_empty_strided" else ()
            out[name] = (lambda pos, buf, name=name, extra=extra:
                         getattr(buf, name)((pos.shape[0],), *extra).copy_(pos))
        else:
            extra = (0.0,) if name == "new_full" else ()
            out[name] = (lambda pos, buf, name=name, extra=extra:
                         getattr(buf, name)((pos.shape[0],), *extra) + pos)
    return out


def _dtype_ops() -> dict[str, Spelling]:
    """Ops of ``torch`` with a ``dtype=`` argument whose fp32 result is made of an integer
    tensor's values: positions given ``dtype=torch.float32`` (factories, reductions along a dim
    such as cumsum of a mask, conversions). Found by calling each on a probe."""
    out: dict[str, Spelling] = {}
    probe = torch.arange(6)
    for name in sorted(dir(torch)):
        fn = getattr(torch, name)
        if name.startswith("_") or name.endswith("_like") or not callable(fn) or isinstance(
                fn, type):
            continue  # *_like reads only its input's metadata, never its values
        try:
            schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
        except RuntimeError:
            schemas = []
        if not any(a.name == "dtype" for s in schemas for a in s.arguments) and name not in (
                "tensor", "as_tensor", "asarray"):
            continue
        for extra in ((), (0,)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    a = fn(probe, *extra, dtype=F32)
                    b = fn(probe + 1, *extra, dtype=F32)
            except Exception:
                continue
            if (isinstance(a, torch.Tensor) and a.dtype == F32 and a.shape == probe.shape
                    and not torch.equal(a, b)):
                out[f"torch.{name}(dtype=)"] = (lambda pos, buf, fn=fn, extra=extra:
                                                fn(pos, *extra, dtype=F32))
                break
    # Grids born as floats: factories whose dtype= makes the positions themselves.
    out["torch.arange(dtype=)"] = lambda pos, buf: torch.arange(pos.shape[0], dtype=F32)
    out["torch.linspace"] = lambda pos, buf: torch.linspace(0, pos.shape[0] - 1, pos.shape[0])
    return out


def _arithmetic() -> dict[str, Spelling]:
    """Type promotion: an integer tensor meets a float tensor or a float scalar."""
    return {"pos * fp32 tensor": lambda pos, buf: pos * buf.new_ones(()),
            "fp32 zeros + pos": lambda pos, buf: torch.zeros(pos.shape[0]) + pos,
            "pos * 1.0": lambda pos, buf: pos * 1.0,
            "torch.where(mask, pos, fp32)": lambda pos, buf: torch.where(
                pos >= 0, pos, torch.zeros(pos.shape[0])),
            "setitem into fp32": lambda pos, buf: _setitem(pos)}


def _setitem(pos: torch.Tensor) -> torch.Tensor:
    t = torch.zeros(pos.shape[0])
    t[:] = pos
    return t


def _converts_positions(fn: Spelling) -> bool:
    """Does the spelling give fp32 values that keep more positions apart than bf16 can?

    Drops overloads that convert nothing (``to.prim_other`` copies) and ops whose result is
    not made of the positions (``cumprod`` of 0, 1, ... is all zeros)."""
    out = fn(torch.arange(N), torch.tensor([1.0, 0.1, 0.01, 0.001]))
    return out.dtype == F32 and out.unique().numel() > 769


SPELLINGS: dict[str, Spelling] = {
    name: fn for name, fn in {**_overloads("to"), **_overloads("type_as"),
                              **_overloads("copy_"), **_type_forms(), **_new_factories(),
                              **_dtype_ops(), **_arithmetic()}.items()
    if _converts_positions(fn)}
# torch.fx cannot trace these without example inputs: buf.new_tensor(proxy) and
# torch.tensor/asarray(proxy) read the proxy as data before fx sees it, and a Proxy takes no
# item assignment. They must refuse with a clear error that says to pass example inputs.
SYMBOLIC_REFUSES = {"new_tensor", "torch.tensor(dtype=)", "torch.asarray(dtype=)",
                    "torch.as_tensor(dtype=)", "setitem into fp32"}


class Angles(nn.Module):
    """``outer(positions, inv_freq)`` the way RoPE makes its angles, spelled ``spell``."""

    def __init__(self, spell: Spelling):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.1, 0.01, 0.001]))
        self.spell = spell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[0], device=x.device) + x.shape[0] * 0  # integer positions
        return torch.outer(self.spell(pos, self.inv_freq), self.inv_freq) + x[:, None]


def test_the_enumeration_finds_the_spellings_the_issue_names():
    names = set(SPELLINGS)
    assert {"to.dtype", "to.other", "to.device", "to.dtype_layout", "type_as.default",
            "copy_.default", "type(dtype)", "type(class)", "new_tensor", "new_zeros",
            "torch.cumsum(dtype=)", "torch.as_tensor(dtype=)"} <= names, sorted(names)
    assert len(names) >= 25


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("capture", ["symbolic", "dynamo"])
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_positions_stay_distinct_in_bf16(name, capture, mode):
    model = getattr(Angles(SPELLINGS[name]), mode)()
    x = torch.zeros(N)
    want = model(x)[:, 0].unique().numel()
    assert want > 769  # the fp32 model keeps what bf16 would collide
    try:
        gm = amprewrite.transform(model, dtype=torch.bfloat16,
                                  example_inputs=(x,) if capture == "dynamo" else None,
                                  verify=False)
    except CaptureError as exc:
        assert capture == "symbolic" and name in SYMBOLIC_REFUSES, exc
        assert "example_inputs" in str(exc)
        return
    assert not (capture == "symbolic" and name in SYMBOLIC_REFUSES), "traced now: list it"
    got = gm(x)[:, 0].unique().numel()
    assert got == want, (name, got, want, [(n.name, n.meta.get(M.CLASS), n.meta.get(M.REASON))
                                           for n in gm.graph.nodes if M.CLASS in n.meta])
