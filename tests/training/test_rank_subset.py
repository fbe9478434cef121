"""No compile waits for ranks that are not compiling (DESIGN.md, "Where people train").

Two gloo processes train a per-block compiled model together; then rank 0 alone evaluates
(``model.eval()``) and samples (train mode under ``torch.no_grad()``) while rank 1 waits at a
barrier. Those forwards compile new graphs; their ranges are this rank's own (no collective
with a rank that is not compiling), so rank 0 finishes, and the group's 40 s timeout, well
under a minute, is never reached. A training step afterwards still plans the same on both
ranks (its values widened across them).
"""

import time

import pytest
import torch
import torch.distributed as dist

from .gloo import on_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def _worker(rank: int, world: int, dtype: str = "bf16") -> dict:
    from amprewrite.compile import block_plans as plans
    from amprewrite.testing.scale import blocks_model, compile_blocks

    fp32 = blocks_model(hot=None)
    model = compile_blocks(blocks_model(hot=None), options={"dtype": dtype, "inner": "eager"})
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()  # a training step's forward and backward, every rank
    start = time.perf_counter()
    outs = {}
    if rank == 0:
        model.eval()
        with torch.no_grad():
            outs["eval"] = model(x)
        model.train()
        with torch.no_grad():
            outs["sample"] = model(x)
    took = time.perf_counter() - start
    dist.barrier()
    model(x).square().mean().backward()  # training again, every rank
    spmd = sorted(p.gm.code for plan in plans.plans_of(model) if plan.reduce is plans.across_ranks
                  for p in plan.plans)
    local = [plan.ranks for plan in plans.plans_of(model) if plan.reduce is plans.this_rank]
    with torch.no_grad():
        ref = fp32(x)
    errors = {k: float((v - ref).norm() / ref.norm()) for k, v in outs.items()}
    return {"took": took, "errors": errors, "spmd": spmd, "local": local,
            "finite": all(bool(torch.isfinite(v).all()) for v in outs.values())}


def _fp16(rank: int, world: int) -> dict:
    return _worker(rank, world, "fp16")


@pytest.mark.parametrize("worker", [_worker, _fp16], ids=["bf16", "fp16"])
def test_rank0_evaluates_alone_while_the_other_waits(tmp_path, worker):
    zero, one = on_ranks(worker, 2, tmp_path, timeout=40)
    assert zero["finite"] and set(zero["errors"]) == {"eval", "sample"}
    assert all(e < 2e-2 for e in zero["errors"].values()), zero["errors"]  # low-precision error
    assert zero["took"] < 40  # it did not wait for the group's timeout
    assert zero["local"] and all(n == 1 for n in zero["local"])  # planned from its own values
    assert zero["spmd"] and zero["spmd"] == one["spmd"]  # training: one plan on both ranks


def _trains_alone(rank: int, world: int) -> dict:
    """Rank 0 runs a training forward (gradients on, train mode) that rank 1 never runs: rank 1
    waits at a barrier. The plan's collective would wait for the group's timeout; it fails
    within AMPREWRITE_RANK_WAIT_S instead, with what to do."""
    import os

    from amprewrite.errors import AmpRewriteError, DistributedError
    from amprewrite.testing.scale import blocks_model, compile_blocks

    os.environ["AMPREWRITE_RANK_WAIT_S"] = "3"
    model = compile_blocks(blocks_model(hot=None), options={"dtype": "bf16", "inner": "eager"})
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(rank))
    out = {"error": None}
    if rank == 0:
        start = time.perf_counter()
        try:
            model(x).square().mean().backward()
        except Exception as exc:  # dynamo wraps the backend's error (BackendCompilerFailed)
            inner = getattr(exc, "inner_exception", exc)
            out.update(error=str(inner), amprewrite=isinstance(inner, AmpRewriteError),
                       distributed=isinstance(inner, DistributedError))
        out["took"] = time.perf_counter() - start
    dist.barrier()
    return out


def test_a_training_forward_on_one_rank_fails_within_seconds_saying_what_to_do(tmp_path):
    zero, one = on_ranks(_trains_alone, 2, tmp_path, timeout=40)
    assert zero["distributed"] and zero["amprewrite"], zero
    assert zero["took"] < 20, zero["took"]  # the bounded wait (3 s), not the group's 40 s
    assert "rank(s) [1] did not reach the same compile within 3 s" in zero["error"]
    assert "on every rank, or under torch.no_grad()" in zero["error"]
    assert one["error"] is None
