"""The cast plan's min-cut on hand-built graphs: where casts go, how many, and what it refuses.

Each graph is built node by node with the meta the plan reads (ValueInfo with sizes, precision
class, natural precision), so the tests pin the plan down independently of capture and painting.
"""

import torch
from torch import fx

from amprewrite.graph import meta as M
from amprewrite.precision.cast_plan import plan_labels, requirement
from amprewrite.precision.ops import Precision

LOW = torch.bfloat16


class G:
    """A graph under construction: ``x = g.input(numel)``, ``g.op(cls, *inputs, numel=)``."""

    def __init__(self):
        self.graph = fx.Graph()
        self.gm = fx.GraphModule(torch.nn.Module(), self.graph)

    def _meta(self, n: fx.Node, numel: int, cls, natural) -> fx.Node:
        n.meta[M.ORIG] = M.ValueInfo("tensor", torch.float32, numel)
        n.meta[M.CLASS] = cls
        n.meta[M.NATURAL] = natural
        return n

    def input(self, numel: int) -> fx.Node:
        return self._meta(self.graph.placeholder(f"x{len(self.graph.nodes)}"), numel, None,
                          M.HIGH)

    def op(self, cls: Precision, *inputs: fx.Node, numel: int, name: str) -> fx.Node:
        n = self.graph.call_function(torch.add, tuple(inputs), name=name)
        natural = {Precision.LOW: M.LOW, Precision.FP32: M.HIGH}.get(cls)
        if natural is None:  # PROMOTE / NEUTRAL: the widest input
            ins = [i.meta[M.NATURAL] for i in inputs]
            natural = M.HIGH if M.HIGH in ins else M.LOW
        return self._meta(n, numel, cls, natural)

    def plan(self, *outputs: fx.Node) -> int:
        self.graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        return plan_labels(self.gm, keep_io_dtype=True, low_dtype=LOW)

    def casts(self) -> list[tuple[str, str]]:
        """(value, consumer) pairs whose labels differ where the consumer needs a label."""
        out = []
        for c in self.graph.nodes:
            for v in c.all_input_nodes:
                need = (c.meta[M.LABEL] if c.meta.get(M.CLASS) == Precision.NEUTRAL
                        else requirement(c, v, True, LOW))
                if need is not None and need != v.meta[M.LABEL]:
                    out.append((v.name, c.name))
        return out


N, L, F = Precision.NEUTRAL, Precision.LOW, Precision.FP32


def test_cast_goes_after_a_shrinking_neutral_op():
    """fp32 x (4,000 bytes) -> slice (40 bytes) -> linear: cast the slice, not x."""
    g = G()
    x = g.input(1000)
    s = g.op(N, x, numel=10, name="sliced")
    lin = g.op(L, s, numel=10, name="linear")
    assert g.plan(lin) == 1
    assert s.meta[M.LABEL] == M.HIGH
    assert ("sliced", "linear") in g.casts() and ("x0", "sliced") not in g.casts()


def test_cast_goes_before_a_growing_neutral_op():
    """fp32 x (40 bytes) -> expand (4,000 bytes) -> linear: cast x, expand in low precision."""
    g = G()
    x = g.input(10)
    e = g.op(N, x, numel=1000, name="expand")
    lin = g.op(L, e, numel=1000, name="linear")
    g.plan(lin)
    assert e.meta[M.LABEL] == M.LOW
    assert g.casts()[0] == ("x0", "expand")


def test_one_cast_serves_every_consumer():
    """A value read by three low ops through one neutral op: one cast, shared."""
    g = G()
    x = g.input(100)
    r = g.op(N, x, numel=100, name="relu")
    outs = [g.op(L, r, numel=100, name=f"linear{i}") for i in range(3)]
    g.plan(*outs)
    low_casts = [c for c in g.casts() if not c[1].startswith("output")]
    assert {v for v, _ in low_casts} == {low_casts[0][0]}  # all from the same value
    assert len({v for v, _ in low_casts}) == 1


def test_no_low_round_trip_for_a_value_an_fp32_op_also_reads():
    """relu (big) feeds a linear (low) and, through a small slice, softmax (fp32). Bytes alone
    say: relu low, cast the slice back up. That hands softmax values rounded to low precision
    (a low -> high round trip): refused; relu stays fp32 and is cast down for the linear."""
    g = G()
    x = g.input(100)
    r = g.op(N, x, numel=10_000, name="relu")
    s = g.op(N, r, numel=10, name="sliced")
    soft = g.op(F, s, numel=10, name="softmax")
    lin = g.op(L, r, numel=10_000, name="linear")
    g.plan(soft, lin)
    assert r.meta[M.LABEL] == s.meta[M.LABEL] == M.HIGH
    assert ("relu", "linear") in g.casts() and ("sliced", "softmax") not in g.casts()


