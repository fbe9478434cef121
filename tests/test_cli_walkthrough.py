"""The command line and API as a new user meets them (issue 26): progress on long steps, honest
endings, advice in the interface in use, Ctrl-C, checked inputs, whole names, docs that match
``--help``. One section per numbered item of the issue; most run ``cli.main`` in-process (the
process tests in test_cli.py and test_docs.py's demo command cover the entry point) and read
what it printed."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite import cli
from amprewrite.show import render

from .helpers import cli_process, run_cli

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "cli_models.py"

TARGETS = '''
import torch
from torch import nn


class LongNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.an_encoder_block_with_a_name_longer_than_forty_characters = nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(
            self.an_encoder_block_with_a_name_longer_than_forty_characters(x), -1)


def long_names():
    torch.manual_seed(0)
    return LongNames().eval(), (torch.randn(2, 8),)


class Classify(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x).argmax(-1)


def argmax():
    torch.manual_seed(0)
    return Classify().eval(), (torch.randn(2, 8),)


def on_meta():
    with torch.device("meta"):
        return nn.Linear(8, 4)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def branchy():
    return Branchy().eval()
'''


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("targets") / "targets.py"
    path.write_text(TARGETS)
    return path


def errors_of(stderr: str) -> list[str]:
    """stderr without the progress lines."""
    return [ln for ln in stderr.splitlines() if not ln.startswith("amprewrite: [")]


def fake_dot(tmp_path: Path, body: str) -> dict[str, str]:
    """An environment whose PATH finds a `dot` script running ``body``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    dot = bin_dir / "dot"
    dot.write_text("#!/bin/sh\n" + body + "\n")
    dot.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


# 1. Progress on long steps; rendering that says what happened -------------------------------

def test_transform_progress_shows_the_stage_on_stderr(capsys):
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1))
    amprewrite.transform(model, example_inputs=(torch.randn(2, 8),), progress=True)
    shown = capsys.readouterr().err
    # Off a terminal (pytest's stderr): plain lines, one per stage, no terminal codes.
    assert "\x1b" not in shown and "\r" not in shown
    assert "amprewrite.transform: capturing the graph with dynamo\n" in shown
    assert "amprewrite.transform: running the passes on " in shown
    # Not on a terminal and not asked for: silent, as before.
    amprewrite.transform(model, example_inputs=(torch.randn(2, 8),))
    assert capsys.readouterr().err == ""


def test_a_long_step_off_a_terminal_says_it_is_still_running(capsys):
    from amprewrite.progress import Steps, status

    with Steps(2, log=True, show=False, heartbeat=0.2) as steps:
        steps.step("transforming")
        status("running the passes on 9000 nodes")
        time.sleep(1.0)
    err = capsys.readouterr().err
    assert "amprewrite: [1/2] transforming\n" in err
    assert re.search(r"^amprewrite: \[1/2\] transforming: running the passes on 9000 nodes "
                     r"\(still running, \d+ s\)$", err, re.M), err


def test_demo_and_check_fix_log_their_steps_off_a_terminal(capsys, tmp_path):
    # --allow-low fc: the overflow the range rule would otherwise prevent (test_cli.OVERFLOWING)
    code, out, err = run_cli(capsys, "check", f"{MODELS}:overflow", "--dtype", "fp16",
                             "--allow-low", "fc", "--fix")
    assert code == 0, out
    assert "amprewrite: [3/4] searching for nodes to keep in fp32: round 1:" in err
    assert "amprewrite: [4/4] checking with 1 node kept in fp32" in err
    code, _, err = run_cli(capsys, "demo")
    assert code == 0, err
    # The first line comes before any model work, so `amprewrite demo` shows life at once.
    assert err.splitlines()[0] == "amprewrite: [1/3] building the demo model"


