"""Other input shapes than the example's, and the built-in check (``verify=``).

A graph captured from example inputs runs on every shape the model accepts: inputs the graph
was not captured for run on a graph transformed for them (once per new shape class), and
shapes the model itself rejects raise one ShapeError paragraph, never an error from inside the
graph or a result for the captured shape.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite import ShapeError, VerificationError
from amprewrite.show.numerics import rel_err
from amprewrite.testing import zoo

from ..helpers import corrupt_a_linear, unchanged


def _autocast_err(model, ref, *args):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*args)
    out = out.logits if hasattr(out, "logits") else out
    return rel_err(out.float(), ref)


def test_llama_captured_at_batch_1_runs_at_other_batches_and_lengths():
    model, (ids,) = zoo.llama()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(ids[:1, :16],))
    for shape in [(1, 16), (4, 16), (4, 9), (2, 33), (3, 5)]:
        x = torch.randint(0, 256, shape)
        with torch.no_grad():
            ref = model(x).logits
            out = gm(x).logits
        assert out.shape == ref.shape
        # Within rounding of autocast's error on the same inputs.
        assert rel_err(out, ref) <= 1.05 * _autocast_err(model, ref, x) + 1e-4, shape
    # Batch 1 is its own code path in the model (HF's mask code); every batch >= 2 and every
    # length share one graph: the first new shape makes the dimensions that changed dynamic.
    assert len(gm._amp_variants) <= 2


def test_cnn_captured_at_batch_1_runs_at_batch_4_and_another_image_size():
    model, (x,) = zoo.resnet()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x[:1],))
    for inp in [x[:1], torch.randn(4, *x.shape[1:]), torch.randn(2, x.shape[1], 48, 40)]:
        with torch.no_grad():
            ref = model(inp)
            out = gm(inp)
        assert rel_err(out, ref) <= 1.5 * _autocast_err(model, ref, inp) + 1e-3


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0):
        return self.l(x) * scale


def test_changed_non_tensor_argument_is_not_served_by_the_baked_graph():
    model = Scaled()
    x = torch.randn(2, 8)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs={"x": x, "scale": 3.0})
    with torch.no_grad():
        assert torch.allclose(gm(x, scale=5.0), model(x, scale=5.0), rtol=2e-2, atol=2e-2)
        assert torch.allclose(gm(x, scale=3.0), model(x, scale=3.0), rtol=2e-2, atol=2e-2)


def test_size_baked_into_the_model_raises_one_clear_paragraph():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(2, 8),))
    with unchanged(model), pytest.raises(ShapeError) as err:
        gm(torch.randn(2, 16))
    msg = str(err.value)
    assert "\n" not in msg
    assert "input 'input' dimension 1 was captured with size 8" in msg
    assert "has size 16" in msg and "fails on the given example_inputs" in msg


def test_on_new_shape_error_refuses_instead_of_transforming():
    model = nn.Sequential(nn.Linear(8, 8))
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(1, 8),),
                              on_new_shape="error")
    gm(torch.randn(1, 8))
    with pytest.raises(ShapeError, match=r"dimension 0 was captured with size 1.*has size 4"):
        gm(torch.randn(4, 8))


def test_policy_rejects_unknown_on_new_shape():
    with pytest.raises(amprewrite.PolicyError, match="on_new_shape"):
        amprewrite.transform(nn.Linear(2, 2), torch.bfloat16, on_new_shape="maybe")


def test_compiled_graph_checks_shapes_too():
    """Under torch.compile too (fullgraph included), new shapes run on graphs made for them,
    and the graph's first node refuses inputs it was not captured for."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(1, 8),))
    x = torch.randn(1, 8)
    with torch.no_grad():
        full = torch.compile(gm, backend="eager", fullgraph=True)
        assert torch.allclose(full(x), model(x), rtol=3e-2, atol=3e-2)
        # The dispatcher runs eagerly under compile: a new shape gets its own graph.
        for batch in (3, 5):
            x = torch.randn(batch, 8)
            assert torch.allclose(full(x), model(x), rtol=3e-2, atol=3e-2)
        # A graph called around the dispatcher (its forward directly) still checks its inputs.
        with pytest.raises(ShapeError, match="backend='amprewrite'"):
            torch.compile(gm.forward, backend="eager")(torch.randn(3, 8))
        # The backend's graph run as it is (inner eager): the shapes are the point, not
        # inductor's kernels (test_backend.py compiles with inductor).
        by_backend = torch.compile(model, backend="amprewrite", options={"inner": "eager"})
        for batch in (1, 3, 5):
            x = torch.randn(batch, 8)
            assert torch.allclose(by_backend(x), model(x), rtol=3e-2, atol=3e-2)


