"""Transforms leave the process as they found it: dynamo's tables, the registry, the kernel
cache, dynamo's configuration and the caller's inputs are the same after 30 transforms, and a
dropped graph takes what its capture made with it.

Measured (``benchmarks/transform_memory.py``, 20 transforms after 3 warm-up ones): resident
memory grew 3.5 MB per transform of the zoo GPT-2 before capture released dynamo's
backend-table entry and shape caches; 1.57 (GPT-2) and 1.20 MB (ResNet) after; 0.00 for both
once the export's shape environment, its guards' finalizers and fx's generated sources went
too. Memory is a benchmark, not a test: here the tables are counted.
"""

from __future__ import annotations

import gc
import linecache
import weakref

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.precision import kernels, ops


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.relu(self.fc1(x)))).softmax(-1)


def _dynamo_state(model: nn.Module) -> dict:
    import torch._dynamo.eval_frame as ef
    from torch.utils import _pytree as pytree

    return {
        "cached_backends": len(ef.cached_backends),
        "forward cache entries": len(ef._debug_get_cache_entry_list(type(model).forward.__code__)),
        "config": {k: getattr(torch._dynamo.config, k) for k in
                   ("recompile_limit", "accumulated_recompile_limit")
                   if hasattr(torch._dynamo.config, k)},
        "pytree nodes": len(pytree.SUPPORTED_NODES),
    }


def test_a_dozen_transforms_leave_dynamo_and_the_registry_unchanged():
    """Twelve: more than dynamo's recompile limit (8) of one code object, both dtypes."""
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 16)
    x_before = x.clone()
    amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))  # imports, first probes
    gc.collect()
    state, families = _dynamo_state(model), dict(ops.FAMILIES)
    verdicts = len(kernels._CACHE)
    for i in range(12):
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        gm = amprewrite.transform(model, dtype, example_inputs=(x,), verify=i % 10 == 0)
        with torch.no_grad():
            assert torch.isfinite(gm(x)).all()
        del gm
    gc.collect()
    assert _dynamo_state(model) == state
    assert dict(ops.FAMILIES) == families
    assert len(kernels._CACHE) <= verdicts + 8  # the fp16 verdicts, once
    assert torch.equal(x, x_before)


def test_an_export_leaves_no_backend_in_dynamos_table():
    """Each export added its capturing compiler (holding its graph and fake tensors) to
    ``eval_frame.cached_backends`` for the life of the process."""
    import torch._dynamo.eval_frame as ef

    model = Block().eval()
    amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(4, 16),))
    before = dict(ef.cached_backends)
    for _ in range(3):
        amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(4, 16),),
                             verify=False)
    assert dict(ef.cached_backends) == before


def test_output_dataclass_registration_lives_as_long_as_the_graphs_that_need_it():
    """amprewrite registers a model's output dataclass with pytree (so dynamo can return it);
    the registration is released with the last graph that returns it, not kept for the
    process."""
    import dataclasses

    from torch.utils import _pytree as pytree

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        hidden: torch.Tensor

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return Out(h.softmax(-1), h)

    model, x = Net().eval(), torch.randn(2, 8)
    assert Out not in pytree.SUPPORTED_NODES
    first = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    second = amprewrite.transform(model, torch.float16, example_inputs=(x,))
    assert Out in pytree.SUPPORTED_NODES
    with torch.no_grad():
        assert isinstance(first(x), Out) and isinstance(second(x), Out)
    del first
    gc.collect()
    assert Out in pytree.SUPPORTED_NODES  # the second graph still returns it
    with torch.no_grad():
        assert isinstance(second(x), Out)
    import copy

    twin = copy.deepcopy(second)  # a copy holds the registration too
    del second
    gc.collect()
    assert Out in pytree.SUPPORTED_NODES
    with torch.no_grad():
        assert isinstance(twin(x), Out)
    del twin
    gc.collect()
    assert Out not in pytree.SUPPORTED_NODES


def _shape_env(gm: torch.fx.GraphModule) -> object:
    fake = next(M.fake_value(n) for n in gm.graph.nodes if n.op == "placeholder")
    return fake.fake_mode.shape_env