def test_svg_timeout_names_the_time_and_the_graph_size(capsys, tmp_path, monkeypatch):
    for name, value in fake_dot(tmp_path, "sleep 30").items():
        monkeypatch.setenv(name, value)
    code, out, _ = run_cli(capsys, "dump", f"{MODELS}:mlp", "--out", tmp_path / "out",
                           "--format", "svg", "--render-timeout", "1")
    assert code == 1  # nothing was written: not a success
    assert re.search(r"no before\.svg: dot timed out after 1 s on a graph of \d+ nodes; "
                     r"raise --render-timeout$", out, re.M), out
    assert "not installed" not in out and out.startswith("wrote no files to ")
    assert "index.html" not in out  # none was written, so none is offered


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc/PID/stat")
def test_a_stopped_render_stops_what_dot_started(tmp_path):
    # A `dot` that is a wrapper script: killing the script alone left its child holding the
    # output pipes, and the render waited 5 s per file for them (the test above took 11 s).
    pids = tmp_path / "pids"
    fake_dot(tmp_path, f"sleep 30 & echo $! >> {pids}; wait")
    dot = str(tmp_path / "bin" / "dot")
    job = render.SvgRender({"a.svg": ("digraph {}", 1), "b.svg": ("digraph {}", 1)},
                           timeout=0.5, dot=dot)
    while len(pids.read_text().split() if pids.exists() else []) < 2:
        time.sleep(0.01)  # both wrappers have started their child
    results = job.wait()
    assert [r.problem for r in results] == [
        "dot timed out after 0.5 s on a graph of 1 nodes; raise --render-timeout"] * 2
    for pid in pids.read_text().split():
        stat = Path(f"/proc/{pid}/stat")
        # gone, or a zombie waiting for its new parent to reap it
        assert not stat.exists() or stat.read_text().split(") ")[1][0] == "Z", pid
    assert all(not t.is_alive() for t in job._threads)  # their pipes were closed


def test_svg_without_dot_is_refused_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot here
    code, out, err = run_cli(capsys, "dump", f"{MODELS}:mlp", "--out", tmp_path / "out",
                             "--format", "svg,text")
    assert code == 2 and out == "" and not (tmp_path / "out").exists()
    (line,) = err.splitlines()  # before loading the model: no progress line
    assert "--format svg needs Graphviz's dot, which is not on PATH" in line
    assert "(--format text)" in line


def test_svg_dot_failure_shows_dot_stderr(capsys, tmp_path, monkeypatch):
    for name, value in fake_dot(tmp_path, "echo 'Error: syntax error in line 3' >&2; exit 1"
                                ).items():
        monkeypatch.setenv(name, value)
    code, out, _ = run_cli(capsys, "dump", f"{MODELS}:mlp", "--out", tmp_path / "out",
                           "--format", "dot,svg")
    assert code == 0
    # Both renders failed the same way: one note names both files (issue 47, item 11).
    assert ("no before.svg or after.svg: dot failed (exit status 1): Error: syntax error in "
            "line 3" in out)
    assert "not installed" not in out


def test_svg_is_left_out_by_default_above_the_node_limit(capsys, tmp_path, monkeypatch):
    called = tmp_path / "dot-was-called"
    for name, value in fake_dot(tmp_path, f"touch {called}; cat").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli.dump, "SVG_MAX_NODES", 5)
    code, out, _ = run_cli(capsys, "dump", f"{MODELS}:mlp", "--out", tmp_path / "out")
    assert code == 0 and not called.exists()
    assert "no svg: the graph has" in out and "index.html shows the graph" in out
    assert (tmp_path / "out" / "index.html").exists()


# 2. check --fix ends honestly ----------------------------------------------------------------

def test_check_fix_says_when_it_kept_every_low_op_in_fp32(capsys):
    code, out, _ = run_cli(capsys, "check", f"{MODELS}:mlp", "--inputs", "4x16",
                           "--rtol", "1e-9", "--fix")
    assert code == 1, out
    assert "kept every low-precision op in fp32" in out and "nothing runs in bf16" in out
    assert "check passed" not in out


# 3. Advice names the cause and the fix in the interface in use -------------------------------

def test_cli_errors_name_flags_not_keywords(capsys, targets):
    code, _, err = run_cli(capsys, "dump", f"{targets}:branchy", "--format", "text")
    assert code == 2
    (line,) = errors_of(err)
    assert "--inputs" in line and "example_inputs" not in line


@pytest.mark.parametrize("spec", ["4x8", "int64:4x16:0-5"])
def test_inputs_the_model_rejects_are_said_to_be_the_inputs_fault(capsys, spec):
    code, _, err = run_cli(capsys, "check", f"{MODELS}:mlp", "--inputs", spec)
    assert code == 2
    (line,) = errors_of(err)
    assert f"the model fails on --inputs {spec}" in line
    assert "without amprewrite, so this is not an amprewrite failure" in line


def test_meta_device_model_is_told_to_materialise(capsys, tmp_path, targets):
    code, _, err = run_cli(capsys, "dump", f"{targets}:on_meta", "--inputs", "2x8", "--out",
                           tmp_path, "--format", "text")
    assert code == 2
    (line,) = errors_of(err)
    assert "Materialise the model first" in line and "inputs" not in line.split("Materialise")[0]


