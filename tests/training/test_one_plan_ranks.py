"""Every rank compiles the same graph (DESIGN.md, "One plan at scale"): the per-block recipe on 2
and 4 gloo processes, each rank with its own data, one rank's data overflowing fp16 where the
others' do not. Ranges are widened across ranks before each plan is fixed, so every rank runs
the same generated code and every rank's output is finite; a training step that overflows on
one rank makes every rank plan again (amprewrite.GradScaler reduces found_inf)."""

import pytest
import torch
import torch.distributed as dist

from .gloo import on_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

HOT_RANK = 1


def _worker(rank: int, world: int) -> dict:
    import amprewrite
    from amprewrite.capture.verify import rel_err
    from amprewrite.compile import block_plans as plans
    from amprewrite.testing.scale import (
        blocks_model,
        compile_blocks,
        growing_batches,
        growing_mlp,
        train,
    )

    # An MLP without a norm in front: only the hot rank's inputs take it past fp16's range.
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 + rank))
    if rank == HOT_RANK:
        x = x * 3e4
    ref = growing_mlp()(x)
    compiled = torch.compile(growing_mlp(), backend="amprewrite",
                             options={"dtype": "fp16", "inner": "eager"})
    out = compiled(x)
    codes = sorted(p.gm.code for plan in plans.plans_of(compiled) for p in plan.plans)
    rep = amprewrite.report(compiled)
    # The per-block recipe: every block's graph the same on every rank too.
    torch._dynamo.reset()
    blocks = compile_blocks(blocks_model(), options={"dtype": "fp16", "inner": "eager"})
    blocks(torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(20 + rank)))
    codes += sorted(p.gm.code for plan in plans.plans_of(blocks) for p in plan.plans)
    # Training: only the hot rank's batches grow; every rank must plan again with it.
    torch._dynamo.reset()
    batches = growing_batches(16, shift_at=100 if rank != HOT_RANK else 6,
                              seed=1 + rank)
    mlp = torch.compile(growing_mlp(), backend="amprewrite",
                        options={"dtype": "fp16", "inner": "eager"})
    run = train(mlp, batches, "amprewrite")
    mlp_codes = sorted(p.gm.code for plan in plans.plans_of(mlp) for p in plan.plans)
    return {"finite": bool(torch.isfinite(out).all()), "error": rel_err(out, ref),
            "codes": codes, "ranks": [g.ranks for g in rep.graphs],
            "mlp_codes": mlp_codes, "losses": run.losses}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_rank_compiles_the_same_graph_and_stays_finite(tmp_path, world):
    runs = on_ranks(_worker, world, tmp_path)
    for r, run in enumerate(runs):
        assert run["finite"], r
        assert run["error"] < 1e-3, (r, run["error"])
        assert run["ranks"] and all(n == world for n in run["ranks"])
        assert run["codes"] == runs[0]["codes"], f"rank {r} compiled other code than rank 0"
        assert run["mlp_codes"] == runs[0]["mlp_codes"], r
    # The hot rank's ranges are in every rank's plan: it is not the plan a cool rank's data
    # alone gives (compiled here, in one process).
    from amprewrite.compile import block_plans as plans
    from amprewrite.testing.scale import growing_mlp

    torch._dynamo.reset()
    cool = torch.compile(growing_mlp(), backend="amprewrite",
                         options={"dtype": "fp16", "inner": "eager"})
    cool(torch.randn(8, 32, generator=torch.Generator().manual_seed(10)))
    (cool_code,) = [p.gm.code for plan in plans.plans_of(cool) for p in plan.plans]
    assert cool_code not in runs[0]["codes"]
    # Training: the hot rank's overflow cost every rank the same one step, then all went on.
    for r, run in enumerate(runs):
        bad = [k for k, v in enumerate(run["losses"]) if not torch.isfinite(torch.tensor(v))]
        assert bad == ([6] if r == HOT_RANK else []), (r, bad)


def _tp_fp8_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import amprewrite

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    # 272 = 16 * 17: divisible by 16 as a whole, 136 per rank is not.
    model = torch.nn.Sequential(torch.nn.Linear(64, 272), torch.nn.ReLU(),
                                torch.nn.Linear(272, 64))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    compiled = torch.compile(model, backend="amprewrite", options={
        "dtype": "bf16", "fp8": amprewrite.Float8(min_speedup=0), "inner": "eager"})
    out = compiled(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)))
    verdicts = [d.fp8 for g in amprewrite.report(compiled).graphs
                for d in g.report.decisions if d.fp8]
    return {"verdicts": verdicts, "finite": bool(torch.isfinite(out).all())}


def test_under_tensor_parallel_float8_reads_each_ranks_local_shapes(tmp_path):
    pytest.importorskip("torchao")
    for run in on_ranks(_tp_fp8_worker, 2, tmp_path):
        assert run["finite"]
        assert len(run["verdicts"]) == 2, run["verdicts"]
        # Column-parallel: 64 -> 136 per rank; row-parallel: 136 -> 64 per rank.
        assert all("divisible by 16" in v for v in run["verdicts"]), run["verdicts"]
        assert any("64x136" in v for v in run["verdicts"]) and any(
            "136x64" in v for v in run["verdicts"]), run["verdicts"]
