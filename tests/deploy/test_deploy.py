"""``amprewrite export`` and ``amprewrite.deploy.export.export``: the artefact a user ships (a
torch.export program, an AOTInductor package, an ONNX file) is loaded back, runs at another batch
size, and gives the GraphModule's outputs (pt2: within 1e-6 relative) or an error against
fp32 like autocast's (aoti: Inductor's own kernels; ONNX in onnxruntime, float16)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite import PolicyError, cli
from amprewrite.cli.target import load_target
from amprewrite.deploy import export as deploy
from amprewrite.show.numerics import rel_err

from ..helpers import run_in_process

ROOT = Path(__file__).resolve().parents[2]

MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    """A conv, a batch norm amprewrite keeps in fp32, a linear head and a softmax."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return torch.softmax(self.head(h), -1)


def net():
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # statistics of a trained model, not the identity of a fresh one
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval(), (torch.randn(4, 3, 8, 8),)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
'''

# An artefact's error against fp32 is held to autocast's on the same inputs: at most 1.1x it
# (as in tests/graph/test_dynamic_shapes.py) plus a quarter of the dtype's unit roundoff, for errors
# near zero; and at least 0.1x it, since below that nothing ran in the low dtype.
FACTOR, SLACK = 1.1, {torch.bfloat16: 2.0**-10, torch.float16: 2.0**-13}


def like_autocast(error: float, autocast: float, dtype: torch.dtype) -> bool:
    return 0.1 * autocast <= error <= FACTOR * autocast + SLACK[dtype]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("deploy") / "models.py"
    path.write_text(MODELS)
    return path


def run(*args: object) -> subprocess.CompletedProcess:
    """``amprewrite ARGS`` in this process (tests/test_cli.py runs the command's process)."""
    return run_in_process(*args, cwd=ROOT)


def errors_of(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if not ln.startswith("amprewrite: [")]


def autocast_error(model, x, ref, dtype):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return rel_err(model(x).float(), ref)


def test_pt2_saves_loads_and_runs_at_another_batch_size(models, tmp_path):
    out = tmp_path / "net.pt2"
    done = run("export", f"{models}:net", "--to", "pt2", "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    # torch.export records the dynamic batch from 2; the check ran batch 1 too, so it says 1.
    assert "batch dynamic in [1, inf]" in done.stdout and "check passed" in done.stdout
    assert "batch 1 ran too" in done.stdout
    assert "Traceback" not in done.stderr
    # The file, in this process: the GraphModule transformed here from the same weights.
    model, (x,) = load_target(f"{models}:net")
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    loaded = torch.export.load(out).module()
    for n in (1, 2, 9):
        xb = torch.randn(n, 3, 8, 8)
        with torch.no_grad():
            got, want, ref = loaded(xb), gm(xb), model(xb)
        assert got.shape == (n, 5) and got.dtype == torch.float32
        assert rel_err(got, want) <= deploy.SAME_AS_GRAPH
        auto = autocast_error(model, xb, ref, torch.bfloat16)
        assert like_autocast(rel_err(got, ref), auto, torch.bfloat16), (rel_err(got, ref), auto)


def test_the_table_shows_both_batch_sizes_and_both_errors(models, tmp_path, capsys,
                                                           loaded_here_only):
    code = cli.main(["export", f"{models}:net", "--out", str(tmp_path / "net.pt2")])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("  ") and ln[2].isdigit()]
    assert [r[0] for r in rows] == ["4", "7"]  # the example's batch and another
    for _, error, autocast, graph, equal in rows:
        assert float(graph) <= 1e-6 and equal == "yes"
        assert like_autocast(float(error), float(autocast), torch.bfloat16), rows


def test_static_export_takes_only_the_example_sizes(models, tmp_path, loaded_here_only):
    model, inputs = load_target(f"{models}:net")
    result = deploy.export(model, inputs, path=tmp_path / "net.pt2", dynamic_batch=False)
    assert result.passed and result.batch_range is None
    assert [row.batch for row in result.rows] == [4]
    with pytest.raises(AssertionError, match=r"Guard failed: x\.size\(\)\[0\] == 4"):
        torch.export.load(tmp_path / "net.pt2").module()(torch.randn(5, 3, 8, 8))


@pytest.mark.slow  # AOTInductor compiles C++: 18 s at load
def test_aoti_package_loads_and_matches_the_graph(tmp_path):
    """The one AOTInductor compile in the default suite (a tiny MLP: about 30 s on 2 cores)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Softmax(-1)).eval()
    x = torch.randn(4, 16)
    result = deploy.export(model, (x,), path=tmp_path / "mlp.pt2", to="aoti")
    assert result.passed, result.summary()
    assert [(row.batch, row.equal) for row in result.rows] == [(4, True), (7, True)]
    compiled = torch._inductor.aoti_load_package(str(tmp_path / "mlp.pt2"))
    xb = torch.randn(5, 16)
    with torch.no_grad():
        assert rel_err(compiled(xb), result.gm(xb)) <= deploy.SAME_AS_GRAPH


@pytest.mark.slow
def test_aoti_package_of_llama_matches_the_graph(tmp_path):
    """Inductor fuses LLaMA's bf16 elementwise chains (RMSNorm, SiLU * up): compiled without
    emulate_precision_casts the package departed from the graph by 3.1e-3 relative."""
    from amprewrite.testing import zoo

    model, inputs = zoo.llama()
    result = deploy.export(model.eval(), inputs, path=tmp_path / "llama.pt2", to="aoti")
    assert result.passed, result.summary()
    assert [row.equal for row in result.rows] == [True, True]


def test_onnx_fp16_runs_in_onnxruntime(models, tmp_path):
    for name in ("onnx", "onnxscript"):
        pytest.importorskip(name)
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "net.onnx"
    done = run("export", f"{models}:net", "--to", "onnx", "--dtype", "fp16", "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check passed" in done.stdout and "Traceback" not in done.stderr
    # The file, in onnxruntime, at a batch size the command did not run. The batch norm is
    # kept in fp32 after an fp16 conv: the case onnxscript's optimizer breaks (deploy.py).
    model, _ = load_target(f"{models}:net")
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    xb = torch.randn(6, 3, 8, 8)
    (got,) = session.run(None, {session.get_inputs()[0].name: xb.numpy()})
    with torch.no_grad():
        ref = model(xb)
    got = torch.from_numpy(got)
    assert got.shape == (6, 5) and got.dtype == torch.float32
    # onnxruntime's fp16 kernels are not PyTorch's: held to autocast's error, not the graph's.
    auto = autocast_error(model, xb, ref, torch.float16)
    assert like_autocast(rel_err(got, ref), auto, torch.float16), (rel_err(got, ref), auto)


class _Scale(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 1000 / 1000, -1)


class _ScaleInHalf(torch.nn.Module):
    """_Scale computed in float16: x * 1000 passes 65504 where |x| > 65.5."""

    def forward(self, x):
        return torch.softmax((x.half() * 1000 / 1000).float(), -1)


def test_the_onnx_check_rounds_what_the_file_declares_float16(tmp_path, monkeypatch):
    """onnxruntime's CPU provider computes the float16 Mul and Div in float32 and drops the
    roundings between them, so the file runs finite there; with its float16 values rounded
    (as any float16 runtime computes) it is inf, and the check fails saying so."""
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)
    # A graph with an fp16 overflow, as transform would give were its plan wrong.
    monkeypatch.setattr(deploy, "transform", lambda *a, **k: torch.fx.symbolic_trace(
        _ScaleInHalf()))
    x = torch.linspace(-100, 100, 32).reshape(4, 8)
    result = deploy.export(_Scale().eval(), (x,), path=tmp_path / "scale.onnx", to="onnx",
                           dtype="fp16", dynamic_batch=False)
    (row,) = result.rows
    assert row.error < 1e-3  # onnxruntime CPU: finite and close to fp32
    assert row.rounded_error == float("inf")  # rounded: the overflow is there
    assert not result.passed
    (problem,) = result.problems
    assert "rounded to it" in problem and "non-finite where fp32 is finite" in problem
    assert "float16 rounded vs fp32" in result.summary()


def test_an_fp16_onnx_file_stores_float16_weights_and_no_redundant_cast(tmp_path):
    onnx = pytest.importorskip("onnx")
    for name in ("onnxscript", "onnxruntime"):
        pytest.importorskip(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64), torch.nn.Softmax(-1)).eval()
    result = deploy.export(model, (torch.randn(4, 64),), path=tmp_path / "mlp.onnx",
                           to="onnx", dtype="fp16")
    assert result.passed, result.summary()
    assert all(r.rounded_error is not None and r.rounded_error <= r.error * 4 + 1e-3
               for r in result.rows)
    file = onnx.load(str(result.path))
    inits = {i.name: i.data_type for i in file.graph.initializer}
    # every Linear weight and bias is read only by a float16 Gemm: stored float16
    assert {inits[n] for n in inits if n.startswith(("0.", "2."))} == {onnx.TensorProto.FLOAT16}
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert result.path.stat().st_size < 0.55 * fp32_bytes
    casts = [n for n in file.graph.node if n.op_type in ("Cast", "CastLike")]
    made = {o for n in file.graph.node for o in n.output}
    assert all(c.input[0] in made or c.input[0] in {i.name for i in file.graph.input}
               for c in casts)  # no cast of a constant or weight
    keys = [(c.input[0], c.attribute[0].i) for c in casts]
    assert len(keys) == len(set(keys))  # no two casts of one value to one type
    assert not any(n.metadata_props for n in file.graph.node)


def test_bf16_onnx_is_refused_up_front_with_the_reason_and_the_way_out(models, tmp_path):
    out = tmp_path / "net.onnx"
    done = run("export", f"{models}:net", "--to", "onnx", "--dtype", "bf16", "--out", out)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = errors_of(done.stderr)
    assert "onnxruntime's CPU provider has no bfloat16 kernels for Conv, Gemm or MatMul" in line
    assert "--dtype fp16" in line and "--no-check" in line and "Traceback" not in done.stderr
    assert "[1/2]" not in done.stderr and not out.exists()  # refused before loading the model


def test_onnx_without_a_dtype_is_float16_and_says_why(models, tmp_path):
    """``--to onnx`` alone failed (bf16, the other formats' default, which onnxruntime's CPU
    provider cannot run; issue 65): with no ``--dtype`` ONNX is written in float16, checked,
    and a note says why and how to get bf16."""
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)
    out = tmp_path / "net.onnx"
    done = run("export", f"{models}:net", "--to", "onnx", "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(ONNX file, float16," in done.stdout
    assert ("note: float16, the default for ONNX: onnxruntime's CPU provider has no bfloat16 "
            "Conv, Gemm or MatMul") in done.stdout
    assert "--dtype bf16 with --no-check writes one" in done.stdout
    assert "check passed" in done.stdout and out.exists()
    helped = run("export", "--help")
    assert "fp16 unless --dtype says otherwise" in " ".join(helped.stdout.split())


def test_bf16_onnx_with_no_check_writes_a_bf16_file(models, tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    out = tmp_path / "net.onnx"
    done = run("export", f"{models}:net", "--to", "onnx", "--dtype", "bf16", "--no-check",
               "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not checked: the file was not loaded back or run (--no-check)" in done.stdout
    casts = [a.i for n in onnx.load(out).graph.node if n.op_type == "Cast"
             for a in n.attribute if a.name == "to"]
    assert onnx.TensorProto.BFLOAT16 in casts


def test_an_artefact_that_departs_from_the_graph_fails_the_check(models, tmp_path, capsys,
                                                                monkeypatch, loaded_here_only):
    def load_and_perturb(path):
        program = torch.export.load(path).module()
        return lambda *a, **k: program(*a, **k) * (1 + 1e-3)

    monkeypatch.setitem(deploy._LOADERS, "pt2", load_and_perturb)
    code = cli.main(["export", f"{models}:net", "--out", str(tmp_path / "net.pt2")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "check failed: at batch 4 the artefact departs from the GraphModule by 0.001" in out


def test_an_artefact_that_fails_to_load_fails_the_check(models, tmp_path, capsys, monkeypatch):
    def broken(path):
        raise RuntimeError("truncated file")

    monkeypatch.setitem(deploy._LOADERS, "pt2", broken)
    code = cli.main(["export", f"{models}:net", "--out", str(tmp_path / "net.pt2")])
    out = capsys.readouterr().out
    assert code == 1 and "fails to load with torch.export.load(path).module(): RuntimeError: " \
                          "truncated file" in out, out


@pytest.mark.parametrize("args, message", [
    (("--to", "tflite"), "argument --to: invalid choice: 'tflite'"),
    (("--static", "--dynamic-batch"), "argument --dynamic-batch: not allowed with argument"),
])
def test_bad_flags_are_one_line_and_exit_2(models, capsys, args, message):
    code = cli.main(["export", f"{models}:net", *args])  # argparse's exit, as a status
    (line,) = errors_of(capsys.readouterr().err)
    assert code == 2 and message in line and "Traceback" not in line


def test_an_aoti_package_must_be_a_pt2_file(models, capsys):
    assert cli.main(["export", f"{models}:net", "--to", "aoti", "--out", "model.so"]) == 2
    err = capsys.readouterr().err
    (line,) = errors_of(err)
    assert "an AOTInductor package must be a .pt2 file" in line and "name it model.pt2" in line
    assert "[1/2]" not in err  # refused before loading the model


def test_a_factory_without_inputs_asks_for_them(models, capsys):
    assert cli.main(["export", f"{models}:mlp"]) == 2
    (line,) = errors_of(capsys.readouterr().err)
    assert "gives no example inputs: pass --inputs" in line


def test_missing_onnx_packages_name_the_pip_command(models, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime fails
    code = cli.main(["export", f"{models}:net", "--to", "onnx", "--dtype", "fp16"])
    (line,) = errors_of(capsys.readouterr().err)
    assert code == 2 and "pip install onnx onnxscript onnxruntime" in line, line
    assert "onnxruntime" in line.split("which")[0]


def test_the_python_api_refuses_what_it_cannot_check(tmp_path):
    model = torch.nn.Linear(4, 4)  # a fresh module is in train mode
    with pytest.raises(PolicyError, match=r"train mode.*model\.eval\(\)"):
        deploy.export(model, (torch.randn(2, 4),), path=tmp_path / "m.pt2")
    with pytest.raises(PolicyError, match="to='tflite' is not a format"):
        deploy.export(model.eval(), (torch.randn(2, 4),), path=tmp_path / "m.x", to="tflite")
    with pytest.raises(PolicyError, match="no bfloat16 kernels"):
        deploy.export(model.eval(), (torch.randn(2, 4),), path=tmp_path / "m.onnx", to="onnx",
                      dtype="bf16")  # asked for: without a dtype, ONNX is float16


def test_the_cli_offers_every_format():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    (to,) = [a for a in sub.choices["export"]._actions if a.dest == "to"]
    assert tuple(to.choices) == deploy.FORMATS



class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.relu(self.fc(x))
        return {"logits": self.head(hidden), "hidden": hidden}


def test_onnx_outputs_and_batch_are_named_as_the_model_names_them(tmp_path):
    import onnx

    path = tmp_path / "two.onnx"
    result = deploy.export(_TwoOutputs().eval(), (torch.randn(4, 16),), path=path, to="onnx",
                           dtype="fp16")
    assert result.passed, result.summary()
    graph = onnx.load(path).graph
    assert [o.name for o in graph.output] == ["logits", "hidden"]
    for value in (*graph.input, *graph.output):
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch", value


def test_inputs_flag_says_it_replaces_the_factorys_inputs(models, tmp_path):
    done = run("export", f"{models}:net", "--inputs", "2x3x8x8", "--to", "pt2", "--out",
               tmp_path / "net.pt2", "--no-check")
    assert done.returncode == 0, done.stderr
    assert "note: --inputs replaces the example inputs" in done.stderr
    assert "float32[4,3,8,8]" in done.stderr  # what the factory's were


def test_an_moe_model_exports_to_fp16_onnx_with_transformers_translations(tmp_path):
    """Mixtral's experts run transformers' ``grouped_mm_fallback`` op, which torch.onnx cannot
    translate alone; transformers' exporter ships its translation, which the export uses."""
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)
    pytest.importorskip("transformers.exporters.exporter_onnx")
    from amprewrite.testing import zoo

    model, inputs = zoo.MODELS["mixtral"]()
    result = deploy.export(model, inputs, path=tmp_path / "mixtral.onnx", to="onnx",
                           dtype="fp16")
    assert result.passed, result.summary()
    assert len(result.rows) == 2  # the example batch and another
    assert all(r.error <= r.autocast_error for r in result.rows), result.rows


# Issue 47, item 5: a dynamic sequence dimension ----------------------------------------------

class _Tokens(nn.Module):
    """A language model's shape: [batch, seq] token ids and mask, positions from arange."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(64, 16), nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = (self.tok(input_ids) + self.pos(positions)) * attention_mask[..., None]
        return torch.log_softmax(self.head(torch.tanh(h)), -1)


def _tokens(batch: int, seq: int) -> dict:
    ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq)}


def test_dynamic_seq_export_takes_other_lengths_and_checks_one(tmp_path, loaded_here_only):
    model = _Tokens().eval()
    path = tmp_path / "tokens.pt2"
    result = deploy.export(model, _tokens(2, 12), path=path, dynamic_seq=True)
    assert result.passed, result.summary()
    assert result.batch_range is not None and result.seq_range is not None
    assert result.seq_range[0] <= 2 and result.seq_range[1] > 12
    # The example, another batch at the example's length, the example batch at another length.
    assert [(r.batch, r.seq) for r in result.rows][:2] == [(2, 12), (5, 12)]
    assert len(result.rows) == 3 and result.rows[2].batch == 2 and result.rows[2].seq != 12
    assert "sequence dynamic in [" in result.summary()
    program = torch.export.load(path).module()
    for batch, seq in ((3, 20), (1, 5), (2, 40)):
        inputs = _tokens(batch, seq)
        with torch.no_grad():
            got, want = program(**inputs), result.gm(**inputs)
        assert got.shape == (batch, seq, 64)
        assert rel_err(got, want) <= deploy.SAME_AS_GRAPH
    # Without it the length stays the example's, as before.
    static = deploy.export(model, _tokens(2, 12), path=tmp_path / "static.pt2", check=False)
    assert static.seq_range is None and "sequence" not in static.summary()
    with pytest.raises(AssertionError, match=r"Guard failed: .*size\(\)\[1\] == 12"):
        torch.export.load(tmp_path / "static.pt2").module()(**_tokens(2, 20))


def test_dynamic_seq_says_so_where_the_model_fixes_dimension_1(models, tmp_path, capsys):
    code = cli.main(["export", f"{models}:net", "--dynamic-seq", "--out",
                     str(tmp_path / "net.pt2"), "--no-check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "batch dynamic" in out and "sequence dynamic" not in out
    assert "note: dynamic_seq: no input's dimension 1 became dynamic" in out  # the channels


def test_dynamic_seq_and_static_together_are_refused(models, capsys):
    code = cli.main(["export", f"{models}:net", "--static", "--dynamic-seq"])
    (line,) = errors_of(capsys.readouterr().err)
    assert code == 2 and "--static fixes every size, --dynamic-seq makes" in line


@pytest.mark.slow  # 27 s on 2 shared cores: transform, export, two loads, six runs
def test_a_gpt2_pt2_exported_with_dynamic_seq_takes_other_lengths(tmp_path, loaded_here_only):
    """The issue's case: exported at length 16, the program refused 20 (Guard failed:
    input_ids.size()[1] == 16)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                             n_positions=128)).eval()
    path = tmp_path / "gpt2.pt2"
    ids = torch.randint(0, 256, (2, 16))
    result = deploy.export(model, (ids,), path=path, dynamic_seq=True)
    assert result.passed, result.summary()
    assert result.seq_range is not None and any(r.seq not in (None, 16) for r in result.rows)
    program = torch.export.load(path).module()
    for batch, seq in ((2, 20), (3, 7), (1, 64)):
        x = torch.randint(0, 256, (batch, seq))
        with torch.no_grad():
            got, ref = program(x)["logits"], model(x).logits
        assert got.shape == (batch, seq, 256)
        assert rel_err(got, ref) <= 2e-2


def test_onnx_export_of_a_plain_model_does_not_import_transformers():
    """transformers' ONNX translations serve ops of its own models: a process that never
    imported transformers (a plain MLP) does not import it for them (seconds, and torchao's
    load failures printed on stderr); one that did still gets them."""
    code = ("import sys; from amprewrite.deploy import export as e; "
            "print(e._transformers_translations() is None, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.stdout.split() == ["True", "False"], done.stderr
    pytest.importorskip("transformers")
    with_hf = subprocess.run([sys.executable, "-c", "import transformers; " + code],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert with_hf.stdout.split() == ["False", "True"], with_hf.stderr
    assert "Failed to load" not in with_hf.stderr