def test_dump_suggests_an_explore_command_that_works(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "dump", f"{MODELS}:mlp", "--inputs", "4x16", "--out",
                           tmp_path, "--format", "model-explorer", "--dtype", "fp16")
    assert code == 0
    assert f"`amprewrite explore {MODELS}:mlp --inputs 4x16 --dtype fp16`" in out


def test_dumps_explore_command_keeps_the_options_it_was_run_with(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "dump", f"{MODELS}:mlp", "--inputs", "4x16", "--out",
                           tmp_path, "--format", "model-explorer", "--keep-fp32", "0",
                           "--allow-low", "layer_norm", "--overflow", "fp32", "--dtype", "fp16")
    assert code == 0
    assert (f"`amprewrite explore {MODELS}:mlp --inputs 4x16 --keep-fp32 0 --allow-low "
            "layer_norm --overflow fp32 --dtype fp16`") in out


# 5. Ctrl-C: one line, status 130 -------------------------------------------------------------

def test_ctrl_c_prints_one_line_and_exits_130():
    proc = cli_process("check", f"{MODELS}:demo", cwd=ROOT)
    lines = []
    for line in proc.stderr:  # wait until the model work has started
        lines.append(line)
        if line.startswith("amprewrite: [2/"):
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, [*lines, rest]
    assert rest.strip().splitlines() == ["amprewrite: interrupted"], rest


# 6. Inputs: one dtype table, checked numbers, the target anywhere, backend options ------------

def test_dtype_flag_takes_the_names_transform_takes(capsys):
    for name in ("float16", "half", "fp16"):
        code, _out, err = run_cli(capsys, "check", f"{MODELS}:mlp", "--inputs", "4x16",
                                 "--dtype", name)
        assert code == 0, err
    assert amprewrite.Policy(dtype="half").dtype == torch.float16


@pytest.mark.parametrize("args, message", [
    (("check", f"{MODELS}:mlp", "--inputs", "4x16", "--rtol", "-1"),
     "argument --rtol: must be a positive number, got '-1'"),
    (("check", f"{MODELS}:mlp", "--inputs", "4x16", "--top", "0"), "argument --top"),
    (("explore", f"{MODELS}:mlp", "--port", "70000"), "argument --port"),
    (("check", f"{MODELS}:mlp", "--inputs", "float32:4x16:1-0"), "the range 1-0 is empty"),
    (("check", f"{MODELS}:mlp", "--dtype", "float32"), "argument --dtype"),
    (("check",), "the following arguments are required: TARGET"),
])
def test_bad_values_are_one_line(args, message):
    done = subprocess.run([sys.executable, "-m", "amprewrite.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2
    (line,) = errors_of(done.stderr)
    assert message in line, done.stderr
    if message.startswith(("argument", "the following")):  # argparse's: point at --help
        assert line.endswith("(see 'amprewrite check --help')") or "explore --help" in line


def test_an_option_before_the_target_does_not_swallow_it(capsys):
    code, out, err = run_cli(capsys, "check", "--inputs", "4x16", f"{MODELS}:mlp")
    assert code == 0, err
    assert "check passed" in out


def test_backend_checks_options_as_transform_does():
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 4))
    model.add_module("fc2", nn.Linear(4, 4))
    with pytest.raises(amprewrite.PolicyError) as api:
        amprewrite.transform(model, keep_fp32=["fc9"])
    compiled = torch.compile(model, backend="amprewrite",
                             options={"keep_fp32": ["fc9"], "inner": "eager"})
    with pytest.raises(Exception, match="keep_fp32 names 'fc9'") as backend:
        compiled(torch.randn(2, 4))
    assert str(api.value) in str(backend.value)


def test_check_without_float_outputs_says_there_is_nothing_to_compare(capsys, targets):
    code, out, _ = run_cli(capsys, "check", f"{targets}:argmax")
    assert code == 0
    assert "nothing to compare" in out and "check passed" not in out
    # No output error of 0 and "finite: True" first: there is no float output to have one.
    assert "output error" not in out and "finite" not in out


# 7. Output a user can use --------------------------------------------------------------------

def test_text_dumps_keep_whole_names_and_drop_empty_columns(capsys, tmp_path, targets):
    code, _, _ = run_cli(capsys, "dump", f"{targets}:long_names", "--out", tmp_path,
                         "--format", "text")
    assert code == 0
    long = "an_encoder_block_with_a_name_longer_than_forty_characters"
    for name in ("before.txt", "after.txt", "report.txt"):
        assert long in (tmp_path / name).read_text(), name
    head = (tmp_path / "before.txt").read_text().splitlines()[0].split()
    assert head == ["name", "op", "target", "module", "dtype"]


