"""Run a function on N gloo processes and collect what each returns (tests/training)."""

import multiprocessing
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The processes are forked from a server that has imported torch, transformers and amprewrite
# once (multiprocessing's "forkserver", preloaded), not started afresh: each fresh process spent
# about 6 s of CPU importing them, the larger part of a short gloo test. The server itself has
# run nothing (no thread pool to inherit half-made, as a fork of the test process would).
# It also imports what every rank went on to import for itself on its first capture, compile or
# sharding call (dynamo, inductor, the LLaMA the ranks build, DTensor and FSDP2, torchao): a
# profile of the suite found 95 s of the ranks' CPU in those imports, ~3 s per rank.
PRELOAD = ["torch", "torch.distributed", "transformers", "amprewrite", "amprewrite.api",
           "amprewrite.compile.sharding", "amprewrite.compile.backend", "tests.training.gloo",
           "torch._dynamo", "torch._inductor", "torch._inductor.compile_fx",
           "torch._dynamo.repro.after_dynamo", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
           "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
           "transformers.models.llama.modeling_llama", "torchao"]


def spawn(fn, args: tuple, nprocs: int, join: bool = True):
    """``torch.multiprocessing.spawn(fn, args, nprocs, join)`` from the preloaded server."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: once
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join,
                              start_method="forkserver")


def _run(rank: int, fn, world: int, folder: str, timeout: float | None = None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank,
                            world_size=world,
                            timeout=None if timeout is None else timedelta(seconds=timeout))
    try:
        torch.save(fn(rank, world), os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def on_ranks(fn, world: int, folder, timeout: float | None = None) -> list:
    """``fn(rank, world)`` in ``world`` processes of one gloo group (``fn`` a module-level
    function); its return values by rank, saved with ``torch.save`` under ``folder``.
    ``timeout``: the group's collective timeout in seconds (torch's default when None)."""
    spawn(_run, (fn, world, str(folder), timeout), world)
    return [torch.load(os.path.join(str(folder), f"rank{r}.pt"), weights_only=False)
            for r in range(world)]