# --- the built-in check ----------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1)


def test_broken_graph_raises_verification_error_naming_the_node(monkeypatch):
    corrupt_a_linear(monkeypatch)
    model = Attention().eval()
    with unchanged(model), pytest.raises(VerificationError) as err:
        amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(2, 8, 16),))
    msg = str(err.value)
    assert "first node that departs from fp32 is 'linear'" in msg
    # The advice names the broken linear's module first (a new capture has it; the helper then
    # breaks the next low linear, 'k', so the search adds it), and works as printed.
    assert err.value.keep_fp32 == ["q", "k"], msg
    assert "keep_fp32=['q', 'k'], it passes this check" in msg and "\n" not in msg
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(2, 8, 16),),
                              keep_fp32=err.value.keep_fp32)
    assert [d.reason for d in amprewrite.report(gm).decisions if d.node == "linear"] == [
        "keep_fp32='q'"]
    # verify=False returns the (broken) graph: the check is the only thing that stopped it.
    amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(2, 8, 16),),
                         verify=False)


def test_check_runs_by_default_and_is_reported():
    model = Attention().eval()
    gm = amprewrite.transform(model, torch.float16, example_inputs=(torch.randn(2, 8, 16),))
    report = amprewrite.report(gm)
    assert any(n.startswith("verify: output error") for n in report.notes)
    assert "verify" in report.timings


def test_check_runs_in_train_mode_and_says_so():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(4, 8),))
    notes = [n for n in amprewrite.report(gm).notes if n.startswith("verify:")]
    assert len(notes) == 1 and notes[0].startswith("verify: output error"), notes
    assert "train mode" in notes[0]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  for n in ("gpt2", "unet2d")])
def test_real_model_captured_at_batch_1_runs_at_batch_4_and_another_size(name):
    model, inputs = getattr(zoo, name)()
    first = tuple(t[:1] for t in inputs)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=first)
    if name == "gpt2":
        others = [(torch.randint(0, 256, (4, 64)),), (torch.randint(0, 256, (4, 23)),)]
    else:  # UNet2DModel: batch 4, and a 24x24 image
        others = [(torch.randn(4, 3, 16, 16), torch.tensor([10, 500, 3, 999])),
                  (torch.randn(2, 3, 24, 24), torch.tensor([7, 70]))]
    for inp in [first, *others]:
        with torch.no_grad():
            ref = zoo.first_tensor(zoo.call(model, inp))
            out = zoo.first_tensor(zoo.call(gm, inp))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = zoo.first_tensor(zoo.call(model, inp))
        assert out.shape == ref.shape
        assert rel_err(out, ref) <= 1.5 * rel_err(auto.float(), ref) + 1e-3


