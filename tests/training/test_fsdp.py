"""Large-model training, the torchtitan way: activation checkpointing, the amprewrite backend and
FSDP2 ``fully_shard`` per transformer block, on 2 gloo processes (the recipe in docs/guide.md,
"Distributed training")."""

import os

import pytest
import torch
import torch.distributed as dist

from .gloo import spawn

STEPS, BATCH, SEQ, VOCAB = 4, 4, 16, 128

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)


def prepare(model, shard: bool, backend="amprewrite"):
    """The recipe: per block, checkpoint, compile with amprewrite, shard; then the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    import amprewrite  # noqa: F401  (registers the backend)

    layers = model.model.layers
    for name, block in list(layers.named_children()):
        block = checkpoint_wrapper(block)
        options = {"options": {"inner": "eager"}} if backend == "amprewrite" else {}
        block = torch.compile(block, backend=backend, **options)
        if shard:
            fully_shard(block)
        layers.register_module(name, block)
    if shard:
        fully_shard(model)
    return model


def _train(model, batches) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        from torch.distributed.tensor import DTensor

        model = prepare(_model(), shard=True)
        params = {k: (type(p).__name__, p.dtype, tuple(p.shape),
                      p.to_local().numel() if isinstance(p, DTensor) else p.numel())
                  for k, p in model.named_parameters()}
        losses = _train(model, _data()[:, rank::world])  # each rank: its half of the batch
        for loss in losses:  # the global batch's loss: the mean of the halves' (equal sizes)
            dist.all_reduce(loss)
            loss /= world
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                 for k, v in model.state_dict().items()}
        torch.save({"losses": torch.stack(losses), "params": params, "state": state},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_per_block_with_checkpointing_matches_single_process(tmp_path):
    spawn(_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # fp32 master weights, sharded: every parameter a DTensor holding half of it per rank.
    for key, (kind, dtype, shape, local) in r0["params"].items():
        assert kind == "DTensor" and dtype == torch.float32, key
        assert local < torch.Size(shape).numel() or torch.Size(shape).numel() == 1, key
    import amprewrite
    from amprewrite.graph import meta as M
    from amprewrite.precision.ops import Precision

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    single_model = prepare(_model(), shard=False, backend=amprewrite.backend(inner=record))
    single = torch.stack(_train(single_model, _data()))
    # The blocks' graph (one serves both: their parameters are graph inputs) is one checkpoint
    # region whose body runs the block's projections in bf16.
    assert graphs
    for gm in graphs:
        (region,) = [n for n in gm.graph.nodes
                     if getattr(n.target, "__name__", "") == "tag_activation_checkpoint"]
        body = gm.get_submodule(str(region.args[0].target))
        low = [n for n in body.graph.nodes if n.meta.get(M.CLASS) == Precision.LOW
               and n.meta.get(M.FAMILY) == "linear"]
        assert len(low) == 7  # q, k, v, o, gate, up, down
    assert torch.equal(r0["losses"], r1["losses"])
    assert not torch.equal(single[0], single[-1])  # it trained
    # The same bf16 matmuls on half the rows (measured 8e-6 apart; bf16's roundoff is 2^-8).
    torch.testing.assert_close(r0["losses"], single, rtol=1e-3, atol=0)
    for key, value in single_model.state_dict().items():
        key = key.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        got = {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): v
               for k, v in r0["state"].items()}[key]
        torch.testing.assert_close(got, value, rtol=2e-2, atol=2e-3)