def test_a_dropped_graph_frees_its_shape_environment():
    """With a dynamic batch (the default), the export's shape environment held its fake input,
    whose symbolic sizes hold the environment again, through C++ the garbage collector cannot
    see: every transform kept its environment, fake tensors and dispatch cache for good."""
    model = Block().eval()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(4, 16),),
                              verify=False)
    env = weakref.ref(_shape_env(gm))
    assert env() is not None
    del gm
    gc.collect()  # frees the fake tensors, whose C++ sizes held the environment's SymNodes
    gc.collect()  # then the environment's own cycle
    assert env() is None


def test_transforms_leave_no_guard_finalizers():
    """dynamo's guards register a finalizer on each object they match by identity (the model's
    modules and parameters), and the finalizer keeps the guards alive as long as the model."""
    model = Block().eval()
    amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(4, 16),),
                         verify=False)
    gc.collect()
    before = len(weakref.finalize._registry)
    for _ in range(3):
        amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(4, 16),),
                             verify=False)
    gc.collect()
    assert len(weakref.finalize._registry) <= before


@pytest.mark.parametrize("with_inputs", [True, False], ids=["dynamo", "symbolic"])
def test_a_graphs_generated_source_lives_as_long_as_its_code(with_inputs):
    """fx keeps the source of every forward it generates; a transform's (ten for GPT-2, one per
    recompile and the export's own) go with the graphs, a live graph's stays for tracebacks.
    Without example inputs the passes recompile a plain fx.GraphModule: the same."""
    from torch.fx.graph_module import _loader

    model, x = Block().eval(), torch.randn(4, 16)
    kw = {"example_inputs": (x,)} if with_inputs else {}
    amprewrite.transform(model, torch.bfloat16, verify=False, **kw)
    gc.collect()
    before = set(_loader.eval_cache)
    gm = amprewrite.transform(model, torch.bfloat16, verify=False, **kw)
    key = type(gm).forward.__code__.co_filename
    assert "def forward" in "".join(linecache.getlines(key))
    del gm
    gc.collect()
    assert set(_loader.eval_cache) <= before


class Branchy(nn.Module):
    """A data-dependent branch: dynamo cannot export it."""

    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


def test_a_failed_capture_leaves_dynamos_state_as_it_was():
    """A capture that fails exports the model once more, as a user would, to tell whose
    failure it is; that export's backend, guards and cache entries are released too."""
    model, x = Branchy(), torch.randn(4, 16)
    with pytest.raises(amprewrite.CaptureError):
        amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    gc.collect()
    before = (_dynamo_state(model), len(weakref.finalize._registry))
    for _ in range(3):
        with pytest.raises(amprewrite.CaptureError):
            amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    gc.collect()
    after = (_dynamo_state(model), len(weakref.finalize._registry))
    assert after[0] == before[0]
    assert after[1] <= before[1]


def test_the_capture_leaves_older_objects_to_the_collector_after_it(monkeypatch):
    """During the capture, objects from before the transform are frozen (a full collection set
    off by the capture's objects skipped them); after it the process's collector is as it was,
    and a process that froze objects itself keeps them frozen."""
    from amprewrite import api

    seen = []
    real = api.capture_model

    def watched(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "capture_model", watched)
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    amprewrite.transform(model, example_inputs=(torch.randn(2, 4),))
    assert seen[0] > 1000 and gc.get_freeze_count() == 0 and gc.isenabled()

    gc.freeze()  # the process's own freeze (before forking workers, say)
    try:
        mine = gc.get_freeze_count()  # it only shrinks as frozen objects are freed
        amprewrite.transform(model, example_inputs=(torch.randn(2, 4),))
        assert mine - 1000 < seen[1] <= mine and 0 < gc.get_freeze_count() <= seen[1]
    finally:
        gc.unfreeze()
    with pytest.raises(amprewrite.errors.CaptureError):  # a failed transform unfreezes too
        amprewrite.transform(nn.Linear(4, 4), example_inputs=(torch.randn(2, 5),))
    assert gc.get_freeze_count() == 0
