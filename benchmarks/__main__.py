"""One command that measures everything and writes docs/benchmarks/:

    python -m benchmarks all            # transform cost, runtime + numerics, upsample, loops,
                                        # plots, inference, capture time, generation, report page
                                        # open time (with Chromium), start and stop (import
                                        # time, exit after the last line), fp16 overflow
                                        # cases, real-model conformance matrix
                                        # (docs/models.md)
    python -m benchmarks all --quick    # smaller sizes and fewer repeats (a smoke run)
    python -m benchmarks gpu            # CUDA: runtime, memory peak, kernel probe, CUDA tests,
                                        # planned to fit --budget (420 s), JSON after each row
                                        # (options: python -m benchmarks gpu --help)
    python -m benchmarks mutants        # flip each FP32/LOW family's class, run the precision
                                        # tests, report which flips no test catches
                                        # (options: python -m benchmarks mutants --help)
    python -m benchmarks memory         # saved-for-backward bytes, cast bytes and step time of
                                        # fp32, autocast and amprewrite on the zoo models
                                        # (options: python -m benchmarks memory --help)
    python -m benchmarks deploy         # export, save, load, AOTInductor on six zoo models:
                                        # artefact vs GraphModule and vs fp32, compile time
                                        # (options: python -m benchmarks deploy --help)
    python -m benchmarks overflow       # fp16 on models whose values pass 65504: errors, matmul
                                        # FLOPs kept in fp16, what recording ranges costs
                                        # (options: python -m benchmarks.overflow --help)
    python -m benchmarks fp8            # float8: amprewrite fp8 against bf16 and torchao's own
                                        # conversion on a LLaMA block, inference and a train
                                        # step (options: python -m benchmarks.fp8 --help)
    python -m benchmarks sharding       # FSDP2 on gloo, 2 and 4 processes, a small LLaMA: bytes
                                        # all-gathered and reduce-scattered per step and the
                                        # loss over 100 steps of fp32, torchtitan bf16 and
                                        # amprewrite.fully_shard (options: python -m
                                        # benchmarks.sharding --help)
    python -m benchmarks bytes          # inductor's count of the bytes and launches of a
                                        # compiled step: fp32, autocast, transform, backend,
                                        # params="low", per zoo model, train and inference,
                                        # bf16 and fp16 (options: python -m benchmarks bytes
                                        # --help)
    python -m benchmarks tp             # tensor-parallel collectives of a training step on 2
                                        # gloo ranks: bytes by dtype of fp32, autocast and the
                                        # backend, bf16 and fp16 (options: python -m
                                        # benchmarks tp --help)
    python -m benchmarks state          # the training state: bytes a parameter, loss over 300
                                        # steps of real text, bytes of a compiled train step;
                                        # fp32, autocast, naive bf16, params="low" +
                                        # amprewrite.optimizer (options: python -m benchmarks
                                        # state --help)
    python -m benchmarks trainers       # the trainer switches on a CPU as the guide writes
                                        # them: Trainer, accelerate, Lightning, against fp32
                                        # (options: python -m benchmarks trainers --help)
    python -m benchmarks plan_time      # transform time with a saved plan against deciding
                                        # afresh: the zoo's LLaMA and UNet2DModel, fp16 and
                                        # bf16, each transform in a process of its own
                                        # (options: python -m benchmarks plan_time --help)
    python -m benchmarks modelopt       # fp16 ONNX side by side with NVIDIA ModelOpt AutoCast
                                        # (its own venv: python -m benchmarks.modelopt_autocast
                                        # --help)

Individual parts: python -m benchmarks.{transform_cost,runtime,upsample,loops,plots,inference,
capture,generate,report_page,startup,conformance,mutants,memory,deploy,overflow,
modelopt_autocast,fp8,sharding}
--help.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from . import (
    capture,
    conformance,
    deploy,
    fp8,
    generate,
    gpu_budget,
    inference,
    loops,
    memory,
    modelopt_autocast,
    mutants,
    overflow,
    plots,
    report_page,
    runtime,
    sharding,
    startup,
    transform_cost,
    upsample,
)


def _all(quick: bool, device: str | None) -> None:
    try:  # the plots step comes after half an hour of measuring: fail before it, not there
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit('python -m benchmarks all needs matplotlib: pip install -e ".[bench]"')
    dev = ["--device", device] if device else []
    steps = [
        ("transform cost", transform_cost.main,
         ["--blocks", "3", "10", "40", "--dynamo-blocks", "3"] if quick else []),
        ("runtime and numerics", runtime.main,
         (["--repeats", "3", "--models", "cnn"] if quick else ["--repeats", "20"]) + dev),
        ("upsample", upsample.main, (["--repeats", "3"] if quick else []) + dev),
        ("loops", loops.main,
         (["--repeats", "5", "--batches", "64"] if quick else ["--repeats", "300"]) + dev),
        ("plots", plots.main, []),
        ("inference", inference.main,
         (["--repeats", "3", "--cases", "llama 1-token b1"] if quick else []) + dev),
        ("capture time", capture.main,
         ["--models", "llama", "resnet", "--rounds", "1"] if quick else []),
        ("generation", generate.main,
         ["--variants", "autocast", "amprewrite-eager", "--tokens", "4"] if quick else []),
        ("start and stop", startup.main, ["--rounds", "2"] if quick else []),
        ("overflow", overflow.main,
         ["--cases", "t5_ff", "scores", "residual", "--repeats", "1"] if quick else []),
    ]
    if shutil.which("chromium"):
        steps.append(("report page", report_page.main,
                      ["--layers", "2", "--rounds", "1"] if quick else []))
    if not quick:  # the whole matrix or none: docs/models.md lists every model
        steps.append(("conformance", conformance.main, []))
    for name, fn, argv in steps:
        start = time.perf_counter()
        print(f"== {name}: {' '.join(argv)}", flush=True)
        fn(argv)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mutants"]:  # its own options (--families, --tests, ...)
        return mutants.main(argv[1:])
    if argv[:1] == ["memory"]:  # its own options (--models, --dtypes, --no-compiled, ...)
        memory.main(argv[1:])
        return 0
    if argv[:1] == ["modelopt"]:  # its own options and venv: benchmarks/modelopt_autocast.py
        modelopt_autocast.main(argv[1:])
        return 0
    if argv[:1] == ["gpu"]:  # its own options (--budget, --device, --tiny, --rows, ...)
        return gpu_budget.main(argv[1:])
    if argv[:1] == ["overflow"]:  # its own options (--cases, --repeats)
        overflow.main(argv[1:])
        return 0
    if argv[:1] == ["fp8"]:  # its own options (--size, --tiny, --tasks, --recipes, --out)
        fp8.main(argv[1:])
        return 0
    if argv[:1] == ["sharding"]:  # its own options (--worlds, --steps, --recipes, --out)
        sharding.main(argv[1:])
        return 0
    if argv[:1] == ["bytes"]:  # its own options (--models, --tasks, --dtypes, --variants)
        from .compile import bytes as step_bytes

        step_bytes.main(argv[1:])
        return 0
    if argv[:1] == ["tp"]:  # its own options (--dtypes, --out)
        from .compile import tp_collectives

        tp_collectives.main(argv[1:])
        return 0
    if argv[:1] == ["state"]:  # its own options (--parts, --steps, --lr, --out)
        from .training import state

        state.main(argv[1:])
        return 0
    if argv[:1] == ["trainers"]:  # its own options (--steps, --paths, --variants, --inductor)
        from .training import trainers_cpu

        trainers_cpu.main(argv[1:])
        return 0
    if argv[:1] == ["plan_time"]:  # its own options (--models, --dtypes, --rounds)
        from .precision import plan_time

        plan_time.main(argv[1:])
        return 0
    if argv[:1] == ["deploy"]:  # its own options (--models, --dtypes, --to)
        deploy.main(argv[1:])
        return 0
    # The docstring's table as written: argparse's default formatter runs it into one paragraph.
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["all", "mutants", "memory", "deploy", "modelopt",
                                         "overflow", "fp8", "sharding", "state", "bytes",
                                         "trainers", "tp", "plan_time"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    _all(args.quick, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
