"""amprewrite.fully_shard shards a compiled block the same way in every order torch's FSDP2
tutorials and docs/guide.md write: on the ``torch.compile`` wrapper, on the block after its
wrapper was assigned elsewhere (``compiled=True``), and after ``block.compile(...)``; and it
warns when a block sharded as eager code runs compiled. 2 gloo processes, a 2-block LLaMA."""

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.training.gloo import on_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

BATCH, SEQ, VOCAB, BLOCKS = 2, 8, 128, 2
OPTIONS = {"inner": "eager"}  # the plan's graph run as it is: fast on CPU
ORDERS = ("wrapper", "wrapper kept elsewhere", "module.compile")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _shard(model, order: str):
    """Compile and shard each block in ``order``, then shard the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import amprewrite

    layers = model.model.layers
    if order == "torchtitan":  # torchtitan's bf16 recipe (torch's fully_shard, bf16/fp32)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name, block in list(layers.named_children()):
            block = torch.compile(block, backend="eager")
            fully_shard(block, mp_policy=policy, reshard_after_forward=True)
            layers.register_module(name, block)
        fully_shard(model, mp_policy=policy)
        return model
    for name, block in list(layers.named_children()):
        if order == "wrapper":  # docs/guide.md
            wrapped = torch.compile(block, backend="amprewrite", options=OPTIONS)
            amprewrite.fully_shard(wrapped, dtype=torch.bfloat16)
            layers.register_module(name, wrapped)
        elif order.startswith("wrapper kept elsewhere"):  # torch's FSDP2 tutorial
            layers.register_module(name, torch.compile(block, backend="amprewrite",
                                                       options=OPTIONS))
            kw = {} if order.endswith("unsaid") else {"compiled": True}
            amprewrite.fully_shard(block, dtype=torch.bfloat16, **kw)
        elif order == "module.compile":
            block.compile(backend="amprewrite", options=OPTIONS)
            amprewrite.fully_shard(block, dtype=torch.bfloat16)
        elif order == "compiled after":
            amprewrite.fully_shard(block, dtype=torch.bfloat16)
            block.compile(backend="amprewrite", options=OPTIONS)
    amprewrite.fully_shard(model, dtype=torch.bfloat16)
    return model


def _gathered_after_forward(block) -> list[str]:
    """The block's parameters (its own group's and any group under it) still gathered."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    from amprewrite.compile.block_plans import fsdp_params

    return [str(p._param_fqn) for sub in block.modules() for p in fsdp_params(sub)
            if p.sharded_state != ShardedState.SHARDED]


def _step(rank: int, world: int) -> dict:
    from amprewrite.compile.sharding import count_comm

    out = {}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    for order in ("torchtitan", *ORDERS, "wrapper kept elsewhere, unsaid", "compiled after"):
        torch._dynamo.reset()
        model = _shard(_model(), order)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with count_comm(model) as comm:
                loss = model(input_ids=ids, labels=ids).loss
                gathered = [n for b in model.model.layers.children()
                            for n in _gathered_after_forward(b)]
                loss.backward()
        out[order] = {"gathered": gathered, "all_gather": dict(comm.all_gather),
                      "loss": loss.detach(),
                      "warnings": [str(w.message) for w in caught
                                   if "amprewrite.fully_shard" in str(w.message)]}
    out["norm"] = model.model.norm.weight.numel()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return on_ranks(_step, 2, tmp_path_factory.mktemp("orders"))


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_reshards_blocks_after_forward(ranks, order):
    for r in ranks:
        assert r["torchtitan"]["gathered"] == []
        assert r[order]["gathered"] == [], r[order]["gathered"]
        assert r[order]["warnings"] == []


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_gathers_torchtitans_bytes(ranks, order):
    """The blocks gather in bf16 in forward and again in backward, as torchtitan's; the root
    differs only by the final norm (eager code reads it in fp32: gathered fp32, once)."""
    for r in ranks:
        titan, ours = r["torchtitan"]["all_gather"], r[order]["all_gather"]
        norm = r["norm"]
        assert set(titan) == {torch.bfloat16}
        assert ours[torch.float32] == 4 * norm
        assert ours[torch.bfloat16] + 2 * norm == titan[torch.bfloat16], (ours, titan)
        # the same bf16 matmuls (measured equal up to bf16 roundoff of the norm scales)
        torch.testing.assert_close(r[order]["loss"], r["torchtitan"]["loss"],
                                   rtol=2e-2, atol=0)


@pytest.mark.parametrize("order", ["wrapper kept elsewhere, unsaid", "compiled after"])
def test_a_block_sharded_as_eager_code_that_runs_compiled_warns(ranks, order):
    for r in ranks:
        assert r[order]["gathered"]  # what the warning is about: weights held to backward
        (message,) = set(r[order]["warnings"])
        assert "LlamaDecoderLayer" in message  # the class as the user wrote it, not FSDP's
        assert "compiled=True" in message and "module.compile" in message


def test_compiled_true_plans_what_the_wrapper_plans():
    """No process group needed: the plan of a block said compiled is its wrapper's."""
    from amprewrite.compile.sharding import sharding_plan

    block = _model().model.layers[0]
    wrapper = torch.compile(block, backend="amprewrite")
    said, wrapped = (sharding_plan(m, "bf16", compiled=c) for m, c in ((block, True),
                                                                       (wrapper, None)))
    assert said.groups() == wrapped.groups() == {"": torch.bfloat16}
    assert {k: (p.dtype, p.group) for k, p in said.params.items()} == \
        {k: (p.dtype, p.group) for k, p in wrapped.params.items()}
    # left to itself the block plans eager groups: each Linear its own
    assert set(sharding_plan(block, "bf16").groups()) > {"", "self_attn.q_proj"}
