"""normalize_modules alone: known leaf modules become functional calls on get_attr weights.

Property: every call_module of a module class with a lowering becomes a call_function that reads
the module's parameters through get_attr nodes (same names, same tensors), its output bit-equal
to the module's; modules whose behaviour the lowering cannot keep (mode-dependent, hooked,
called with keywords) stay calls. The pass does not depend on the target dtype.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amprewrite.graph import meta as M
from amprewrite.passes import run_pass

from ..helpers import LOW_DTYPES, graph_signature, prepared, rewrites, unchanged


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_module")]


def test_linear_and_conv_become_functional_with_their_weights():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 25, 2))
    gm, p = prepared(model, "normalize_modules")
    assert run_pass(gm, p)
    targets = _targets(gm)
    assert torch.conv2d in targets or F.conv2d in targets
    assert F.linear in targets or torch._C._nn.linear in targets
    attrs = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= attrs
    # Every node made carries the module's provenance, and the get_attrs their ValueInfo.
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            assert n.meta[M.MODULE_PATH] in ("0", "2") and n.meta[M.ORIG].dtype == torch.float32
    x = torch.randn(2, 3, 5, 5)
    assert torch.equal(gm(x), model(x))
    assert [r.module_path for r in rewrites(gm, "normalize_modules")] == ["0", "1", "2"]


def test_mode_dependent_and_hooked_modules_stay_modules():
    lin = nn.Linear(4, 4)
    lin.register_forward_hook(lambda *a: None)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.5), lin)
    gm, p = prepared(model, "normalize_modules")
    run_pass(gm, p)
    kept = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert kept == ["0", "1", "2"]  # BatchNorm and Dropout follow gm.train(); hooks must run
    assert not rewrites(gm, "normalize_modules")


# (module, input): every module class with a lowering in the registry, on a tiny input.
LOWERED = [
    (nn.Linear(4, 3), (2, 4)),
    (nn.Conv1d(2, 3, 3, padding=1), (2, 2, 5)),
    (nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), (1, 2, 4, 4)),
    (nn.Conv3d(2, 3, 1), (1, 2, 2, 2, 2)),
    (nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1), (1, 2, 3, 3)),
    (nn.LayerNorm(4), (2, 3, 4)),
    (nn.GroupNorm(2, 4), (2, 4, 3)),
    (nn.RMSNorm(4), (2, 4)),
    (nn.Softmax(-1), (2, 4)),
    (nn.LogSoftmax(1), (2, 4)),
    (nn.GELU("tanh"), (2, 4)),
    (nn.SiLU(), (2, 4)),
    (nn.Sigmoid(), (2, 4)),
    (nn.Tanh(), (2, 4)),
    (nn.ReLU(), (2, 4)),
    (nn.Flatten(), (2, 3, 4)),
    (nn.Upsample(scale_factor=2), (1, 2, 3, 3)),
    (nn.AdaptiveAvgPool3d(2), (1, 2, 4, 4, 4)),
]


def _weights(module: nn.Module) -> set[str]:
    return {f"0.{k}" for k, _ in module.named_parameters()}


@pytest.mark.parametrize("module, shape", LOWERED, ids=[type(m).__name__ for m, _ in LOWERED])
def test_every_lowered_module_becomes_a_function_of_its_get_attr_weights(module, shape):
    """No call_module is left; each of the module's parameters is one get_attr the call reads;
    the output is bit-equal to the module's."""
    torch.manual_seed(0)
    model = nn.Sequential(module)
    gm, p = prepared(model, "normalize_modules")
    assert run_pass(gm, p)
    assert not gm.graph.find_nodes(op="call_module")
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not F.pad]
    read = {str(a.target) for a in call.all_input_nodes if a.op == "get_attr"}
    assert read == _weights(module)
    assert {str(n.target) for n in gm.graph.find_nodes(op="get_attr")} == _weights(module)
    x = torch.randn(shape)
    assert torch.equal(gm(x), model(x))


def test_embedding_lookup_is_bit_equal():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0))
    gm, p = prepared(model, "normalize_modules")
    assert run_pass(gm, p)
    (call,) = gm.graph.find_nodes(op="call_function", target=F.embedding)
    assert [a.target for a in call.all_input_nodes if a.op == "get_attr"] == ["0.weight"]
    ids = torch.tensor([[0, 3, 9], [1, 1, 0]])
    assert torch.equal(gm(ids), model(ids))


def test_lowering_is_the_same_for_both_dtypes():
    """normalize does not depend on the target dtype: the graph bf16 gets is fp16's."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.SiLU(), nn.Flatten(),
                          nn.Linear(12, 2))
    x = torch.randn(2, 2, 4, 4)
    graphs = []
    for dtype in LOW_DTYPES:
        gm, p = prepared(model, "normalize_modules", dtype=dtype)
        assert run_pass(gm, p)
        assert torch.equal(gm(x), model(x))
        graphs.append(graph_signature(gm))
    assert graphs[0] == graphs[1]
    assert len(graphs[0]) == 13  # input, 5 functions, 6 weights, output


def test_state_dict_keys_and_parameters_are_the_models():
    """The lowered modules stay in gm: the weights keep their names and are the same tensors."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    gm, p = prepared(model, "normalize_modules")
    with unchanged(model):
        run_pass(gm, p)
    assert gm.state_dict().keys() == model.state_dict().keys()
    for name, param in model.named_parameters():
        assert gm.get_parameter(name) is param


def test_a_module_called_twice_reads_its_weights_at_each_call():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    torch.manual_seed(0)
    model = Twice()
    gm, p = prepared(model, "normalize_modules")
    assert run_pass(gm, p)
    linears = gm.graph.find_nodes(op="call_function", target=F.linear)
    assert len(linears) == 2 and not gm.graph.find_nodes(op="call_module")
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), model(x))


def test_a_keyword_call_stays_a_module():
    """The lowerings take the input positionally: ``self.fc(input=x)`` is left as it is."""

    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.fc(input=x))

    model = Kw()
    gm, p = prepared(model, "normalize_modules")
    assert run_pass(gm, p)  # the positional call is lowered
    assert [n.target for n in gm.graph.find_nodes(op="call_module")] == ["fc"]
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), model(x))


def test_kept_batch_norm_still_follows_train_and_eval():
    """BatchNorm stays a module call: gm.eval() uses the running statistics, gm.train() the
    batch's and updates them, exactly as the model does in each mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        model[1].running_mean.fill_(3.0)
        model[1].running_var.fill_(0.25)
    ref = copy.deepcopy(model)
    gm, p = prepared(model, "normalize_modules")
    run_pass(gm, p)
    x = torch.randn(5, 4)
    gm.eval(), ref.eval()
    evaluated = gm(x)
    assert torch.equal(evaluated, ref(x))
    gm.train(), ref.train()
    trained = gm(x)
    assert torch.equal(trained, ref(x))
    assert not torch.equal(trained, evaluated)  # the mode reached the kept module
    assert torch.equal(gm.get_buffer("1.running_mean"), ref[1].running_mean)
