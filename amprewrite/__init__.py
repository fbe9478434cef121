"""amprewrite: a graph-rewriting mixed-precision compiler for PyTorch.

>>> import torch, amprewrite
>>> gm = amprewrite.transform(torch.nn.Linear(4, 2), dtype="bf16")
>>> gm(torch.randn(3, 4)).dtype
torch.float32

``import amprewrite`` imports no torch: each public name loads its module on first use
(PEP 562). That keeps the command line's start (``--help``, usage errors, Ctrl-C while torch
loads) in the CLI's hands, and a script pays for what it uses.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from .api import transform
    from .compile.backend import amprewrite_backend, backend
    from .compile.generation import for_generation
    from .compile.optimizer import optimizer
    from .compile.scaler import GradScaler
    from .compile.sharding import fully_shard
    from .errors import (
        AmpRewriteError,
        AutocastIgnoredWarning,
        CaptureError,
        ModelError,
        ModeSwitchError,
        NotVerifiedWarning,
        PassError,
        PolicyError,
        ShapeError,
        SignatureError,
        VerificationError,
    )
    from .precision.float8 import Float8
    from .precision.ops import FAMILIES, Family, Precision, override_families, register_family
    from .precision.plan_file import save_plan
    from .precision.policy import Policy
    from .precision.report import CompiledReport, Decision, Report, Rewrite, report
    from .precision.saved_plan import load_plan
    from .show.numerics import CheckResult, NodeError, check_numerics, find_fp32_nodes

# Public name -> the module that defines it.
_EXPORTS = {
    "transform": "api",
    "amprewrite_backend": "compile.backend", "backend": "compile.backend",
    **dict.fromkeys(("AmpRewriteError", "AutocastIgnoredWarning", "CaptureError", "ModelError",
                     "ModeSwitchError",
                     "NotVerifiedWarning", "PassError", "PolicyError", "ShapeError",
                     "SignatureError", "VerificationError"), "errors"),
    "Float8": "precision.float8",
    "for_generation": "compile.generation",
    "optimizer": "compile.optimizer",
    "GradScaler": "compile.scaler",
    **dict.fromkeys(("CheckResult", "NodeError", "check_numerics", "find_fp32_nodes"),
                    "show.numerics"),
    **dict.fromkeys(("FAMILIES", "Family", "Precision", "override_families",
                     "register_family"), "precision.ops"),
    "Policy": "precision.policy",
    "save_plan": "precision.plan_file",
    "load_plan": "precision.saved_plan",
    **dict.fromkeys(("CompiledReport", "Decision", "Report", "Rewrite", "report"),
                    "precision.report"),
    "fully_shard": "compile.sharding",
}

__all__ = [
    "FAMILIES",
    "AmpRewriteError",
    "AutocastIgnoredWarning",
    "CaptureError",
    "CheckResult",
    "CompiledReport",
    "Decision",
    "Family",
    "Float8",
    "GradScaler",
    "ModeSwitchError",
    "ModelError",
    "NodeError",
    "NotVerifiedWarning",
    "PassError",
    "Policy",
    "PolicyError",
    "Precision",
    "Report",
    "Rewrite",
    "ShapeError",
    "SignatureError",
    "VerificationError",
    "amprewrite_backend",
    "backend",
    "check_numerics",
    "find_fp32_nodes",
    "for_generation",
    "fully_shard",
    "load_plan",
    "optimizer",
    "override_families",
    "register_family",
    "report",
    "save_plan",
    "transform",
]
__version__ = "0.1.0"


def _load(name: str) -> object:
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        value = _load(name)
        globals()[name] = value
        return value
    if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")  # amprewrite.precision, a stage


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# --- the torch.compile backend "amprewrite", registered on import without importing torch ----

_REGISTRY = "torch._dynamo.backends.registry"


def _compile_lazily(gm, example_inputs, options=None, mode=None):
    """``amprewrite.compile.backend.amprewrite_backend``, imported when torch.compile first calls
    it."""
    from .compile.backend import amprewrite_backend

    return amprewrite_backend(gm, example_inputs, options=options, mode=mode)


def _register(registry: types.ModuleType) -> None:
    # Not where torch knows the entry point (it registers what the entry point loads, and a
    # second registration is an error), nor twice.
    if (registry._BACKENDS.get("amprewrite") is None  # type: ignore[attr-defined]
            and "amprewrite" not in registry._COMPILER_FNS):  # type: ignore[attr-defined]
        registry.register_backend(compiler_fn=_compile_lazily,  # type: ignore[attr-defined]
                                  name="amprewrite")


class _RegisterWithDynamo(importlib.abc.MetaPathFinder):
    """Registers the backend when dynamo's backend registry is first imported (by
    ``torch.compile``). An installed amprewrite is also found through its
    ``torch_dynamo_backends`` entry point."""

    def find_spec(self, name, path, target=None):
        if name != _REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _REGISTRY in sys.modules:
    _register(sys.modules[_REGISTRY])
elif not any(isinstance(f, _RegisterWithDynamo) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithDynamo())
