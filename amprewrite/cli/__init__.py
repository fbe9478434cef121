"""The ``amprewrite`` command line.

- ``amprewrite demo [--dtype bf16|fp16] [--out DIR]``: transform the built-in demo model, print
  the report and the error against fp32 next to torch.autocast's.
- ``amprewrite dump TARGET [--inputs SPEC ...] [--out DIR]
  [--format text,dot,svg,html,model-explorer] [--check] [--per-pass]``: write the graph before
  and after, a diff, the report, the HTML report and Model Explorer graphs.
- ``amprewrite explore TARGET [--inputs SPEC ...] [--port P]``: start Model Explorer on localhost
  with both graphs and the overlays (``pip install 'amprewrite[explorer]'``).
- ``amprewrite check TARGET [--inputs SPEC ...] [--rtol R] [--fix]``: fp32 vs transformed
  error, per-node errors, the first non-finite node; exit status 1 when it fails, 2 on bad usage.
- ``amprewrite export TARGET [--inputs SPEC ...] [--to pt2|aoti|onnx] [--out PATH] [--static]
  [--dynamic-seq] [--no-check]``: transform, write a torch.export program, an AOTInductor
  package or ONNX, load it back and run it at two batch sizes (and sequence lengths) against
  fp32, autocast and the GraphModule; exit status 1 when it fails to load or run or departs
  from the GraphModule.
- ``amprewrite families``: the op-family table.

TARGET is ``path/to/file.py:factory`` or ``package.module:factory``; the factory returns a model
or ``(model, example_inputs)``, the inputs a tuple or a dict of keyword inputs. Input specs:
``2x3x64x64``, ``int64:1x1024:0-512``.

Errors print one line, ``amprewrite: error: ...``, and exit with status 2; Ctrl-C prints one line
and exits with status 130, also while torch is still loading: this module and ``amprewrite``'s
``__init__`` import no torch, so everything that does runs inside :func:`main`, and ``--help``,
``--version`` and the usage errors found before the model is loaded never import it. A closed output
pipe (``amprewrite families | head``) ends the command quietly. Run as a command, the process
ends as soon as the command is done (:func:`main` skips the interpreter's teardown of torch).

The command line imports every stage, always inside the function that needs it.
"""

from .main import build_parser, main, write_artefacts

__all__ = ["build_parser", "main", "write_artefacts"]
