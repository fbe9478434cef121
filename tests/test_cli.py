"""The command line against examples/cli_models.py: in this process where what is tested is the
command's work and its output (``cli.main`` parses the flags as the command does), in a
process of its own where the process is what is tested (the closed pipe, Ctrl-C, atexit, what
importing the command imports, the installed entry point)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import amprewrite
from amprewrite import cli

from .helpers import cli_process, run_cli, run_in_process

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "cli_models.py"
sys.path.insert(0, str(ROOT / "examples"))
import cli_models  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    """``amprewrite ARGS`` in this process, from the repository's root as the user's folder: the
    exit code and what it printed, as a process would give them back (each command started as
    a process spent 2-4 s of CPU importing torch again)."""
    return run_in_process(*args, cwd=ROOT)


def process(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m amprewrite.cli ARGS`` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "amprewrite.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_dump_writes_every_artefact(tmp_path):
    out = tmp_path / "dump"
    done = run("dump", f"{MODELS}:demo", "--out", str(out), "--per-pass", "--upsample", "always")
    assert done.returncode == 0, done.stderr
    for name in ("before.py", "after.py", "before.txt", "after.txt", "diff.patch", "report.txt",
                 "plan.json", "before.dot", "after.dot", "index.html"):
        assert (out / name).stat().st_size > 0, name
    assert amprewrite.load_plan(out / "plan.json").model == "DemoNet"
    # The page's data: both graphs, the batch_norm kept in fp32, the expand from the rewrite.
    page = (out / "index.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="amp-data">(.*?)</script>',
                                page, re.S).group(1).replace("<\\/", "</"))
    after = {n["n"]: n for n in data["graphs"]["after"]["nodes"]}
    assert set(data["graphs"]) == {"before", "after"}
    assert after["batch_norm"]["p"] == "fp32"
    assert any(n["t"] == "expand" and n.get("w") for n in after.values())
    me = json.loads((out / "model-explorer" / "amprewrite_graphs.json").read_text())
    assert [g["id"] for g in me["graphs"]] == ["before", "after"]
    report = (out / "report.txt").read_text()
    assert "re-rolled 2 iterations" in report and "expand/reshape subgraph" in report
    # The upsample is inlined as plain ops: dump shows the expand/flatten nodes themselves.
    after = (out / "after.py").read_text()
    assert ".expand(" in after and ".flatten(" in after
    assert "interpolate" not in after and "upsample" not in after
    assert "+    to = " in (out / "diff.patch").read_text()  # the diff shows inserted casts
    assert "fillcolor" in (out / "after.dot").read_text()
    passes = sorted(p.name for p in (out / "passes").iterdir())
    assert passes[0] == "00_capture.py" and passes[-1].endswith("verify.py")
    assert passes[-5].endswith("store_params.py")
    assert passes[-4].endswith("float8_linears.py")
    assert passes[-3].endswith("recompute_islands.py")
    assert passes[-2].endswith("guard_autocast.py")
    # Progress goes to stderr as plain lines when not on a terminal.
    assert "amprewrite: [1/4] loading" in done.stderr


def test_dump_check_puts_the_per_node_error_in_the_page_and_an_overlay(tmp_path):
    done = run("dump", f"{MODELS}:mlp", "--inputs", "4x16", "--out", str(tmp_path), "--check",
               "--format", "html,model-explorer")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "after.py").exists()
    page = (tmp_path / "index.html").read_text()
    assert '"check":{"output_error":' in page
    errors = json.loads((tmp_path / "model-explorer" / "error_vs_fp32.json").read_text())
    assert errors["after"]["results"] and "model-explorer --node_data_paths" not in done.stdout


def test_dump_check_needs_inputs(tmp_path):
    done = run("dump", f"{MODELS}:mlp", "--out", str(tmp_path), "--check")
    assert done.returncode == 2 and "--inputs" in done.stderr and "Traceback" not in done.stderr


def test_dump_with_input_specs_and_formats(tmp_path):
    done = run("dump", f"{MODELS}:mlp", "--inputs", "4x16", "--out", str(tmp_path),
               "--format", "text")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "after.py").exists() and not (tmp_path / "index.html").exists()


def test_check_passes_on_a_tame_model():
    done = run("check", f"{MODELS}:mlp", "--inputs", "4x16")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "check passed" in done.stdout


# The overflow example's fc overflows fp16 on its example inputs, so the plan's range rule keeps
# it fp32 by itself and the check passes; --allow-low fc runs it in fp16 anyway, the overflow a
# model meets where the inputs it was checked on do not reach the range (see test_ranges.py).
OVERFLOWING = ("--dtype", "fp16", "--allow-low", "fc")


def test_check_names_the_first_non_finite_node_and_exits_1():
    done = run("check", f"{MODELS}:overflow", *OVERFLOWING)
    assert done.returncode == 1
    assert "first non-finite node: linear (low, family linear, module fc, source" in done.stdout
    assert "cli_models.py:" in done.stdout


def test_check_fix_finds_nodes_that_make_it_pass():
    done = run("check", f"{MODELS}:overflow", *OVERFLOWING, "--fix")
    assert done.returncode == 0, done.stdout
    # The flags to add, as dump and export print them (not transform's Python keywords).
    assert "--fix keeps in fp32: --keep-fp32 node:linear (add to dump, export or check)" in (
        done.stdout)
    assert "keep_fp32=" not in done.stdout
    assert "check passed with --keep-fp32" in done.stdout


def test_find_fp32_nodes_result_makes_check_pass():
    model, inputs = cli_models.overflow()
    low = {"allow_low": ["fc"]}  # as OVERFLOWING
    assert not amprewrite.check_numerics(model, inputs, torch.float16, **low).passed(1e-2)
    keep = amprewrite.find_fp32_nodes(model, inputs, rtol=1e-2, dtype=torch.float16, **low)
    assert keep == ["node:linear"]
    result = amprewrite.check_numerics(model, inputs, torch.float16, keep_fp32=keep, **low)
    assert result.passed(1e-2) and result.first_nonfinite is None


def test_unknown_node_selector_is_clear():
    model, inputs = cli_models.overflow()
    with pytest.raises(amprewrite.PolicyError, match="Did you mean 'node:linear'"):
        amprewrite.transform(model, example_inputs=inputs, keep_fp32=["node:linaer"])


@pytest.mark.parametrize("args, message", [
    (("check", "missing.py:f"), "no such file: missing.py"),
    (("check", f"{MODELS}:nope"), "has no factory function 'nope'."),
    (("check", f"{MODELS}:mpl"), "has no factory function 'mpl'; did you mean 'mlp'?"),
    (("check", f"{MODELS}:mlp", "--inputs", "4by16"), "bad input spec '4by16'"),
    (("check", f"{MODELS}:mlp"), "gives no example inputs"),
    (("check", f"{MODELS}:broken"), "this model always fails"),
    (("dump", f"{MODELS}:mlp", "--format", "pdf"), "--format takes"),
    (("check", "no_colon"), "must be path/to/file.py:factory"),
    (("dump", f"{MODELS}:mlp", "--dtpye", "fp16"),
     "unrecognized arguments: --dtpye fp16 (did you mean --dtype for --dtpye?)"),
])
def test_bad_usage_is_one_line_and_exit_2(args, message):
    done = run(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("amprewrite: [")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_demo_out_writes_artefacts(tmp_path):
    done = run("demo", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "index.html").exists() and "relative error against fp32" in done.stdout


# Issue 37, item 4: no tracebacks, no false lines ---------------------------------------------

def test_dump_out_naming_a_file_fails_before_any_work(tmp_path):
    taken = tmp_path / "report.html"
    taken.write_text("mine")
    done = run("dump", f"{MODELS}:mlp", "--inputs", "4x16", "--out", str(taken))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()  # no progress line: nothing was loaded or captured
    assert line.startswith("amprewrite: error: --out ") and "is a file" in line
    assert "give --out a folder" in line and taken.read_text() == "mine"


def test_output_into_a_closed_pipe_ends_quietly():
    """`amprewrite families | head -1`: the reader is gone (here before the first write, so
    the output cannot fit into the pipe's buffer first)."""
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "amprewrite.cli", "families"], stdout=write,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_importing_the_cli_imports_no_torch():
    """So Ctrl-C while torch loads reaches main(), and --help needs no model code."""
    done = subprocess.run([sys.executable, "-c", "import sys, amprewrite, amprewrite.cli; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                           "('torch', 'sympy', 'networkx')))"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_ctrl_c_while_torch_loads_is_one_line_and_130():
    proc = cli_process("check", f"{MODELS}:demo", cwd=ROOT)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while "libtorch" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.002)  # until torch's libraries load: the import is under way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "amprewrite: interrupted\n"


