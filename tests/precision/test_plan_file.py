"""Saved plans: save_plan writes every decision, transform(plan=...) applies it again
(DESIGN.md, "The plan as an artefact"; docs/guide.md, "Plans")."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.errors import PolicyError
from amprewrite.passes import float8_linears, record_ranges
from amprewrite.precision.plan_file import diff_plans, show_plan
from amprewrite.testing import zoo
from tests.compile.test_backend import Checkpointed  # two checkpointed blocks


def _decisions(gm) -> dict[str, tuple]:
    """Each decided node's (class, compute dtype, storage dtype) by its plan key."""
    return {d.key: (d.precision, d.dtype, d.storage) for d in amprewrite.report(gm).decisions
            if d.key is not None and d.precision not in ("input", "param", "output", "nonfloat")}


def _casts(gm) -> list[tuple]:
    """The casts of a graph: (its key, the value's key and the dtype; whether it is a
    cast_if_float)."""
    return sorted((d.key, d.node.startswith("cast_if_float")) for d in
                  amprewrite.report(gm).decisions if d.precision == "cast")


@pytest.fixture(scope="module")
def llama_fp16():
    """The zoo's LLaMA transformed in fp16 on its example inputs, and its plan's text."""
    model, inputs = zoo.llama()
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs, progress=False)
    return model, inputs, gm, amprewrite.save_plan(gm)


def _no_probes_or_ranges(monkeypatch):
    """Make a kernel probe, a ranges run or a weight's range read fail the test: the plan must
    make them needless."""
    def refuse(*args, **kwargs):
        raise AssertionError("a saved plan was applied, yet this ran")

    monkeypatch.setattr(record_ranges, "record_ranges", refuse)
    monkeypatch.setattr(record_ranges, "tensor_range", refuse)
    monkeypatch.setattr("amprewrite.passes.paint_precision.low_kernel_problem", refuse)
    monkeypatch.setattr("amprewrite.passes.paint_precision.mixed_problem", refuse)


# --- round trip -----------------------------------------------------------------------------
def test_llama_plan_applied_to_a_fresh_instance_gives_the_same_code_and_report(
        llama_fp16, tmp_path, monkeypatch):
    _, inputs, gm, text = llama_fp16
    path = tmp_path / "plan.json"
    path.write_text(text)
    fresh, _ = zoo.llama()  # a new instance, built again
    _no_probes_or_ranges(monkeypatch)
    again = amprewrite.transform(fresh, "fp16", example_inputs=inputs, plan=path,
                                 progress=False)
    assert again.code == gm.code
    first, second = amprewrite.report(gm), amprewrite.report(again)
    assert second.decisions == first.decisions
    assert second.rewrites == first.rewrites
    assert second.notes == first.notes
    assert second.plan.new == [] and second.plan.missing == []
    assert second.plan.applied == sum(d.precision in ("low", "fp32", "promote", "neutral")
                                      for d in first.decisions) + sum(
        r.action.startswith("remove") for r in first.rewrites)
    assert "verify" in second.timings  # the built-in check still ran on the inputs
    out = zoo.first_tensor(zoo.call(again, inputs))
    assert torch.equal(out, zoo.first_tensor(zoo.call(gm, inputs)))


def test_a_plan_is_the_same_file_when_the_same_model_is_captured_again(llama_fp16):
    _, inputs, _, text = llama_fp16
    fresh, _ = zoo.llama()
    gm = amprewrite.transform(fresh, "fp16", example_inputs=inputs, progress=False)
    assert amprewrite.save_plan(gm) == text
    data = json.loads(text)
    assert data["dtype"] == "float16" and data["model"] == "LlamaForCausalLM"
    assert data["made_with"]["torch"] == torch.__version__
    assert data["policy"]["keep_fp32"] == [] and data["policy"]["overflow"] == "auto"
    nodes = data["graphs"][0]["plans"][0]["nodes"]
    norm = nodes["model.norm:pow#0"]
    assert norm["class"] == "fp32" and norm["range"]["batches"] == 1
    # small: one line a node (a few hundred bytes each at most)
    assert len(text) < 300 * len(nodes) and len(text.splitlines()) < len(nodes) + 60
    assert (len(nodes), round(len(text) / 1000)) == (165, 37)  # docs/guide.md, "Plans"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_unet_round_trip(dtype, tmp_path):
    model, inputs = zoo.unet2d()
    gm = amprewrite.transform(model, dtype, example_inputs=inputs, progress=False)
    path = tmp_path / "unet.json"
    amprewrite.save_plan(gm, path)
    fresh, _ = zoo.unet2d()
    again = amprewrite.transform(fresh, dtype, example_inputs=inputs, plan=str(path),
                                 progress=False)
    assert again.code == gm.code
    assert amprewrite.report(again).decisions == amprewrite.report(gm).decisions
    assert amprewrite.report(again).plan.new == []
    assert amprewrite.save_plan(again) == path.read_text()
    if dtype == "fp16":
        assert round(len(path.read_text()) / 1000) == 87  # docs/guide.md, "Plans"


