"""torchtitan's own Llama 3 parallelize path with ``compile.backend="amprewrite"`` and
``amprewrite.fully_shard`` (issue 46, part 3), on CPU with gloo.

Needs torchtitan 0.3.0 in its own environment (not the system Python: torchtitan pulls in
packages that conflict with it)::

    python -m venv /tmp/tt-venv
    /tmp/tt-venv/bin/pip install torch==2.13.0 torchtitan==0.3.0 triton rich
    /tmp/tt-venv/bin/pip install -e . --no-deps
    # what runs on CPU with torch 2.13 (2 ranks FSDP; --world 4 --tp 2 for TP x FSDP):
    /tmp/tt-venv/bin/python -m benchmarks.torchtitan_recipe --world 2 --attn flex \
        --patch-flex --cpu-flex-backward --inner eager

The harness builds the ``debugmodel`` flavour from torchtitan's model registry
(``torchtitan.models.llama3.model_registry``) inside torchtitan's own trainer config
(``config_registry.llama3_debugmodel``), builds the meshes with torchtitan's ``ParallelDims``,
and calls torchtitan's ``parallelize_llama`` (TP when ``--tp 2``, activation checkpointing,
per-block ``compile``, FSDP2) unchanged. What it changes, in this process only:

- the device: torchtitan's default device type is CUDA (``torchtitan.tools.utils``); the
  harness sets it to ``"cpu"`` where torchtitan's modules read it, and joins a gloo group itself;
- ``--spmd-backend`` defaults to ``partial_dtensor`` (torchtitan's DTensor path): torchtitan's
  default, ``spmd_types``, keeps parameters plain tensors and passes ``dp_mesh_dims``, which
  torch 2.13's ``fully_shard`` refuses (with torch's own ``fully_shard`` too);
- after parallelize, every FSDP module reduces with a plain sum
  (``set_force_sum_reduction_for_comms``): torchtitan sets the gradient divide factor to 1, which
  FSDP2 reduces with ``PREMUL_SUM``, and gloo has none;
- the sharding (``--sharding amprewrite``, the default): ``amprewrite.fully_shard`` is assigned
  to ``torchtitan.distributed.fsdp.fully_shard``, the name torchtitan's ``apply_fsdp`` calls
  (with its ``mp_policy`` and its ``[norm, lm_head]`` list, which amprewrite.fully_shard takes);
- ``--patch-flex``: torchtitan's ``_maybe_regional_inductor_backend`` refuses any compile
  backend but inductor and aot_eager for a FlexAttention model; patched, it hands the backend
  through unchanged. ``--patch-flex regional`` instead wraps torchtitan's own aot_eager scoop
  (``aot_autograd(regional_inductor)``, which lowers the annotated flex region with inductor) as
  amprewrite's inner backend;
- ``--inner NAME``: the backend name becomes ``amprewrite-NAME``, registered here as
  ``amprewrite.backend(inner=NAME)`` (``"amprewrite"`` itself uses ``inner="inductor"``);
- ``--cpu-flex-backward`` (torch, not torchtitan): skips ``flex_attention``'s refusal of
  inputs that require grad on CPU, so the flex region's own CPU paths run;

Each step runs forward and backward on a fixed batch (the same every step, so the loss falls
within a few steps) under ``amprewrite.compile.sharding.count_comm`` and one AdamW step (lr 8e-4,
torchtitan's default); rank 0 prints one JSON line per step: the loss (summed cross entropy over
the global token count, torchtitan's normalisation, all-reduced over the data-parallel ranks)
and the bytes rank 0 all-gathered and reduce-scattered, by dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
import warnings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _patch_device() -> None:
    """torchtitan reads its device type once at import (CUDA when none is found)."""
    import torch
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu
    for name in ("torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils",
                 "torchtitan.models.common.token_dispatcher"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if mod is not None and hasattr(mod, "device_module"):
            mod.device_module = torch.cpu


def _backend_name(args) -> str:
    if args.backend != "amprewrite" or args.inner is None:
        return args.backend
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    import amprewrite

    name = f"amprewrite-{args.inner}"
    inner = _show_flex if args.inner == "show" else args.inner
    if name not in _BACKENDS:
        register_backend(amprewrite.backend(inner=inner), name=name)
    return name


def _show_flex(gm, example_inputs):
    """``--inner show``: an eager inner backend that prints, once on rank 0, the code of
    amprewrite's rewritten graph around each ``flex_attention`` (the casts it feeds it and puts
    on its output) and its ``rms_norm`` lines, then runs the graph as it is."""
    import torch.distributed as dist

    if not getattr(_show_flex, "done", False) and dist.get_rank() == 0:
        _show_flex.done = True
        for name, mod in gm.named_modules():
            code = getattr(mod, "code", "")
            if "flex_attention" in code:
                lines = code.splitlines()
                at = next(i for i, ln in enumerate(lines) if "flex_attention" in ln)
                print(f"--- flex region in {name or '<graph>'} ---", flush=True)
                print("\n".join(ln.strip()[:220] for ln in lines[max(0, at - 40):at + 8]),
                      flush=True)
            for ln in code.splitlines():
                if "rms_norm" in ln or "weight_, torch" in ln:
                    print(f"[{name or '<graph>'}] {ln.strip()[:200]}", flush=True)
    return gm.forward


def _patch_flex(mode: str | None) -> None:
    import torchtitan.distributed.compile as tt_compile

    original = tt_compile._maybe_regional_inductor_backend
    if mode == "passthrough":
        def passthrough(model, backend):
            if backend in ("inductor", "aot_eager"):
                return original(model, backend)
            return backend  # amprewrite (any inner), eager: as they are

        tt_compile._maybe_regional_inductor_backend = passthrough
    elif mode == "regional":
        import amprewrite

        def regional(model, backend):
            if isinstance(backend, str) and backend.startswith("amprewrite"):
                # torchtitan's own scoop (and its flag that annotates the flex region)
                scoop = original(model, "aot_eager")
                return amprewrite.backend(inner=scoop)
            return original(model, backend)

        tt_compile._maybe_regional_inductor_backend = regional


def _patch_cpu_flex_backward() -> None:
    """torch's ``flex_attention`` refuses inputs that require grad on CPU (``_validate_device``:
    "FlexAttention does not support backward on CPU"), in eager code and while dynamo traces
    it. Skipped here (torch, not torchtitan, and only in this process) to see what a backend
    does with the flex region; the higher-order op's own CPU paths are what then run."""
    import torch.nn.attention.flex_attention as fa

    original = fa._validate_device

    def validate(query, key, value):
        if query.device.type == "cpu":
            return None
        return original(query, key, value)

    fa._validate_device = validate


