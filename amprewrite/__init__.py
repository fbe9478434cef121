"""amprewrite: a graph-rewriting mixed-precision compiler for PyTorch.

>>> import torch, amprewrite
>>> gm = amprewrite.transform(torch.nn.Linear(4, 2), dtype="bf16")
>>> gm(torch.randn(3, 4)).dtype
torch.float32
"""

from .api import transform
from .backend import amprewrite_backend, backend
from .errors import (
    AmpRewriteError,
    CaptureError,
    ModelError,
    ModeSwitchError,
    NotVerifiedWarning,
    PassError,
    PolicyError,
    ShapeError,
    VerificationError,
)
from .generation import for_generation
from .numerics import CheckResult, NodeError, check_numerics, find_fp32_nodes
from .ops import FAMILIES, Family, Precision, override_families, register_family
from .policy import Policy
from .report import Decision, Report, Rewrite, report

__all__ = [
    "FAMILIES",
    "AmpRewriteError",
    "CaptureError",
    "CheckResult",
    "Decision",
    "Family",
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
    "VerificationError",
    "amprewrite_backend",
    "backend",
    "check_numerics",
    "find_fp32_nodes",
    "for_generation",
    "override_families",
    "register_family",
    "report",
    "transform",
]
__version__ = "0.1.0"