def test_neutral_chain_between_low_ops_stays_low():
    """linear -> view -> relu -> linear: nothing to cast inside a low region."""
    g = G()
    x = g.input(100)
    a = g.op(L, x, numel=100, name="linear_a")
    v = g.op(N, a, numel=100, name="view")
    r = g.op(N, v, numel=100, name="relu")
    b = g.op(L, r, numel=100, name="linear_b")
    g.plan(b)
    assert v.meta[M.LABEL] == r.meta[M.LABEL] == M.LOW
    assert [c for c in g.casts() if c[1] in ("view", "relu", "linear_b")] == []


def test_independent_components_are_cut_separately():
    """Two unrelated chains each get their own optimum (no global flow problem)."""
    g = G()
    x, y = g.input(1000), g.input(10)
    s = g.op(N, x, numel=10, name="sliced")
    e = g.op(N, y, numel=1000, name="expand")
    out = [g.op(L, s, numel=10, name="lin1"), g.op(L, e, numel=1000, name="lin2")]
    assert g.plan(*out) == 2
    assert s.meta[M.LABEL] == M.HIGH and e.meta[M.LABEL] == M.LOW


def test_exhaustive_small_cuts_agree_with_networkx(monkeypatch):
    """Components of up to 4 free nodes are solved by trying every labelling (fast); it must
    give networkx's labels on real graphs."""
    import amprewrite
    from amprewrite.demo import demo_model
    from amprewrite.precision.cast_plan import _Flow
    from amprewrite.testing.zoo import resnet

    cases = [demo_model(), resnet()]

    def labels():
        out = []
        for model, inputs in cases:
            gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs, verify=False)
            out.append({n.name: n.meta.get(M.LABEL) for n in gm.graph.nodes})
        return out

    fast = labels()
    monkeypatch.setattr(_Flow, "EXHAUSTIVE", 0)
    assert labels() == fast


def test_a_power_of_two_scale_is_free_so_gelu_reads_its_input_through_one_cast():
    """GPT-2's GELU, ``0.5 * h * (1 + tanh(c * (h + 0.044715 * h ** 3)))`` after a low linear:
    ``pow`` needs ``h`` in fp32, and ``0.5 * h`` (exact in any dtype: the NEUTRAL family
    exact_scale) is computed there too, so ``h`` is cast up once, not once per reader.
    ``3 * h`` (not a power of two) stays arithmetic, computed in its input's precision."""
    import math

    import amprewrite

    class Gelu(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x)
            gelu = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2 / math.pi)
                                               * (h + 0.044715 * torch.pow(h, 3.0))))
            return gelu + 3 * h

    x = torch.randn(4, 16)
    gm = amprewrite.transform(Gelu().eval(), torch.bfloat16, example_inputs=(x,))
    decisions = {d.node: d for d in amprewrite.report(gm).decisions}
    linear = next(n for n in gm.graph.nodes if n.target is torch._C._nn.linear)
    up = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"
          and n.args[1] == torch.float32]
    # h once for the GELU (0.5 * h had its own cast when it was arithmetic), 3 * h for the sum
    assert len(up) == 2 and up[0].args[0] is linear, up
    scales = [d for d in decisions.values() if d.family == "exact_scale"]
    assert [(d.precision, d.dtype) for d in scales] == [("neutral", "torch.float32")], scales
    three = [d for d in decisions.values() if d.family == "arith" and d.dtype == "torch.bfloat16"]
    assert three, decisions  # 3 * h reads the low h directly


def test_the_report_says_what_the_fp32_outputs_cost():
    """keep_io_dtype=True: the report names the output casts and the bytes they move a call
    (read low, write fp32); keep_io_dtype=False: no casts, no note."""
    import amprewrite

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    notes = amprewrite.report(amprewrite.transform(model, "bf16", example_inputs=(x,))).notes
    said = [n for n in notes if n.startswith("keep_io_dtype=True")]
    assert said == [said[0]] and "1 output" in said[0]
    assert "192 bytes a call at the captured sizes (32 elements read in 2 bytes" in said[0]
    low = amprewrite.transform(model, "bf16", example_inputs=(x,), keep_io_dtype=False)
    assert low(x).dtype == torch.bfloat16
    assert not any(n.startswith("keep_io_dtype") for n in amprewrite.report(low).notes)
