"""Real-model conformance matrix: every model of amprewrite/testing/zoo.py in bf16 and fp16.

For each (model, dtype), :func:`amprewrite.testing.conformance.conform` (which the tests assert
on): the output error against the fp32 model next to ``torch.autocast``'s and
``model.to(dtype)``'s, new non-finite values, ``torch.compile(gm, fullgraph=True)``, the report.
Prints the rows and writes docs/benchmarks/models.{json,csv} and the table in docs/models.md::

    python -m benchmarks.conformance                  # all models, bf16 and fp16, with compile
    python -m benchmarks.conformance --models resnet gpt2 --no-compile
"""

from __future__ import annotations

import argparse
import json

from amprewrite.testing.conformance import DRAWS, DTYPES, conform, markdown
from amprewrite.testing.conformance import fmt as _fmt
from amprewrite.testing.zoo import MODELS

from .common import RESULTS, save

DOC = RESULTS.parent / "models.md"


def write_doc(data: dict | None = None) -> str:
    data = data or json.loads((RESULTS / "models.json").read_text())
    text = markdown(data)
    DOC.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        for d in args.dtypes:
            row = conform(name, DTYPES[d], compile=not args.no_compile)
            row.pop("traceback", None)
            rows.append(row)
            print(f"{name:18s} {d}: " + ", ".join(
                f"{k}={_fmt(row.get(k))}" for k in ("nodes", "casts", "err_amprewrite",
                                                    "err_autocast", "compile")), flush=True)
    save("models", rows, {"draws": DRAWS})
    write_doc(json.loads((RESULTS / "models.json").read_text()))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
