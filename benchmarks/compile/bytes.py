"""The bytes a compiled step moves, by inductor's own count, per zoo model: fp32, autocast +
compile, ``transform`` + compile (outputs in the low dtype, as autocast's are, and the default's
fp32 outputs as a row of their own), the ``amprewrite`` backend (outputs low too), and
``params="low"``; train step (forward and
backward of ``out.float().square().mean()``) and inference (eval, no grad), bf16 and fp16.

    python -m benchmarks bytes                              # every model, task and dtype
    python -m benchmarks bytes --models llama vit --dtypes bf16 --tasks infer

The project's yardstick for a GPU step until a GPU is lent: counts, not times (one run on a
shared machine is enough). Each row says where it differs most from autocast + compile: the
node groups (aten ops a scheduled node was made from) whose bytes differ most.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

from ..common import RESULTS, save
from .step_bytes import count, differences

MODELS = ("llama", "gpt2", "bert", "vit", "unet2d", "resnet")
VARIANTS = ("fp32 + compile", "autocast + compile", "transform + compile",
            "transform keep_io_dtype=True + compile", "backend", 'transform params="low" + compile')


def _call(model, inputs):
    from amprewrite.testing import zoo

    return zoo.first_tensor(zoo.call(model, inputs))


def _step(fn, task: str):
    def run():
        if task == "infer":
            with torch.no_grad():
                fn()
        else:
            fn().float().square().mean().backward()
    return run


def without_attention_dropout(model):
    """The same transformers model (same weights) with its attention dropout at 0: on a CPU
    inductor decomposes an SDPA with dropout into its math (bmm, softmax, dropout, bmm), and
    the plain graph's decomposition moves fp32 where autocast's moves bf16 (its node groups:
    docs/benchmarks.md): a CPU kernel's decomposition, not a plan decision (a GPU runs dropout
    inside its flash kernel). Models without a transformers config are returned as
    they are."""
    config = getattr(model, "config", None)
    keys = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
    if config is None or not any(hasattr(config, k) for k in keys):
        return model
    config = copy.deepcopy(config)
    for key in keys:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    fresh = type(model)(config)
    fresh.load_state_dict(model.state_dict())
    return fresh.train(model.training)


def variants(name: str, task: str, dtype: torch.dtype, attention_dropout: bool = True) -> dict:
    """Per variant, a setup that returns the step to count: what precedes the step (a copy of
    the model, amprewrite.transform) is not counted. ``attention_dropout=False``:
    :func:`without_attention_dropout`."""
    import amprewrite
    from amprewrite.testing import zoo

    model, inputs = getattr(zoo, name)()
    if not attention_dropout:
        model = without_attention_dropout(model)
    model = model.train() if task == "train" else model.eval()

    def compiled(**kw):
        net = torch.compile(copy.deepcopy(model), **kw)
        return lambda: _call(net, inputs)

    def autocast():
        step = compiled()

        def run():
            with torch.autocast("cpu", dtype):
                return step()
        return run

    def transformed(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = amprewrite.transform(copy.deepcopy(model), dtype, example_inputs=inputs, **kw)
        net = torch.compile(gm)
        return lambda: _call(net, inputs)

    return {
        "fp32 + compile": compiled,
        "autocast + compile": autocast,
        "transform + compile": lambda: transformed(keep_io_dtype=False),
        "transform keep_io_dtype=True + compile": transformed,
        "backend": lambda: compiled(backend="amprewrite",
                                    options={"dtype": dtype, "keep_io_dtype": False}),
        'transform params="low" + compile':
            lambda: transformed(keep_io_dtype=False, params="low"),
    }


def run(models, tasks, dtypes, chosen, attention_dropout: bool = True) -> list[dict]:
    rows = []
    for name in models:
        for task in tasks:
            for dtype_name in dtypes:
                dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
                made = variants(name, task, dtype, attention_dropout)
                counted = {}
                for variant in chosen:
                    torch._dynamo.reset()
                    counted[variant] = count(_step(made[variant](), task))
                base = counted.get("autocast + compile")
                for variant, c in counted.items():
                    row = {"model": name, "task": task, "dtype": dtype_name, "variant": variant,
                           "bytes": c["bytes"], "launches": c["launches"],
                           "kernels": c["kernels"], "extern": c["extern"]}
                    if base is not None:
                        row["vs_autocast"] = round(c["bytes"] / base["bytes"], 3)
                        row["differs_most"] = "; ".join(
                            f"{k} {d / 1e3:+.0f} KB"
                            for k, d in differences(base["groups"], c["groups"], top=3))
                    rows.append(row)
                    print(f"{name} {task} {dtype_name} {variant}: {c['bytes']:,} bytes, "
                          f"{c['launches']} launches"
                          + (f", {row['vs_autocast']}x autocast's" if base else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks bytes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--tasks", nargs="+", default=["train", "infer"],
                        choices=["train", "infer"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"],
                        choices=["bf16", "fp16"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--no-attention-dropout", action="store_true",
                        help="transformers models with their attention dropout at 0 "
                             "(without_attention_dropout); writes bytes_no_attention_dropout.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = "python -m benchmarks bytes " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = run(args.models, args.tasks, args.dtypes, args.variants,
               attention_dropout=not args.no_attention_dropout)
    name = "bytes_no_attention_dropout" if args.no_attention_dropout else "bytes"
    save(name, rows, {"command": command.strip()}, args.out)
    return rows


if __name__ == "__main__":
    main()