def test_a_hf_reports_columns_stay_narrow_and_every_name_stays_whole():
    """Issue 47, item 11: dynamo names a parameter after its path (60 characters on the zoo's
    BERT, 127 on its UNet), and the report's node column was as wide on every row."""
    from amprewrite.testing import zoo

    model, inputs = zoo.bert()
    rep = amprewrite.report(amprewrite.transform(model, dtype=torch.bfloat16,
                                                 example_inputs=inputs))
    head, *lines = rep.table().splitlines()
    rows = [d for d in rep.decisions if d.precision != "nonfloat"]
    assert len(lines) == len(rows) and any(len(d.node) > 50 for d in rows)
    assert head.index("module") == 2 + max(len(d.node) for d in rows if len(d.node) <= 32)
    at = head.index("class")
    for d, line in zip(rows, lines):
        assert line.startswith(d.node + "  ")  # whole: a grep for the name finds its row
        if len(d.node) <= 32 and len(d.module_path) <= 40 and len(d.family or "") <= 20:
            assert line[at:].split()[0] == d.precision, line  # lined up
        else:
            assert line.split()[3] == d.precision, line  # pushed right, two spaces apart


def test_one_file_is_one_file(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "dump", f"{MODELS}:mlp", "--out", tmp_path, "--format",
                           "html")
    assert code == 0 and "wrote 1 file to" in out


def test_explore_removes_its_temporary_folder(capsys, tmp_path, monkeypatch):
    from amprewrite.show import explorer

    served = []
    monkeypatch.setattr(explorer, "_require", lambda: None)
    monkeypatch.setattr(explorer, "serve", lambda files, *a, **k: served.append(files))
    monkeypatch.setattr(explorer.tempfile, "tempdir", str(tmp_path))
    code, _, _ = run_cli(capsys, "explore", f"{MODELS}:mlp", "--inputs", "4x16", "--port",
                         "18731")
    assert code == 0 and served
    explorer.explore(nn.Linear(4, 4), (torch.randn(2, 4),), port=18731)
    assert len(served) == 2 and not list(tmp_path.glob("amprewrite-me-*"))


def test_demo_out_transforms_once(capsys, tmp_path, monkeypatch):
    from amprewrite.passes.paint_precision import PaintPrecision

    runs = []
    original = PaintPrecision.run
    monkeypatch.setattr(PaintPrecision, "run", lambda self, gm: runs.append(1) or original(
        self, gm))
    code, _out, _ = run_cli(capsys, "demo", "--out", tmp_path)
    assert code == 0 and (tmp_path / "index.html").exists()
    assert len(runs) == 1, f"the demo model was transformed {len(runs)} times"


# 9. docs/cli.md lists exactly the parser's flags ----------------------------------------------

def _documented_flags() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "cli.md").read_text()
    block = text[text.index("```\namprewrite demo") + 4:]
    block = block[:block.index("```")]
    flags: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        m = re.match(r"amprewrite (\w+)", line)
        if m:
            command = m[1]
            flags[command] = set()
        flags[command] |= set(re.findall(r"\[(--[\w-]+)", line))
    return flags


def test_cli_doc_lists_every_flag_of_every_command():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    actual = {name: {s for a in p._actions for s in a.option_strings if s.startswith("--")}
              - {"--help"} for name, p in sub.choices.items()}
    assert _documented_flags() == actual


def test_cli_doc_promises_hold():
    text = textwrap.dedent((ROOT / "docs" / "cli.md").read_text())
    assert "exits with status 130" in text and "pointer to the command's `--help`" in text
    assert "svg only for graphs of up to" in text and str(cli.dump.SVG_MAX_NODES) in text


def test_the_check_examples_of_docs_cli_run_as_shown(capsys):
    """docs/cli.md showed `check ...:overflow --dtype fp16` failing after the recorded ranges
    had made it pass; each `$ amprewrite check` block's first and last lines are checked."""
    text = (ROOT / "docs" / "cli.md").read_text()
    blocks = re.findall(r"```\n\$ amprewrite (check [^\n]+)\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    for command, shown in blocks:
        code, out, _ = run_cli(capsys, *shlex.split(command))
        lines = [ln for ln in shown.splitlines() if ln != "..."]
        got = out.splitlines()
        assert lines[-1] in got[-1] and code == (0 if "check passed" in lines[-1] else 1), command
        first = [ln for ln in lines if ln.startswith("output error vs fp32")]
        assert all(ln in got for ln in first), (command, out)
