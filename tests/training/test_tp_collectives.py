"""Tensor-parallel collectives follow the plan (issue 63): with torch's LLaMA TP plan on 2 gloo
ranks (q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``) and the backend per
layer, every collective of a training step is sent in the low dtype, at most autocast's bytes,
the loss within bf16/fp16 of fp32's; a rank whose values pass fp16's range in evaluation gets
the plan the other rank gets (one dtype per collective); on a 2x2 mesh (TP + amprewrite's
FSDP2) the TP collectives and the all-gathers are low.

What autocast sends (measured here): its row-parallel outputs' all-reduces low, the backward
all-reduces of the column-parallel inputs' gradients in fp32 (its casts sit after
``from_local``); the plan's casts sit before it, so those are low too.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .gloo import on_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _llama(mesh, variant: str, dtype: str):
    """The zoo's LLaMA, every layer tensor parallel over ``mesh``; ``variant="amprewrite"``:
    each layer compiled by the backend."""
    from amprewrite.testing import zoo

    torch._dynamo.reset()
    return zoo.llama_tp(mesh, {"dtype": dtype, "inner": "eager"} if variant == "amprewrite"
                        else None)


def _step(model, ids, variant: str, dtype: str):
    """The loss of a training step and the bytes its TP collectives sent, by (kind, dtype):
    the second step's (the first also plans: it records the fp32 graph's ranges)."""
    from amprewrite.compile.sharding import count_collectives

    for _ in range(2):
        with count_collectives() as sent:
            if variant == "autocast":
                with torch.autocast("cpu", LOW[dtype]):
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    return float(loss.detach()), dict(sent)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _eval_overflow(mesh, rank: int) -> dict:
    """fp16 evaluation of a TP MLP whose values pass fp16's range on rank 1 only."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import amprewrite

    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = _Mlp()
    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(mlp, backend="amprewrite", options={"dtype": "fp16",
                                                                  "inner": "eager"}).eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)) * (3e3 if rank else 1.0)
    with torch.no_grad():
        out = compiled(x)
    rep = amprewrite.report(compiled).graphs[0].report
    return {"plan": [(d.node, d.dtype) for d in rep.decisions],
            "ranged": sorted(d.node for d in rep.decisions if d.reason.startswith("range:")),
            "collectives": {d.node: d.dtype for d in rep.decisions if d.family == "dtensor"},
            "finite": bool(torch.isfinite(out).all())}


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import amprewrite

    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    out: dict = {}
    for dtype in ("bf16", "fp16"):
        for variant in ("fp32", "autocast", "amprewrite"):
            model = _llama(mesh, variant, dtype)
            out[dtype, variant] = _step(model, ids, variant, dtype)
            if variant == "amprewrite":
                rep = amprewrite.report(model.model.layers[0]).graphs[0].report
                out[dtype, "reasons"] = {d.node: d.reason for d in rep.decisions
                                         if d.family == "dtensor"}
    out["eval"] = _eval_overflow(mesh, rank)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return on_ranks(_worker, 2, tmp_path_factory.mktemp("tp_collectives"), timeout=60)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_tp_collectives_are_low_and_at_most_autocasts_bytes(two_ranks, dtype):
    for r, run in enumerate(two_ranks):
        fp32_loss, fp32_sent = run[dtype, "fp32"]
        _, autocast_sent = run[dtype, "autocast"]
        loss, sent = run[dtype, "amprewrite"]
        assert {d for _, d in fp32_sent} == {torch.float32}, r
        assert {d for _, d in sent} == {LOW[dtype]}, (r, sent)  # every collective low
        assert sum(sent.values()) <= sum(autocast_sent.values()), (r, sent, autocast_sent)
        # the same collectives, half fp32's bytes (autocast's: 0.86x fp32's)
        assert sum(sent.values()) * 2 == sum(fp32_sent.values()), r
        assert abs(loss - fp32_loss) < 2e-3 * abs(fp32_loss), (r, loss, fp32_loss)
        reasons = run[dtype, "reasons"]
        assert sum("redistribute from Partial" in v for v in reasons.values()) == 2  # o, down
        assert sum("its backward sums the ranks' gradients" in v for v in reasons.values()) == 5
    assert two_ranks[0][dtype, "amprewrite"][1] == two_ranks[1][dtype, "amprewrite"][1]


def test_a_rank_whose_values_pass_fp16s_range_in_eval_gets_the_other_ranks_plan(two_ranks):
    first, second = (run["eval"] for run in two_ranks)
    assert first["ranged"] and first["ranged"] == second["ranged"]  # rank 1's ranges, on both
    assert first["plan"] == second["plan"]
    # rank 1's values pass fp16's range: every DTensor call, its partial sums' all-reduce too,
    # runs fp32 on both ranks
    assert first["collectives"] and set(first["collectives"].values()) == {"torch.float32"}
    assert first["finite"] and second["finite"]


def _mesh_worker(rank: int, world: int) -> dict:
    """2x2 (dp, tp): the LLaMA's layers tensor parallel over tp, compiled by the backend in
    bf16, sharded by amprewrite.fully_shard over dp (bf16 gathers); one training step."""
    from torch.distributed.device_mesh import init_device_mesh

    import amprewrite
    from amprewrite.compile.sharding import count_comm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama(mesh["tp"], "amprewrite", "bf16")
    for layer in model.model.layers:
        amprewrite.fully_shard(layer, mesh=mesh["dp"], dtype="bf16")
    amprewrite.fully_shard(model, mesh=mesh["dp"], dtype="bf16")
    dp = mesh["dp"].get_local_rank()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with count_comm(model) as comm:
        loss, sent = _step(model, ids[2 * dp:2 * dp + 2], "amprewrite", "bf16")
    return {"loss": loss, "sent": sent, "all_gather": dict(comm.all_gather)}


@pytest.fixture(scope="module")
def mesh_ranks(tmp_path_factory):
    return on_ranks(_mesh_worker, 4, tmp_path_factory.mktemp("tp_mesh"), timeout=90)


def test_tp_and_fsdp2_on_a_2x2_mesh_send_and_gather_low(mesh_ranks):
    for r, run in enumerate(mesh_ranks):
        assert run["sent"] and {d for _, d in run["sent"]} == {torch.bfloat16}, (r, run["sent"])
        gathered = run["all_gather"]
        # the layers' weights gather in bf16; the root's embedding, final norm and head as
        # the root's fully_shard gathers them (bf16 too, but the fp32 final norm's weight)
        assert gathered.get(torch.bfloat16, 0) > 10 * gathered.get(torch.float32, 0), (r, gathered)
        assert torch.isfinite(torch.tensor(run["loss"]))
    assert mesh_ranks[0]["sent"] == mesh_ranks[1]["sent"]


def test_communicates_finds_collectives_and_nothing_else():
    from torch import fx

    from amprewrite.compile.block_plans import communicates

    plain = fx.symbolic_trace(_Mlp())
    assert not communicates(plain, [torch.randn(2, 16)])
    graph = fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,)))
    assert communicates(fx.GraphModule(nn.Module(), graph))
