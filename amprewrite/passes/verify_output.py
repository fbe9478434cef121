"""verify: run the fp32 model, autocast and the finished graph once on the example inputs, and
raise :class:`~amprewrite.errors.VerificationError` when the graph's error is far beyond
autocast's (:func:`amprewrite.capture.verify.verify_graph`; docs/guide.md, "The built-in check").

The last step of the pipeline. It needs the graph's code, so the pipeline lints and recompiles
before it (``needs_code``). Train mode too: the runs draw equal dropout masks and buffers are
restored after each (``verify._Replay``), so BatchNorm statistics and the caller's model end as
they began. Without example inputs there is nothing to run: the report and a
``NotVerifiedWarning`` say so. The step is given the model and inputs by
:func:`amprewrite.passes.pipeline`; without a model (the backend, region bodies) it does
nothing.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import fx, nn

from ..capture.verify import TRAIN_MODE_CHECK, verify_graph
from ..errors import NotVerifiedWarning
from ..precision.float8 import check_factor
from ..precision.report import REPORT_KEY
from ..progress import status
from .base import Kind, Pass

__all__ = ["VerifyOutput"]

_ADVICE = ("pass example_inputs=(...) to transform to have it checked against fp32 and "
           "autocast")
# In fp16, what a run on inputs would also have told (DESIGN.md, "Values are facts too").
_RANGES = (", and the ranges of its values are unknown: a value past fp16's 65504 would "
           "become inf instead of being kept in fp32 (example_inputs=(...) or "
           "calibration=[...] gives them)")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class VerifyOutput(Pass):
    """Check the finished graph against fp32 and autocast on the example inputs."""

    name, kind = "verify", Kind.ANALYSIS
    model: nn.Module | None = None  # set by passes.pipeline(policy, model=..., ...)
    example_inputs: object = None

    @property
    def needs_code(self) -> bool:
        """It runs the graph: the pipeline recompiles before it (when it has inputs to run)."""
        return self.model is not None and self.example_inputs is not None and bool(
            self.policy.verify)

    def run(self, gm: fx.GraphModule) -> bool:
        if self.model is None or not self.policy.verify:
            return False
        rep = gm.meta.get(REPORT_KEY)
        if self.example_inputs is None:
            # Nothing to run the graph on. Said in the report and as a warning, since a graph
            # that is silently wrong would otherwise go through unnoticed (verify=False is a
            # choice and stays quiet).
            ranges = _RANGES if self.policy.dtype == torch.float16 else ""
            if rep is not None and rep.plan is not None and not rep.plan.new:
                ranges = ""  # every decision is a saved plan's, made on the values it saw
            if rep is not None:
                rep.notes.append("verify: not run, there were no example_inputs to run the "
                                 f"graph on{ranges}; {_ADVICE}")
            warnings.warn(NotVerifiedWarning(
                "amprewrite.transform: the returned graph was not verified, because no "
                f"example_inputs were given to run it on{ranges}; {_ADVICE} (or verify=False "
                "to say the check is not wanted)."), stacklevel=_caller_stacklevel())
            return False
        status("verifying against fp32 and autocast")
        # float8 linears (fp8=, each checked by float8_linears) round to e4m3, 16 times
        # bf16's unit: the whole graph is held to autocast's bf16 error times that.
        errors = verify_graph(self.model, gm, self.example_inputs, self.policy.dtype,
                              looser=check_factor(gm))
        mode = TRAIN_MODE_CHECK if gm.training else ""
        if rep is not None:
            rep.notes.append(f"verify: output error {errors['error']:.3g} against fp32 "
                             f"(autocast: {errors['autocast_error']:.3g}){mode}")
        return False


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel for the first frame outside amprewrite, seen from the
    function that calls this one: the warning then names the user's line, and Python's default
    filter shows it once per such line (``transform`` and the CLI reach it at other depths)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level