def _patch_sharding(args) -> None:
    """The swap a torchtitan user makes: ``amprewrite.fully_shard`` where torchtitan's
    ``apply_fsdp`` calls ``fully_shard`` (it takes torchtitan's ``mp_policy`` and its
    ``[norm, lm_head]`` list as they come)."""
    if args.sharding != "amprewrite":
        return
    import torchtitan.distributed.fsdp as tt_fsdp

    import amprewrite

    tt_fsdp.fully_shard = amprewrite.fully_shard


def _dtypes(table: dict) -> dict[str, int]:
    return {str(k).replace("torch.", ""): int(v) for k, v in sorted(table.items(), key=str)}


def _worker(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world))
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        _train(rank, args)
    except BaseException as e:  # report where it failed, then fail the process
        tb = traceback.extract_tb(e.__traceback__)
        frames = [f"{f.filename}:{f.lineno} ({f.name})" for f in tb]
        lines = str(e).strip().splitlines() or [""]
        detail = next((ln for ln in lines[1:] if "Error" in ln), None)
        print(json.dumps({"rank": rank, "error": type(e).__name__, "message": lines[0][:600],
                          "detail": detail and detail[:600], "innermost": frames[-4:]}),
              flush=True)
        if args.traceback and rank == 0:
            traceback.print_exc()
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(rank: int, args) -> None:
    import torch
    import torch.distributed as dist

    _patch_device()  # before the modules that copy device_type at import
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import amprewrite
    import amprewrite.compile.sharding

    _patch_device()
    _patch_flex(args.patch_flex)
    _patch_sharding(args)
    if args.cpu_flex_backward:
        _patch_cpu_flex_backward()

    cfg = llama3_debugmodel()  # torchtitan's own debug recipe
    cfg.model_spec = model_registry("debugmodel", attn_backend=args.attn)
    cfg.training.seq_len = args.seq
    cfg.training.local_batch_size = args.batch
    cfg.parallelism.tensor_parallel_degree = args.tp
    cfg.parallelism.data_parallel_shard_degree = -1
    cfg.parallelism.spmd_backend = args.spmd_backend
    cfg.training.mixed_precision_param = args.param_dtype
    if args.backend == "none":
        cfg.compile = CompileConfig(enable=False)
    else:
        cfg.compile = CompileConfig(enable=True, components=["model"],
                                    backend=_backend_name(args))
    cfg.activation_checkpoint = {"selective": SelectiveAC.Config(), "full": FullAC.Config(),
                                 "none": None}[args.ac]

    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(cfg.parallelism, args.world)
    parallel_dims.build_mesh()

    model_spec = cfg.model_spec
    model_config = model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_config.build()
    model = model_spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=cfg.training,
        parallelism=cfg.parallelism, compile_config=cfg.compile,
        ac_config=cfg.activation_checkpoint, dump_folder=cfg.dump_folder)
    # torchtitan sets every FSDP module's gradient divide factor to 1 (it divides the loss by
    # the global token count), which FSDP2 reduces with ReduceOp.PREMUL_SUM(1.0): gloo has no
    # PREMUL_SUM ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). A plain sum is the same here.
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    seen: set[str] = set()

    def dtypes_once(name):
        def hook(module, inputs, output):
            if rank == 0 and name not in seen:
                seen.add(name)
                ins = [str(t.dtype).replace("torch.", "") for t in inputs
                       if isinstance(t, torch.Tensor)]
                print(json.dumps({"module": name, "input_dtypes": ins,
                                  "output_dtype": str(output.dtype).replace("torch.", "")}),
                      flush=True)
        return hook

    for name in ("norm", "lm_head"):  # eager modules (a hook on a compiled block is traced)
        model.get_submodule(name).register_forward_hook(dtypes_once(name))

    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4)
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=2048))

    if parallel_dims.dp_enabled:
        batch_mesh = parallel_dims.get_mesh("batch")
        dp_degree, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    else:
        batch_mesh, dp_degree, dp_rank = None, 1, 0
    gen = torch.Generator().manual_seed(1234 + dp_rank)
    tokens = torch.randint(0, 2048, (args.batch, args.seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seq).expand(args.batch, -1).contiguous()
    global_tokens = torch.tensor(float(labels.numel() * dp_degree))

    if rank == 0:
        print(json.dumps({"config": vars(args), "compile_backend": cfg.compile.backend,
                          "parallel_dims": {"dp_shard": parallel_dims.dp_shard,
                                            "tp": parallel_dims.tp}}), flush=True)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        with amprewrite.compile.sharding.count_comm(model) as comm, train_context():
            kwargs = {"positions": positions}
            if args.attn in ("flex", "varlen"):
                kwargs["attention_masks"] = model.get_attention_masks(positions=positions)
            pred = model(inputs, **kwargs)
            loss, _ = loss_fn(pred, labels, global_tokens)
            del pred
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        if batch_mesh is not None:
            dist.all_reduce(reported, group=batch_mesh.get_group())
        if rank == 0:
            print(json.dumps({"step": step, "loss": round(reported.item(), 5),
                              "all_gather": _dtypes(comm.all_gather),
                              "reduce_scatter": _dtypes(comm.reduce_scatter),
                              "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--attn", choices=("flex", "varlen", "sdpa"), default="flex")
    p.add_argument("--backend", default="amprewrite",
                   help='compile backend: "amprewrite", "aot_eager", "inductor", or "none"')
    p.add_argument("--inner", default=None,
                   help="amprewrite's inner backend (inductor, aot_eager, eager, or show: eager "
                        "and print the flex region); default: the backend's own (inductor)")
    p.add_argument("--patch-flex", nargs="?", const="passthrough", default=None,
                   choices=("passthrough", "regional"))
    p.add_argument("--cpu-flex-backward", action="store_true",
                   help="skip torch's CPU check in flex_attention (see _patch_cpu_flex_backward)")
    p.add_argument("--sharding", choices=("amprewrite", "torch"), default="amprewrite")
    p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="torchtitan's training.mixed_precision_param (its fully_shard policy; "
                        "amprewrite.fully_shard's dtype=)")
    p.add_argument("--ac", choices=("selective", "full", "none"), default="selective")
    p.add_argument("--spmd-backend", default="partial_dtensor",
                   choices=("spmd_types", "partial_dtensor", "full_dtensor"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--traceback", action="store_true", help="print rank 0's traceback")
    args = p.parse_args(argv)

    import torch.multiprocessing as mp

    warnings.simplefilter("default")
    try:
        mp.spawn(_worker, args=(args, _free_port()), nprocs=args.world, join=True)
    except mp.ProcessRaisedException as e:
        print(f"failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