def test_version_and_a_subcommands_unknown_flag():
    done = run("--version")
    assert done.returncode == 0
    assert re.fullmatch(r"amprewrite \S+ \(torch \S+, Python \S+\)\n", done.stdout)
    done = run("check", f"{MODELS}:mlp", "--inputs", "4x16", "--rtl", "1")
    assert done.returncode == 2
    assert done.stderr == ("amprewrite check: error: unrecognized arguments: --rtl 1 "
                           "(did you mean --rtol for --rtl?) (see 'amprewrite check --help')\n")
    done = run("check", f"{MODELS}:mlp", "--zzzz")  # nothing close: no suggestion
    assert done.stderr == ("amprewrite check: error: unrecognized arguments: --zzzz "
                           "(see 'amprewrite check --help')\n")


def test_printed_commands_are_shell_quoted(tmp_path):
    """A path with a space, pasted back into a shell, is still one argument."""
    folder = tmp_path / "my models"
    folder.mkdir()
    target = f"{folder / 'cli_models.py'}:mlp"
    (folder / "cli_models.py").write_text(MODELS.read_text())
    out = tmp_path / "dump out"
    done = run("dump", target, "--inputs", "4x16", "--out", str(out), "--format",
               "html,model-explorer")
    assert done.returncode == 0, done.stderr
    explore, model_explorer = re.findall(r"`([^`]+)`", done.stdout.split("Model Explorer:")[1])
    assert shlex.split(explore) == ["amprewrite", "explore", target, "--inputs", "4x16"]
    assert shlex.split(model_explorer)[1] == str(out / "model-explorer" /
                                                 "amprewrite_graphs.json")
    opened = re.search(r"^open (.+) in a browser", done.stdout, re.M)[1]
    assert shlex.split(opened) == [str(out / "index.html")]