# --- the call path ----------------------------------------------------------------------------
def test_plain_positional_call_skips_pytree_and_keeps_results_and_hooks():
    """The common call (positional tensors, no keywords, no hooks) runs the graph's code
    generated without pytree flatten/unflatten or the in-graph check; same results."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    fast = gm._amp_fast
    assert fast is not None and fast.n == 1 and fast.kind == "leaf"
    assert "tree_flatten_spec" in gm.code and "amp_input_check" in gm.code
    calls = []
    original = fast.fn
    fast.fn = lambda *a: calls.append(1) or original(*a)
    out = gm(x)
    assert calls and torch.equal(out, gm.forward(x))  # the fast path ran, bit-exact
    seen = []
    handle = gm.register_forward_hook(lambda mod, args, output: seen.append(output))
    calls.clear()
    hooked = gm(x)
    assert seen and not calls and torch.equal(hooked, out)  # hooks: the ordinary call
    handle.remove()
    with pytest.raises(ShapeError):  # a size the model rejects still raises, named
        gm(torch.randn(2, 16))


def test_dict_inputs_and_structured_outputs_take_the_ordinary_call():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, scale=2.0):
            return {"y": self.l(x) * scale, "z": (x.sum(), x.mean())}

    x = torch.randn(3, 4)
    net = Net()
    gm = amprewrite.transform(net, torch.bfloat16, example_inputs=(x,))
    out = gm(x)
    assert set(out) == {"y", "z"} and isinstance(out["z"], tuple)
    assert torch.equal(out["y"], gm.forward(x)["y"])
    kw = amprewrite.transform(net, torch.bfloat16, example_inputs={"x": x})
    assert torch.equal(kw(x=x)["y"], out["y"])  # keywords: bound to the signature


# --- calls with inputs the graph was not captured with (issue 47, item 4) -------------------

class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, mask=None):
        y = self.l(x)
        return y if mask is None else y * mask


def test_a_keyword_the_graph_was_not_captured_with_names_the_captured_inputs_and_the_way():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 256, (2, 12))
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(ids,), verify=False)
    with pytest.raises(amprewrite.SignatureError) as err:
        gm(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert isinstance(err.value, TypeError) and isinstance(err.value, amprewrite.AmpRewriteError)
    msg = str(err.value)
    assert "\n" not in msg
    assert "captured with the inputs (input_ids) and no others" in msg
    assert "called with the keyword input attention_mask" in msg
    assert ("example_inputs={'input_ids': input_ids, 'attention_mask': attention_mask}"
            in msg)


def test_an_extra_positional_or_a_missing_input_is_a_signature_error_too():
    x, mask = torch.randn(2, 8), torch.ones(2, 8)
    gm = amprewrite.transform(Masked(), torch.bfloat16, example_inputs=(x,), verify=False)
    with pytest.raises(amprewrite.SignatureError,
                       match=r"captured with the inputs \(x\) and no others, and was called "
                             r"with 2 positional inputs \(the extra ones are the model's mask\)"
                             r".*example_inputs=\{'x': x, 'mask': mask\}"):
        gm(x, mask)
    both = amprewrite.transform(Masked(), torch.bfloat16, example_inputs={"x": x, "mask": mask},
                                verify=False)
    assert both(x, mask).shape == both(x=x, mask=mask).shape == (2, 8)
    with pytest.raises(amprewrite.SignatureError,
                       match=r"captured with the inputs \(x, mask\).*missing a required "
                             r"argument: 'mask'. Pass every input it was captured with"):
        both(x)
    # No model left to name the extra input (params="low" keeps only a weak reference to it).
    low = amprewrite.transform(Masked(), torch.bfloat16, example_inputs=(x,), params="low",
                               verify=False)
    with pytest.raises(amprewrite.SignatureError,
                       match=r"as a tuple of every positional input: example_inputs=\(x, \.\.\.\)"):
        low(x, mask)


def test_a_keyword_that_goes_into_kwargs_is_suggested_by_its_own_name():
    """forward(x, **kwargs) called with double=True: the advice names 'double' (what a
    transformers model's output_attentions=True is), not forward's 'kwargs'."""
    import amprewrite

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x, **kwargs):
            return self.fc(x) * (2.0 if kwargs.get("double") else 1.0)

    x = torch.randn(2, 4)
    gm = amprewrite.transform(Model(), "bf16", example_inputs=(x,))
    with pytest.raises(amprewrite.SignatureError) as err:
        gm(x, double=True)
    assert "example_inputs={'x': x, 'double': double}" in str(err.value)
    assert "'kwargs'" not in str(err.value)
