"""Whose failure is it: a capture that fails is told apart as the user's (the model fails
without amprewrite too, or its example inputs do), dynamo's (a plain export of the same model
fails the same way) or amprewrite's own, and the error says what to do for each.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import traceback
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import AmpRewriteError, CaptureError
from ..graph.graphmodule import (
    sources_die_with_code,
)
from ..graph.shapes import split_inputs
from .dynamo_state import (
    no_recompile_limit,
    private_top_frame,
    quiet_capture_loggers,
    release_export_state,
)

_TORCH_DIR = os.path.dirname(torch.__file__)
# amprewrite's own code: the package's folder (this file is in amprewrite/capture/).
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame in user code (not torch, not amprewrite)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH_DIR) and not path.startswith(_OWN_DIR):
            return frame
    return None


def symbolic_cause(text: str) -> str:
    """What a symbolic-trace failure means, from its message."""
    if "Proxy" in text and "assignment" in text:
        return ("The model assigns into a tensor or attribute being traced (x[i] = v, "
                "config.x = t), which torch.fx.symbolic_trace cannot record.")
    if "control flow" in text or "iterate" in text or "bool" in text.lower():
        return ("torch.fx.symbolic_trace cannot follow Python control flow or loops on tensor "
                "shapes or values.")
    return "torch.fx.symbolic_trace cannot trace this construct."


def raise_if_own(model: nn.Module, exc: BaseException) -> None:
    """A failure raised by amprewrite's own code around the export (the structural copy, the
    quiet loggers) is amprewrite's, not dynamo's: say so. Errors amprewrite raises on purpose
    pass through."""
    if isinstance(exc, AmpRewriteError):
        raise exc
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and os.path.abspath(frames[-1].filename).startswith(_OWN_DIR):
        raise CaptureError(_own_failure(model, exc)) from exc


def raise_if_plain_export_works(model: nn.Module, args: tuple, kwargs: dict,
                                 error: BaseException) -> None:
    """Before blaming dynamo, export a deep copy of the model exactly as a user would
    (``torch._dynamo.export(model)(*args)``). If that works, the failure is amprewrite's. The
    export's caches and guards are released as after a capture."""
    try:
        with (warnings.catch_warnings(), quiet_capture_loggers(), no_recompile_limit(),
              private_top_frame(), release_export_state(), sources_die_with_code()):
            warnings.simplefilter("ignore")
            torch._dynamo.export(copy.deepcopy(model), assume_static_by_default=True)(
                *args, **kwargs)
    except Exception:
        return
    raise CaptureError(_own_failure(model, error)) from error


def _own_failure(model: nn.Module, exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return (
        f"amprewrite could not capture {type(model).__name__}: {type(exc).__name__}: "
        f"{first.rstrip('.')}. This is a bug in amprewrite, not in the model or in torch dynamo: "
        "torch._dynamo.export captures the same model on these inputs. Please report it with "
        "the model's class; meanwhile, transform without example_inputs (symbolic tracing) or "
        "compile with torch.compile's default backend under torch.autocast."
    )


def capture_advice(text: str, out: object) -> str:
    """What to do about a capture dynamo refused, from its message and the eager output."""
    caches = sorted({type(v).__name__ for v in _leaves(out)
                     if type(v).__module__.startswith("transformers")
                     and type(v).__name__.endswith("Cache")})
    if caches:
        return (f"It returns a transformers {caches[0]} (use_cache=True, the model's default), "
                "which amprewrite returns from the graph through transformers.exporters' pytree "
                "registration of caches, here not enough. Add 'use_cache': False to the keyword "
                "inputs ({'input_ids': ids, 'use_cache': False}), or set "
                "model.config.use_cache = False before transforming; for generate(), "
                "amprewrite.for_generation(model) keeps the cache outside the graph.")
    lowered = text.lower()
    if "data-dependent" in lowered or "data dependent" in lowered:
        return ("Its control flow or output shapes depend on tensor values (a detection model's "
                "boxes, a branch on x.sum() > 0), which one graph cannot hold: "
                "torch.compile(model, backend='amprewrite') splits the model at those points and "
                "transforms every graph; or write the branch with torch.where or torch.cond.")
    if "pytree" in lowered or "output" in lowered:
        return ("It returns a type dynamo cannot return from a graph: register it with "
                "torch.utils._pytree.register_pytree_node, or return tensors, tuples or dicts.")
    return ("It has a construct dynamo cannot capture as one graph: rewrite the construct "
            "dynamo names, or use torch.compile(model, backend='amprewrite'), which splits the "
            "model at graph breaks and transforms every graph.")


def _leaves(value: object, depth: int = 0) -> list[object]:
    """The objects in a model output (through tuples, lists, dicts and dataclass fields)."""
    if depth > 20:
        return []
    if isinstance(value, Mapping):
        children = list(value.values())
    elif isinstance(value, (tuple, list)):
        children = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return [value]
    return [leaf for child in children for leaf in _leaves(child, depth + 1)]


def fails_without_amprewrite(model: nn.Module, kwargs: dict, failure: str) -> CaptureError:
    """The error for example inputs the fp32 model itself fails on (``failure``: why, as
    :func:`eager_failure` says it)."""
    call = "model(**example_inputs)" if kwargs else "model(*example_inputs)"
    return CaptureError(f"{type(model).__name__} fails on the given example_inputs even without "
                        f"amprewrite: {failure}. Fix the model or the inputs; {call} must run in "
                        "fp32.")


def eager_failure(model: nn.Module, example_inputs: object) -> CaptureError | None:
    """:func:`fails_without_amprewrite`'s error when the fp32 model fails on
    ``example_inputs`` (run on a copy: no state changes), else None. A capture runs the model
    on fake tensors, which do not check values: an embedding index out of range fails only at
    the first real run, in the passes."""
    args, kwargs = split_inputs(example_inputs)
    failure, _ = eager_run(model, args, kwargs)
    return None if failure is None else fails_without_amprewrite(model, kwargs, failure)


def eager_run(model: nn.Module, args: tuple, kwargs: dict) -> tuple[str | None, object]:
    """Run the model eagerly on a copy (no state changes): (why it fails or None, output)."""
    try:
        with torch.no_grad():
            return None, copy.deepcopy(model)(*args, **kwargs)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}", None
