"""Errors amprewrite raises on bad input. Each message is one paragraph that says what to do."""

from __future__ import annotations

__all__ = [
    "AmpRewriteError",
    "AutocastIgnoredWarning",
    "CaptureError",
    "DistributedError",
    "ModeSwitchError",
    "ModelError",
    "NotVerifiedWarning",
    "PassError",
    "PolicyError",
    "RetransformWarning",
    "ShapeError",
    "SignatureError",
    "UsageError",
    "VerificationError",
]


class AmpRewriteError(Exception):
    """Base class of every error amprewrite raises on purpose."""


class PolicyError(AmpRewriteError, ValueError):
    """An option of :func:`amprewrite.transform` is invalid (dtype, keep_fp32, params, ...)."""


class CaptureError(AmpRewriteError, RuntimeError):
    """The model could not be captured into a graph (tracing or dynamo export failed)."""


class DistributedError(AmpRewriteError, RuntimeError):
    """Under ``torch.distributed``, a compile that needs every rank (a training forward's
    value ranges widened across ranks) found ranks that did not reach it in time."""


class ModeSwitchError(AmpRewriteError, RuntimeError):
    """A dynamo-captured graph was switched to the train/eval mode it was not captured in."""


class PassError(AmpRewriteError, RuntimeError):
    """A graph pass failed; the message names the pass and the node it was on."""


class ModelError(AmpRewriteError, TypeError):
    """The object passed as a model cannot be transformed (not a Module, meta tensors, ...)."""


class ShapeError(AmpRewriteError, ValueError):
    """A graph was called with inputs it was not captured for and cannot be re-captured for."""


class SignatureError(AmpRewriteError, TypeError):
    """A dynamo graph was called with arguments it was not captured with: a keyword or a
    positional input too many, or one it was captured with left out. A ``TypeError``, as
    Python's own for a call that does not fit the signature."""


class UsageError(AmpRewriteError):
    """Bad command-line usage; the CLI prints it on one line and exits with status 2. (Here,
    with no torch to import, so that the command line reports a usage error at once;
    ``amprewrite.cli.target.UsageError`` is the same class.)"""


class VerificationError(AmpRewriteError, RuntimeError):
    """The transformed graph's output is far from fp32's, beyond what autocast's is.

    ``finding``: what the check found, without the advice that follows it in the message;
    ``keep_fp32``: the selectors the message advises, found by transforming again with them
    until the check passed (``None`` when no such set was found); ``result``: the per-node
    comparison (a :class:`amprewrite.CheckResult`); ``first``: the graph node it blames.
    """

    def __init__(self, finding: str, advice: str = "", *, result: object = None,
                 first: object = None, keep_fp32: list[str] | None = None):
        super().__init__(finding + advice)
        self.finding, self.result, self.first, self.keep_fp32 = finding, result, first, keep_fp32


class NotVerifiedWarning(UserWarning):
    """:func:`amprewrite.transform` returned a graph it could not check against fp32 and
    autocast (no ``example_inputs`` to run it on). Python shows it once per calling line;
    ``verify=False`` says the check is not wanted and silences it."""


class RetransformWarning(UserWarning):
    """A graph from :func:`amprewrite.transform` was called with inputs of a shape it was not
    transformed for (a new sequence length) and transformed the model again for them, which
    takes seconds. Shown once per graph, with the ``dynamic_shapes=`` that avoids it."""


class AutocastIgnoredWarning(UserWarning):
    """A transformed graph ran inside an enclosing ``torch.autocast`` and turned it off for its
    own ops: the plan's casts are explicit, and autocast's would undo them. Shown once per
    graph, and said in its report; the ops outside the graph still run under autocast."""
