"""The command line's words: the library's errors reworded with the flags a user types, and
the argument types that check every flag where it is parsed. Imports no torch.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex

FORMATS = ("text", "dot", "svg", "html", "model-explorer")


_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


_KEYWORD_TO_FLAG = [
    (r"[Pp]ass example_inputs=\(\.\.\.\) to (?:amprewrite\.)?transform", "pass --inputs SPEC ..."),
    (r"example_inputs=\(\.\.\.\)", "--inputs SPEC ..."),
    (r"model\(\*example_inputs\)", "the model called on --inputs"),
    (r"\bexample_inputs\b", "inputs (--inputs)"),
    (r"\bdtype=torch\.bfloat16 \(or 'bf16'\)", "--dtype bf16"),
    (r"\bdtype=torch\.float16 \(or 'fp16'\)", "--dtype fp16"),
    (r"\bupsample='(\w+)'", r"--upsample \1"),
    (r"\brtol=", "--rtol "),
    (r"\bcheck=False\b", "--no-check"),
    (r"\bverify=False\b", "--no-check"),  # only export runs the transform's check
    (r"\bdynamic_batch=False\b", "--static"),
    (r"\bdynamic_seq=True\b", "--dynamic-seq"),
    (r"\bto='(\w+)'", r"--to \1"),
]


def cli_wording(message: str) -> str:
    """``message`` with the Python keywords it names (``example_inputs=(...)``) written as the
    command line's flags (``--inputs SPEC ...``); the one place where the two are mapped.

    >>> cli_wording("Pass example_inputs=(...) to amprewrite.transform so it is captured")
    'pass --inputs SPEC ... so it is captured'
    """
    for pattern, flag in _KEYWORD_TO_FLAG:
        message = re.sub(pattern, flag, message)
    return re.sub(r"\b(keep_fp32|allow_low)=(\[[^\]]*\])", _selectors_as_flags, message)


def _selectors_as_flags(match: re.Match) -> str:
    """``keep_fp32=['a', 'node:b']`` as ``--keep-fp32 a --keep-fp32 node:b``, shell-quoted."""
    import ast

    try:
        items = ast.literal_eval(match[2])
    except (ValueError, SyntaxError):
        return match[0]  # a placeholder such as [<module path>]: left as Python
    flag = "--" + match[1].replace("_", "-")
    return " ".join(f"{flag} {shlex.quote(str(item))}" for item in items)


def dtype_flag(text: str) -> str:
    from ..graph.dtypes import low_dtype_name, low_dtype_names

    name = low_dtype_name(text)
    if name is None:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not bfloat16 or float16; use one of {', '.join(low_dtype_names())}")
    return _SHORT[name]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got '{text}'")
    return value


def positive_int(text: str) -> int:
    if not re.fullmatch(r"\+?\d+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, got '{text}'")
    return int(text)


def port(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got '{text}'")
    return int(text)


def formats_flag(text: str) -> set[str]:
    from ..errors import UsageError

    chosen = {f.strip() for f in text.split(",") if f.strip()}
    bad = chosen - set(FORMATS)
    if bad or not chosen:
        raise UsageError(f"--format takes a comma list of {', '.join(FORMATS)}; got '{text}'.")
    return chosen


class Parser(argparse.ArgumentParser):
    """Usage errors as one line with a pointer to ``--help`` (argparse prints the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def option_flags(args: argparse.Namespace) -> list[str]:
    """The common options given on the command line, as flags again (to repeat in a
    suggested command): ``--keep-fp32 fc --overflow fp32``."""
    flags: list[str] = []
    if getattr(args, "upsample", "auto") != "auto":
        flags += ["--upsample", args.upsample]
    for sel in getattr(args, "keep_fp32", ()) or ():
        flags += ["--keep-fp32", sel]
    for sel in getattr(args, "allow_low", ()) or ():
        flags += ["--allow-low", sel]
    if getattr(args, "calibration", None):
        flags += ["--calibration", args.calibration]
    if getattr(args, "overflow", "auto") != "auto":
        flags += ["--overflow", args.overflow]
    if getattr(args, "fp8", None) is not None:
        flags += ["--fp8", args.fp8]
    if getattr(args, "fp8_any_size", False):
        flags.append("--fp8-any-size")
    return flags


