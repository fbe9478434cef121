"""amprewrite.graph.codegen writes the source torch.fx writes, byte for byte, or lets fx write
it."""

import operator

import pytest
import torch
from torch import fx

import amprewrite
from amprewrite.graph import codegen
from amprewrite.testing import zoo


class Stack(torch.nn.Module):
    """Transformer-like blocks: layer norm, linear, softmax attention, GELU, BatchNorm."""

    def __init__(self, blocks: int, d: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({
            "ln": torch.nn.LayerNorm(d), "qkv": torch.nn.Linear(d, 3 * d),
            "fc": torch.nn.Linear(d, d), "bn": torch.nn.BatchNorm1d(d)}) for _ in range(blocks)])

    def forward(self, x):
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln"](x)).chunk(3, -1)
            x = x + b["fc"](torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v)
            x = b["bn"](torch.nn.functional.gelu(x).transpose(1, 2)).transpose(1, 2)
        return x


def _same(graph: fx.Graph) -> None:
    fast = codegen._generate(graph, "self")
    slow = fx.Graph.python_code(graph, "self")
    assert fast.src == slow.src
    assert fast._lineno_map == slow._lineno_map
    assert fast._prologue_start == slow._prologue_start
    assert fast.globals.keys() == slow.globals.keys()
    assert all(fast.globals[k] is slow.globals[k] for k in slow.globals)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("train", [False, True])
def test_transformed_stack_is_written_as_fx_writes_it(dtype, train):
    gm = amprewrite.transform(Stack(2).train(train), dtype=dtype)
    _same(gm.graph)


@pytest.mark.parametrize("dtype", [torch.bfloat16,
                                   pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_dynamo_graph_is_written_as_fx_writes_it(dtype):
    """A dynamo capture: pytree codegen (flatten in, unflatten out), HF attention, masks."""
    model, inputs = zoo.gpt2()
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=inputs)
    assert type(gm.graph._codegen) is fx.graph._PyTreeCodeGen
    _same(gm.graph)


def test_recompiled_module_runs_the_same_code():
    gm = amprewrite.transform(Stack(1), dtype=torch.bfloat16)
    written = gm.code
    codegen.recompile(gm)
    assert gm.code == written
    assert "python_code" not in vars(gm.graph)  # the override is gone after the recompile
    x = torch.randn(2, 8, 16)
    ours = gm(x)
    gm.recompile()  # fx's own
    assert gm.code == written
    assert torch.equal(gm(x), ours)


def test_self_check_turns_the_writer_off_where_fx_spells_differently(monkeypatch):
    monkeypatch.setitem(codegen._state, "ok", None)
    monkeypatch.setattr(codegen, "_magic", {**codegen._magic, "add": "{0}  +  {1}"})
    assert not codegen._enabled()
    gm = fx.symbolic_trace(lambda x: x + 1)
    code = codegen.python_code(gm.graph)  # fx writes it
    assert code.src == fx.Graph.python_code(gm.graph, "self").src
    assert "x + 1" in code.src


def test_check_mode_raises_when_the_two_differ(monkeypatch):
    gm = fx.symbolic_trace(lambda x: torch.relu(x))
    wrong = fx.Graph.python_code(gm.graph, "self")
    wrong.src = wrong.src.replace("relu", "sigmoid")
    monkeypatch.setattr(codegen, "_generate", lambda graph, root: wrong)
    with pytest.raises(AssertionError, match=r"differently from torch\.fx"):
        codegen.python_code(gm.graph)


def _graph_with(arg: object, annotate: bool = False) -> fx.Graph:
    graph = fx.Graph()
    x = graph.placeholder("x", type_expr=torch.Tensor if annotate else None)
    y = graph.call_function(torch.add, (x, arg))
    graph.output(y)
    return graph


@pytest.mark.parametrize("graph", [
    _graph_with({"a": 1}),  # a dict: fx prints it with repr, its nodes by their renames
    _graph_with(1, annotate=True),  # a type annotation
    _graph_with(torch.Size([2, 3])),
    _graph_with((slice(1, None), ..., None, torch.float16, torch.device("cpu"), "s", 1.5)),
], ids=["dict", "annotation", "size", "constants"])
def test_other_arguments_come_out_as_fx_writes_them(graph):
    code = codegen.python_code(graph)
    assert code.src == fx.Graph.python_code(graph, "self").src


def test_names_that_collide_with_globals_are_renamed_as_fx_renames_them():
    """A node named like a global the code needs (``getattr``, a wrapped function, ``torch``)
    is renamed by the namespace in the order fx asks it."""
    graph = fx.Graph()
    x = graph.placeholder("torch")
    a = graph.call_function(operator.getitem, (x, 0))
    a.name = "getattr"
    b = graph.call_function(getattr, (x, "shape"))
    c = graph.call_function(codegen._check_fn, (a, b))
    c.name = "amprewrite_codegen__check_fn"
    graph.output((a, b, c))
    _same(graph)


def _module_graph() -> fx.GraphModule:
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.scale = 2.0

        def forward(self, x):
            return self.layers[0](x) * self.scale + self.layers[0].weight.sum()

    return fx.symbolic_trace(M())


def _break(kind: str, gm: fx.GraphModule) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    linear = next(n for n in nodes if n.op == "call_module")
    weight = next(n for n in nodes if n.op == "get_attr")
    if kind == "name":
        weight.name = linear.name
    elif kind == "order":  # a user before the value it reads
        nodes[1].prepend(nodes[-2])
    elif kind == "foreign":
        other = fx.Graph()
        linear.args = (other.placeholder("y"),)
    elif kind == "attribute":
        weight.target = "layers.0.nothing"
    elif kind == "module":  # call_module on a parameter
        linear.target = "layers.0.weight"
    elif kind == "callable":
        next(n for n in nodes if n.op == "call_function").target = 3


@pytest.mark.parametrize("kind", ["name", "order", "foreign", "attribute", "module",
                                  "callable"])
def test_lint_finds_what_fx_lint_finds_and_raises_its_message(kind):
    gm = _module_graph()
    codegen.lint(gm.graph)  # well formed: no error
    _break(kind, gm)
    with pytest.raises((RuntimeError, ValueError)) as fx_error:
        gm.graph.lint()
    with pytest.raises(type(fx_error.value)) as ours:
        codegen.lint(gm.graph)
    assert str(ours.value) == str(fx_error.value)
    assert not codegen._lint_ok(gm.graph)