def test_the_command_runs_atexit_handlers_before_it_ends():
    """main() ends the process itself (no interpreter teardown), after the atexit handlers."""
    code = ("import atexit, sys; atexit.register(print, 'atexit ran'); "
            "from amprewrite.cli import main; sys.argv = ['amprewrite', 'families']; main(); "
            "print('not reached')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("atexit ran") and "not reached" not in done.stdout


# Issue 47 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, code, shown", [
    (["--help"], 0, "usage: amprewrite"),
    (["--version"], 0, "amprewrite "),
    (["dump", "--help"], 0, "usage: amprewrite dump"),
    (["check"], 2, "required: TARGET"),
    (["check", "missing.py:f"], 2, "no such file: missing.py"),
    (["export", "no_colon"], 2, "must be path/to/file.py:factory"),
    (["check", f"{MODELS}:mlp", "--inputs", "4by16"], 2, "bad input spec '4by16'"),
    (["check", f"{MODELS}:mlp", "--dtype", "int8"], 2, "'int8' is not bfloat16 or float16"),
    (["dump", f"{MODELS}:mlp", "--format", "pdf"], 2, "--format takes"),
])
def test_help_version_and_usage_errors_import_no_torch(args, code, shown):
    """They answer at once (0.2 s here, against 2-5 s with torch's import)."""
    script = ("import sys; from amprewrite.cli import main; code = main(sys.argv[1:]); "
              "print(code, sorted(m for m in sys.modules if m.split('.')[0] in "
              "('torch', 'sympy', 'networkx')))")
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.stdout.splitlines()[-1] == f"{code} []", done.stdout + done.stderr
    assert shown in done.stdout + done.stderr


KEYWORD_MODELS = '''
import torch
from torch import nn


class Scaled(nn.Module):
    """Its second input is keyword-only: it can only be called as model(**inputs)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, *, scale):
        return torch.softmax(self.fc(x) * scale, -1)


def scaled():
    torch.manual_seed(0)
    return Scaled().eval(), {"x": torch.randn(4, 16), "scale": torch.rand(4, 1) + 0.5}


def llama():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 256, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the mask changes the logits
    return model, {"input_ids": ids, "attention_mask": mask}


def t5():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
        decoder_start_token_id=0)).eval()
    return model, {"input_ids": torch.randint(0, 256, (2, 12)),
                   "decoder_input_ids": torch.randint(0, 256, (2, 6))}
'''


@pytest.fixture(scope="module")
def keyword_models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keywords") / "keyword_models.py"
    path.write_text(KEYWORD_MODELS)
    return path


