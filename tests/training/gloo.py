"""Run a function on N gloo processes and collect what each returns (tests/training)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    mp.spawn(_run, args=(fn, world, str(folder), timeout), nprocs=world, join=True)
    return [torch.load(os.path.join(str(folder), f"rank{r}.pt"), weights_only=False)
            for r in range(world)]