# --- the plan holds the facts it was made from ----------------------------------------------
class Hot(nn.Module):
    """A linear whose output passes fp16's range only on a large input."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _hot():
    torch.manual_seed(0)
    return Hot().eval(), (torch.randn(4, 8),), [(torch.randn(4, 8) * 3e5,)]


def test_the_plan_gives_without_calibration_or_inputs_the_graph_the_ranges_gave():
    model, inputs, calibration = _hot()
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs, calibration=calibration,
                              progress=False)
    ranged = _decisions(gm)
    assert ranged["up:linear#0"][0] == "fp32"  # the calibration batch's range decided it
    text = amprewrite.save_plan(gm)
    # the old way, without the calibration batch: the range is not seen, the linear runs low
    assert _decisions(amprewrite.transform(model, "fp16", example_inputs=inputs,
                                           progress=False))["up:linear#0"][0] == "low"
    applied = amprewrite.transform(model, "fp16", example_inputs=inputs, plan=text,
                                   progress=False)
    assert _decisions(applied) == ranged and applied.code == gm.code
    up = next(d for d in amprewrite.report(applied).decisions if d.key == "up:linear#0")
    assert up.range.batches == 2 and up.reason.startswith("range:")
    # no example inputs at all: symbolic trace, the same decisions by key
    with pytest.warns(amprewrite.NotVerifiedWarning) as warned:
        traced = amprewrite.transform(model, "fp16", plan=text, progress=False)
    assert "ranges of its values are unknown" not in str(warned[0].message)
    assert _decisions(traced) == ranged
    big = calibration[0][0]
    assert torch.isfinite(traced(big)).all()
    assert not torch.isfinite(amprewrite.transform(model, "fp16", verify=False,
                                                   progress=False)(big)).all()


def test_an_edited_plan_applies_as_edited(llama_fp16, tmp_path):
    model, inputs, gm, text = llama_fp16
    data = json.loads(text)
    nodes = data["graphs"][0]["plans"][0]["nodes"]
    key = "model.layers.1.mlp.down_proj:linear#0"
    assert nodes[key]["class"] == "low"
    nodes[key]["class"] = "fp32"  # forced fp32 by hand
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    edited = amprewrite.transform(model, "fp16", example_inputs=inputs, plan=path,
                                  progress=False)
    got = {d.key: d for d in amprewrite.report(edited).decisions}
    assert (got[key].precision, got[key].dtype) == ("fp32", "torch.float32")
    assert "edited by hand" in got[key].reason
    before = _decisions(gm)
    changed = {k for k, v in _decisions(edited).items() if before.get(k) != v}
    assert key in changed  # and the casts around it follow the new class
    assert _casts(edited) != _casts(gm) and edited.code != gm.code
    lines, differ = diff_plans(text, amprewrite.save_plan(edited))
    assert differ and any(line.startswith(f"  {key} (") and "class: low -> fp32" in line
                          for line in lines)


# --- a changed model ------------------------------------------------------------------------
class Stack(nn.Module):
    """Blocks in a ModuleList and a final norm, as a transformer keeps them."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.nn.functional.gelu(layer(x))
        return self.norm(x)


def _mlp(layers: int) -> Stack:
    torch.manual_seed(0)
    return Stack(layers).eval()