@pytest.mark.parametrize("command", ["check", "dump", "export"])
def test_a_factory_returning_keyword_inputs_works_in_every_command(keyword_models, tmp_path,
                                                                  capsys, command,
                                                                  loaded_here_only):
    """A factory returning (model, {name: tensor}) is called as model(**inputs), as
    transform(example_inputs={...}) calls it (it was wrapped in a tuple: model(dict)). The
    .pt2's load in a torch-only process is tests/deploy's and test_hf_defaults'."""
    out = {"check": [], "dump": ["--out", tmp_path, "--check", "--format", "text"],
           "export": ["--out", tmp_path / "scaled.pt2"]}[command]
    code, stdout, stderr = run_cli(capsys, command, f"{keyword_models}:scaled", *out)
    assert code == 0, stdout + stderr
    if command == "dump":
        assert "def forward(self, x, scale)" in (tmp_path / "after.py").read_text()
    else:
        assert "check passed" in stdout
    if command == "export":
        program = torch.export.load(tmp_path / "scaled.pt2").module()
        x, scale = torch.randn(3, 16), torch.rand(3, 1) + 0.5
        assert program(x=x, scale=scale).shape == (3, 16)


@pytest.mark.slow  # 36-50 s on 2 cores at load 4 (transform, export, two loads, runs)
def test_a_hugging_face_factory_with_keyword_inputs_exports(keyword_models, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "llama.pt2"
    code, stdout, stderr = run_cli(capsys, "export", f"{keyword_models}:llama", "--out", out)
    assert code == 0, stdout + stderr
    assert "check passed" in stdout
    ids = torch.randint(0, 256, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    logits = torch.export.load(out).module()(input_ids=ids, attention_mask=mask)["logits"]
    assert logits.shape == (3, 12, 256) and torch.isfinite(logits).all()


def test_a_seq2seq_factory_with_keyword_inputs_checks(keyword_models, capsys):
    """T5 takes decoder_input_ids by name (attention_mask comes before it)."""
    pytest.importorskip("transformers")
    code, stdout, stderr = run_cli(capsys, "check", f"{keyword_models}:t5")
    assert code == 0, stdout + stderr
    assert "check passed" in stdout


def test_every_option_and_command_says_what_it_does_and_its_default():
    """Issue 47, item 11: --upsample, dump's --out, --host, --port and families had no help,
    --top did not show its default."""
    import argparse

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert {c.dest for c in sub._choices_actions} == set(sub.choices)  # a line in --help each
    for name, command in sub.choices.items():
        assert command.description, name  # the start of `amprewrite NAME --help`
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, flag
            if action.default not in (None, False, [], argparse.SUPPRESS):
                assert "default" in action.help, flag


def test_a_missing_dot_is_one_note_for_both_svg_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot here
    code, out, _ = run_cli(capsys, "dump", f"{MODELS}:mlp", "--inputs", "4x16", "--out",
                            tmp_path / "out")
    assert code == 0, out
    notes = [ln for ln in out.splitlines() if "Graphviz 'dot' is not installed" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: no before.svg or after.svg: "), out


def test_benchmarks_help_keeps_its_table_of_commands(capsys):
    from benchmarks.__main__ import main as benchmarks_main

    with pytest.raises(SystemExit):
        benchmarks_main(["--help"])
    out = capsys.readouterr().out
    assert "\n    python -m benchmarks all            # transform cost," in out
    assert "\n    python -m benchmarks all --quick    # smaller sizes" in out


BLOCK_MODELS = '''
import torch
from amprewrite.testing.scale import blocks_model


def blocks():
    return blocks_model(), (torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(3)),)
'''


def test_compiled_prints_what_the_backend_planned_for_each_block(tmp_path, capsys):
    """`amprewrite compiled --per-block` compiles each block as torchtitan does and shows the
    CompiledReport: the block past fp16's range gets a plan of its own, with its reason."""
    torch._dynamo.reset()
    path = tmp_path / "block_models.py"
    path.write_text(BLOCK_MODELS)
    code, out, _ = run_cli(capsys, "compiled", f"{path}:blocks", "--dtype", "fp16",
                            "--per-block", "blocks")
    assert code == 0
    assert "blocks.0, blocks.1, blocks.2, blocks.3" in out
    assert "blocks.2: planned: new parameters (another block)" in out
    assert "fp16 max 65504" in out and "plan 1 made for it" in out
    code, _, err = run_cli(capsys, "compiled", f"{path}:blocks", "--per-block", "layers")
    assert code == 2 and "--per-block layers: the model has no ModuleList" in err
    torch._dynamo.reset()


def test_check_lists_only_nodes_that_compute_and_differ(capsys):
    """The per-node table is not padded with inputs and parameters (the fp32 graph's own,
    error 0): the MLP's 4 computing nodes that differ, and it says there are only 4."""
    code, out, _ = run_cli(capsys, "check", f"{MODELS}:mlp", "--inputs", "4x16")
    assert code == 0
    head = next(line for line in out.splitlines() if "relative error vs the fp32 graph" in line)
    assert head.startswith("the 4 nodes that differ")
    rows = out.split(head, 1)[1].splitlines()[1:5]
    assert all(row.split()[2] in ("low", "fp32", "promote", "neutral", "cast") for row in rows)
    assert all(float(row.split()[1]) > 0 for row in rows)


# --- plan show / plan diff ------------------------------------------------------------------
def _saved_plans(tmp_path):
    """Two plans of one model: as decided, and with one layer kept fp32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8),
                                torch.nn.Softmax(-1)).eval()
    x = (torch.randn(2, 8),)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    amprewrite.save_plan(amprewrite.transform(model, "bf16", example_inputs=x, progress=False), a)
    amprewrite.save_plan(amprewrite.transform(model, "bf16", example_inputs=x, keep_fp32=["2"],
                                              progress=False), b)
    return a, b


def test_plan_diff_lists_the_changed_nodes_with_both_reasons_and_exits_1(capsys, tmp_path):
    a, b = _saved_plans(tmp_path)
    code, out, err = run_cli(capsys, "plan", "diff", a, b)
    assert code == 1 and not err
    lines = out.splitlines()
    assert "policy: keep_fp32: [] -> ['2']" in lines
    assert re.fullmatch(r"\d+ node\(s\) differ:", lines[1])
    row = next(k for k, line in enumerate(lines) if line.startswith("  2:linear#0 ("))
    assert lines[row].endswith("): class: low -> fp32; dtype: bfloat16 -> float32; "
                               "stored: bfloat16 -> float32")
    assert lines[row + 1] == "    a: op family 'linear'"
    assert lines[row + 2] == "    b: keep_fp32='2'"
    code, out, _ = run_cli(capsys, "plan", "diff", a, a)
    assert code == 0 and out.startswith("the plans' decisions are the same (")


def test_plan_show_prints_the_decisions(capsys, tmp_path):
    a, _ = _saved_plans(tmp_path)
    code, out, _ = run_cli(capsys, "plan", "show", a)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("amprewrite plan: Sequential, dtype=bfloat16, capture=dynamo")
    assert lines[3].startswith("nodes: ") and "low" in lines[3]
    row = next(line for line in lines if "  2:linear#0  " in line)
    assert row.split()[1:4] == ["2:linear#0", "low", "bfloat16"]
    assert row.endswith("op family 'linear'")


def test_plan_commands_say_what_is_wrong_with_a_bad_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"amprewrite_plan": 1, "graphs": [')
    code, out, err = run_cli(capsys, "plan", "show", bad)
    assert code == 2 and not out
    assert err.startswith("amprewrite: error: plan ") and "not valid JSON" in err
    code, _, err = run_cli(capsys, "plan", "diff", tmp_path / "none.json", bad)
    assert code == 2 and "cannot read it" in err


def test_export_applies_a_saved_plan_and_ships_it_in_the_pt2(capsys, tmp_path,
                                                             loaded_here_only):
    model, inputs = cli_models.mlp(), (torch.randn(4, 16),)
    data = json.loads(amprewrite.save_plan(amprewrite.transform(model, "bf16",
                                                                example_inputs=inputs,
                                                                progress=False)))
    data["graphs"][0]["plans"][0]["nodes"]["3:linear#0"]["class"] = "fp32"  # by hand
    plan, out = tmp_path / "plan.json", tmp_path / "mlp.pt2"
    plan.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, "export", f"{MODELS}:mlp", "--inputs", "4x16", "--plan", plan,
                           "--out", out, "--no-check")
    assert code == 0, err
    extra = {"amprewrite_plan.json": ""}
    torch.export.load(out, extra_files=extra)
    shipped = json.loads(extra["amprewrite_plan.json"])["graphs"][0]["plans"][0]["nodes"]
    assert shipped["3:linear#0"]["class"] == "fp32"
    assert "edited by hand" in shipped["3:linear#0"]["reason"]
    assert shipped["0:linear#0"]["class"] == "low"