def test_a_model_with_a_layer_added_is_decided_afresh_there_or_refused_with_strict():
    x = (torch.randn(2, 16),)
    text = amprewrite.save_plan(amprewrite.transform(_mlp(3), "bf16", example_inputs=x,
                                                     progress=False))
    bigger = _mlp(4)
    gm = amprewrite.transform(bigger, "bf16", example_inputs=x, plan=text, progress=False)
    use = amprewrite.report(gm).plan
    new = {d.node: d for d in amprewrite.report(gm).decisions if d.node in use.new}
    # the added block's linear, and its gelu and residual add (module path: the root's)
    assert {d.key for d in new.values()} == {"layers.3:linear#0", ":activation#3", ":arith#3"}
    assert use.missing == []
    assert "decided afresh (not in the plan)" in str(amprewrite.report(gm))
    assert next(d for d in new.values() if d.family == "linear").precision == "low"
    with pytest.raises(PolicyError, match=r"strict=True.*3 node\(s\).*layers.3:linear#0"):
        amprewrite.transform(bigger, "bf16", example_inputs=x, plan=text, strict=True,
                             progress=False)
    # a block removed: the plan's entries for it are named as missing; strict refuses
    smaller = amprewrite.transform(_mlp(2), "bf16", example_inputs=x, plan=text,
                                   progress=False)
    assert "layers.2:linear#0" in amprewrite.report(smaller).plan.missing
    with pytest.raises(PolicyError, match="entries name no node"):
        amprewrite.transform(_mlp(2), "bf16", example_inputs=x, plan=text, strict=True,
                             progress=False)


@pytest.mark.parametrize("layers", [3])
def test_llama_with_a_layer_added(llama_fp16, layers):
    _, inputs, _, text = llama_fp16
    model = zoo.llama_lm(layers=layers).eval()
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs, plan=text, progress=False)
    use = amprewrite.report(gm).plan
    keys = {d.key for d in amprewrite.report(gm).decisions if d.node in use.new}
    assert keys and all(k.startswith(("model.layers.2.", "model.layers.2:")) for k in keys)
    assert use.missing == []
    with pytest.raises(PolicyError, match="strict=True"):
        amprewrite.transform(model, "fp16", example_inputs=inputs, plan=text, strict=True,
                             progress=False)


def test_a_plan_for_another_model_is_a_clear_error():
    plan = amprewrite.save_plan(amprewrite.transform(_mlp(2), "bf16", progress=False))
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3))
    with pytest.raises(PolicyError, match=r"made for Stack.*plan for another model"):
        amprewrite.transform(conv.eval(), "bf16", plan=plan, progress=False)


@pytest.mark.parametrize("bad, match", [
    ("{not json", "not valid JSON"),
    ('{"amprewrite_plan": 99}', "not an amprewrite plan of format 1"),
    ({"amprewrite_plan": 1, "graphs": [{"plans": [{"nodes": {"0:linear#0": {
        "class": "fp64"}}}]}]}, "class 'fp64'"),
    ("/no/such/plan.json", "cannot read it"),
])
def test_bad_plans_are_policy_errors(bad, match):
    with pytest.raises(PolicyError, match=match):
        amprewrite.transform(_mlp(1), "bf16", plan=bad, progress=False)


def test_a_plan_for_another_dtype_is_refused():
    plan = amprewrite.save_plan(amprewrite.transform(_mlp(1), "fp16", progress=False))
    with pytest.raises(PolicyError, match=r"made for torch.float16.*Pass dtype=torch.float16"):
        amprewrite.transform(_mlp(1), "bf16", plan=plan, progress=False)


def test_the_callers_own_selectors_apply_on_top_of_the_plan():
    x = (torch.randn(2, 16),)
    text = amprewrite.save_plan(amprewrite.transform(_mlp(2), "bf16", example_inputs=x,
                                                     progress=False))
    gm = amprewrite.transform(_mlp(2), "bf16", example_inputs=x, plan=text,
                              keep_fp32=["layers.1"], progress=False)
    got = {d.key: d for d in amprewrite.report(gm).decisions}
    assert (got["layers.1:linear#0"].precision, got["layers.1:linear#0"].reason) == (
        "fp32", "keep_fp32='layers.1'")
    assert got["layers.0:linear#0"].precision == "low"


# --- float8 ---------------------------------------------------------------------------------
def test_float8_verdicts_are_applied_from_the_plan_not_measured(monkeypatch):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).eval()
    x = (torch.randn(32, 64),)
    spec = amprewrite.Float8(min_speedup=0)
    gm = amprewrite.transform(model, "bf16", example_inputs=x, fp8=spec, progress=False)
    data = json.loads(amprewrite.save_plan(gm))
    nodes = data["graphs"][0]["plans"][0]["nodes"]
    verdicts = {k: e["fp8"] for k, e in nodes.items() if "fp8" in e}
    assert set(verdicts) == {"0:linear#0", "2:linear#0"}
    # edited: the second linear stays bf16 whatever its error
    nodes["2:linear#0"]["fp8"] = "bf16: kept bf16 by review"
    monkeypatch.setattr(float8_linears, "errors", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("measured again")))
    again = amprewrite.transform(model, "bf16", example_inputs=x, fp8=spec, plan=data,
                                 progress=False)
    got = {d.key: d.fp8 for d in amprewrite.report(again).decisions if d.fp8}
    assert got == {**verdicts, "2:linear#0": "bf16: kept bf16 by review"}


# --- where models travel --------------------------------------------------------------------
def test_a_checkpoint_and_a_pt2_artefact_carry_the_plan(tmp_path):
    model, inputs, calibration = _hot()
    gm = amprewrite.transform(model, "fp16", example_inputs=inputs, calibration=calibration,
                              progress=False)
    # a checkpoint: the plan's text next to the weights
    torch.save({"model": model.state_dict(), "amprewrite_plan": amprewrite.save_plan(gm)},
               tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    fresh = Hot().eval()
    fresh.load_state_dict(ckpt["model"])
    again = amprewrite.transform(fresh, "fp16", example_inputs=inputs,
                                 plan=ckpt["amprewrite_plan"], progress=False)
    assert again.code == gm.code
    # a .pt2: the plan as an extra file of torch.export.save
    ep = amprewrite.transform(torch.export.export(model, inputs), "fp16",
                              calibration=calibration)
    torch.export.save(ep, tmp_path / "model.pt2",
                      extra_files={"amprewrite_plan.json": amprewrite.save_plan(ep)})
    extra = {"amprewrite_plan.json": ""}
    torch.export.load(tmp_path / "model.pt2", extra_files=extra)
    plan = amprewrite.load_plan(extra["amprewrite_plan.json"])
    assert plan.data["graphs"][0]["plans"][0]["nodes"]
    ep2 = amprewrite.transform(torch.export.export(fresh, inputs), "fp16", plan=plan)
    assert ep2.graph_module.code == ep.graph_module.code


def test_a_dynamo_plan_applies_to_an_export_capture_where_nodes_correspond(llama_fp16):
    model, inputs, _, text = llama_fp16
    ex = amprewrite.transform(model, "fp16", example_inputs=inputs, capture="export",
                              plan=text, progress=False)
    use = amprewrite.report(ex).plan
    # what docs/guide.md "Plans" says: most nodes correspond, tuple items and no-op scalings
    # that torch.export spells otherwise are decided afresh and named
    assert use.applied >= 0.85 * (use.applied + len(use.new)) and use.new
    assert (use.applied, use.applied + len(use.new)) == (128, 143)  # the guide's figures
    mine = {d.key: d.precision for d in amprewrite.report(ex).decisions}
    saved = json.loads(text)["graphs"][0]["plans"][0]["nodes"]
    assert all(mine[k] == e["class"] for k, e in saved.items() if k in mine and "class" in e)


def test_a_plan_saved_in_another_process_applies_here(tmp_path):
    path = tmp_path / "plan.json"
    script = textwrap.dedent(f"""
        import amprewrite
        from amprewrite.testing import zoo
        model, inputs = zoo.llama()
        gm = amprewrite.transform(model, "bf16", example_inputs=inputs, progress=False)
        amprewrite.save_plan(gm, {str(path)!r})
        print(len(gm.code))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    model, inputs = zoo.llama()
    here = amprewrite.transform(model, "bf16", example_inputs=inputs, plan=path,
                                progress=False)
    plain = amprewrite.transform(copy.deepcopy(model), "bf16", example_inputs=inputs,
                                 progress=False)
    assert here.code == plain.code and int(done.stdout.split()[-1]) == len(here.code)
    assert amprewrite.report(here).plan.new == []


# --- the backend ----------------------------------------------------------------------------
def _per_block(model, **options):
    compile_with = amprewrite.backend(inner="eager", dtype="fp16", **options)
    for k, layer in enumerate(model.model.layers):
        model.model.layers[k] = torch.compile(layer, backend=compile_with)
    return model


def test_the_backend_applies_a_plan_on_a_per_block_compile(tmp_path):
    model, (ids,) = zoo.llama()
    torch._dynamo.reset()
    first = _per_block(copy.deepcopy(model))
    with torch.no_grad():
        want = first(ids).logits
    path = tmp_path / "blocks.json"
    amprewrite.save_plan(first, path)
    planned = amprewrite.report(first).graphs[0].report.decisions  # reset() drops the plans
    data = json.loads(path.read_text())
    assert data["graphs"][0]["blocks"] == ["model.layers.0", "model.layers.1"]
    nodes = data["graphs"][0]["plans"][0]["nodes"]
    key = "mlp.down_proj:linear#0"
    assert nodes[key]["class"] == "low"
    torch._dynamo.reset()
    again = _per_block(copy.deepcopy(model), plan=path)
    with torch.no_grad():
        got = again(ids).logits
    assert torch.equal(got, want)
    graph = amprewrite.report(again).graphs[0]
    assert graph.report.decisions == planned
    assert graph.report.plan.new == [] and len(graph.events) == 1  # no re-plan per block
    nodes[key]["class"] = "fp32"  # edited: both blocks' down_proj in fp32
    torch._dynamo.reset()
    edited = _per_block(copy.deepcopy(model), plan=data)
    with torch.no_grad():
        edited(ids)
    decided = {d.key: d for d in amprewrite.report(edited).graphs[0].report.decisions}
    assert decided[key].precision == "fp32"
    torch._dynamo.reset()


# --- show -----------------------------------------------------------------------------------
def test_show_prints_the_plan_as_the_report_prints_decisions(llama_fp16):
    _, _, gm, text = llama_fp16
    shown = show_plan(text)
    lines = shown.splitlines()
    assert lines[0].startswith("amprewrite plan: LlamaForCausalLM, dtype=float16")
    assert f"torch {torch.__version__}" in lines[1]
    for d in amprewrite.report(gm).decisions:
        if d.precision == "low":
            row = next(line for line in lines if f"  {d.key}  " in line)
            assert row.startswith(d.node) and " low " in row and d.reason in row


def test_the_deploy_export_pt2_carries_its_plan(tmp_path, loaded_here_only):
    from amprewrite.deploy.export import export
    from amprewrite.precision.saved_plan import PLAN_FILE

    model, inputs, calibration = _hot()
    result = export(model, inputs, path=tmp_path / "hot.pt2", to="pt2", dtype="fp16",
                    calibration=calibration, check=False)
    extra = {PLAN_FILE: ""}
    torch.export.load(tmp_path / "hot.pt2", extra_files=extra)
    assert amprewrite.load_plan(extra[PLAN_FILE]).data == json.loads(
        amprewrite.save_plan(result.gm))
    again = amprewrite.transform(model, "fp16", example_inputs=inputs, plan=extra[PLAN_FILE],
                                 progress=False)
    assert _decisions(again) == _decisions(result.gm)
    assert _decisions(again)["up:linear#0"][0] == "fp32"  # the calibration's range, kept


def test_checkpointed_region_bodies_take_their_entries_of_the_plan():
    torch.manual_seed(0)
    model = Checkpointed().train()
    x = (torch.randn(4, 8),)
    gm = amprewrite.transform(model, "bf16", example_inputs=x, progress=False)
    data = json.loads(amprewrite.save_plan(gm))
    nodes = data["graphs"][0]["plans"][0]["nodes"]
    key = "wrap_body_1/blocks.1.3:linear#0"  # a body's entries: <body>/<key>
    assert nodes[key]["class"] == "low"
    again = amprewrite.transform(model, "bf16", example_inputs=x, plan=data, strict=True,
                                 progress=False)
    assert again.code == gm.code
    assert amprewrite.report(again).decisions == amprewrite.report(gm).decisions
    nodes[key]["class"] = "fp32"
    edited = amprewrite.transform(model, "bf16", example_inputs=x, plan=data, strict=True,
                                  progress=False)
    got = {d.key: d.precision for d in amprewrite.report(edited).decisions}
    assert got[key] == "fp32" and got["wrap_body_0/blocks.0.3:linear#0"] == "low"


def test_an_option_that_shapes_the_graph_and_differs_from_the_plans_is_noted():
    x = (torch.randn(2, 16),)
    text = amprewrite.save_plan(amprewrite.transform(_mlp(2), "bf16", example_inputs=x,
                                                     progress=False))
    same = amprewrite.transform(_mlp(2), "bf16", example_inputs=x, plan=text, progress=False)
    assert not any(n.startswith("plan:") for n in amprewrite.report(same).notes)
    other = amprewrite.transform(_mlp(2), "bf16", example_inputs=x, plan=text,
                                 keep_io_dtype=False, progress=False)
    assert ("plan: made with keep_io_dtype=True, applied with keep_io_dtype=False: nodes the "
            "option makes or removes are decided afresh or named as missing"
            in amprewrite.report(other).notes)
