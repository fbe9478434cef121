"""amprewrite's fp16 ONNX export next to NVIDIA ModelOpt's AutoCast on the fp32 ONNX export
(issue 36, item 8).

    python -m benchmarks.modelopt_autocast [--cases t5_ff attn_scores ...] [--repeats 200]
                                           [--size large]
    python -m benchmarks modelopt [same options]

Setup (once). ``nvidia-modelopt[onnx]`` replaces onnxruntime with onnxruntime-gpu and
downgrades onnx, so it lives in its own virtual environment, never in the Python amprewrite
runs in; the benchmark runs ModelOpt in a subprocess of that environment's Python:

    python -m venv --system-site-packages /tmp/modelopt-venv
    /tmp/modelopt-venv/bin/pip install "nvidia-modelopt[onnx]"

(``--system-site-packages`` lets it reuse this Python's torch; the venv's own onnx 1.21 and
onnxruntime-gpu shadow this Python's onnx and onnxruntime inside the venv only. Measured with
nvidia-modelopt 0.47.0, onnx 1.21.0, onnxruntime-gpu 1.24.4 there.) ``--venv PATH`` or
``$MODELOPT_VENV`` names another environment; without one the ModelOpt columns are empty and
the reason is printed.

Each case is a small fp32 model with example inputs:

- ``t5_ff``: a T5-style feed-forward (RMS norm, wi, ReLU, wo, residual, RMS norm) whose wo
  output reaches about 2e5;
- ``attn_scores``: attention whose scores ``q @ k^T`` are computed before the 1/sqrt(d)
  scaling and reach about 3e5;
- ``residual``: a stack of 11 residual linears without norms, the stream reaching about 7.6e5;
- ``long_sum``: a linear whose 4096 outputs are about 100, summed (about 4e5);
- ``layer_scale``: a residual MLP block whose update is scaled by 1e-6 (a layer scale);
- ``gpt2`` and ``bert``: amprewrite.testing.zoo's GPT-2 and BERT (Hugging Face, small configs,
  random weights, no download).

``--size large`` runs GPT-2 and BERT only, at hidden 256, 4 layers, vocabulary 8192 and 2 x 128
tokens (the zoo's: hidden 64, 2 layers, vocabulary 256, 2 x 64), and writes
docs/benchmarks/modelopt_autocast_large.{json,csv}.

The files of each case, all with static shapes: ``fp32`` (``torch.onnx.export(model,
dynamo=True)``, onnxscript's optimizer on, as a user exports), ``modelopt``
(``modelopt.onnx.autocast.convert_to_mixed_precision(fp32 file, "fp16", keep_io_types=True,
calibration_data=<the example inputs as .npz>)``: its defaults otherwise, data_max 512) and
``amprewrite`` (``amprewrite.deploy.export.export(model, inputs, to="onnx", dtype="fp16",
dynamic_batch=False)``; where transform raises VerificationError, again with verify=False, and
the row says so). A fourth file, ``modelopt_random``, is AutoCast without calibration data (its
default then: random inputs), as a user who has none runs it; the goals compare against the
calibrated one. Columns per file:

- ``error``: relative L2 error of the outputs against the fp32 PyTorch model, the file run with
  every value it declares float16 really rounded (amprewrite.deploy.onnx_rounded); ``ort_error`` the
  same in plain onnxruntime CPU, which computes most float16 ops in float32;
- ``nonfinite``: output elements that are inf or NaN in the rounded run;
- ``fp32_nodes``: compute nodes (not Cast, Constant, Identity, or shape ops) with a float32
  output; ``casts``: Cast and CastLike nodes in the file; ``kb``: file size (with its external
  ``.data`` file, where torch.onnx.export wrote one: it does for the fp32 file);
- ``ms`` and ``ratio``: onnxruntime CPU latency (1 thread, default graph optimisations),
  median of interleaved runs of the files in one process, and its ratio to the fp32 file's;
  ``ms_no_sln``: the same with onnxruntime's ``SkipLayerNormFusion`` turned off for every file
  (``disabled_optimizers``): onnxruntime 1.32's CPU SkipLayerNormalization is 4-7x slower than
  the Add and LayerNormalization it replaces (47 against 12.5 us at 2 x 64 x 64, 322 against
  45 us at 2 x 128 x 256, fp32), and it matches every fp32 residual add before an fp32 norm,
  which amprewrite's files have and ModelOpt's, with a cast between the two, mostly do not;
  ``ms_venv``: the same files timed by the onnxruntime of ModelOpt's venv (the version
  ``nvidia-modelopt[onnx]`` installs, 1.24.4, on its CPU provider; its SkipLayerNormalization
  is not slower than the two ops), in a subprocess.

Goals (issue 36): on every case amprewrite finite wherever either tool is, error <= ModelOpt's,
file size <= 1.1x ModelOpt's, latency <= 1.05x ModelOpt's. Writes
docs/benchmarks/modelopt_autocast.{json,csv}.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from amprewrite.capture.verify import float_leaves, rel_err
from amprewrite.deploy import export as deploy
from amprewrite.errors import VerificationError
from amprewrite.testing import zoo

from .common import interleaved, save, table

VENV = Path(os.environ.get("MODELOPT_VENV", "/tmp/modelopt-venv"))
TOOLS = ["fp32", "modelopt", "modelopt_random", "amprewrite"]
GOALS = {"size": 1.1, "latency": 1.05}
NO_SLN = ("SkipLayerNormFusion",)
COLUMNS = ["case", "tool", "error", "ort_error", "nonfinite", "fp32_nodes", "casts", "kb",
           "ms", "ratio", "ms_no_sln", "ms_venv", "note"]
VERDICT_COLUMNS = ["case", "finite", "error", "size", "latency", "latency_no_sln",
                   "latency_venv", "error_ratio", "size_ratio", "latency_ratio",
                   "latency_ratio_no_sln", "latency_ratio_venv"]
# Ops that move or describe data without arithmetic: not counted as fp32 compute.
_NOT_COMPUTE = {"Cast", "CastLike", "Constant", "Identity", "Shape", "Reshape", "Transpose",
                "Unsqueeze", "Squeeze", "Concat", "Slice", "Gather", "GatherND", "Expand",
                "Split", "ConstantOfShape", "Range", "Flatten", "SequenceAt",
                "SplitToSequence", "Where"}


# --- the cases ----------------------------------------------------------------------------

def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class T5FeedForward(nn.Module):
    """T5's dense-relu-dense block with its wo output at about 2e5 (T5 v1.1's known fp16
    overflow, the reason transformers keeps ``wo`` in fp32)."""

    def __init__(self, d: int = 64, ff: int = 256) -> None:
        super().__init__()
        self.wi, self.wo = nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)
        with torch.no_grad():
            self.wi.weight.mul_(30.0)
            self.wo.weight.mul_(9000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x + self.wo(torch.relu(self.wi(_rms(x)))))


class ScoresBeforeScaling(nn.Module):
    """Attention that scales the scores after ``q @ k^T`` (scores about 3e5)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.out = nn.Linear(d, d)
        with torch.no_grad():
            self.q.weight.mul_(156.0)
            self.k.weight.mul_(156.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.out(torch.softmax(scores / math.sqrt(x.shape[-1]), -1) @ self.v(x))


class ResidualStack(nn.Module):
    """Residual linears without norms: the stream grows to about 7.6e5."""

    def __init__(self, d: int = 64, depth: int = 11) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.mul_(5.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class LongSum(nn.Module):
    """A sum over 4096 values of about 100."""

    def __init__(self, d: int = 64, n: int = 4096) -> None:
        super().__init__()
        self.proj = nn.Linear(d, n)
        with torch.no_grad():
            self.proj.weight.mul_(0.1)
            self.proj.bias.fill_(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum(-1)


class LayerScale(nn.Module):
    """A residual MLP block whose update is scaled by a learned 1e-6 (CaiT/ConvNeXt layer
    scale at its initial value)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(torch.full((d,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _seeded(cls: type[nn.Module], shape: tuple[int, ...]):
    def make():
        torch.manual_seed(0)
        return cls().eval(), (torch.randn(*shape),)
    return make


def _gpt2_large():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=8192, n_embd=256, n_layer=4, n_head=4, n_positions=512,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval(), (torch.randint(0, 8192, (2, 128)),)


def _bert_large():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                     num_attention_heads=4, intermediate_size=1024, max_position_embeddings=512)
    torch.manual_seed(0)
    return BertModel(cfg).eval(), (torch.randint(0, 8192, (2, 128)),)


CASES = {
    "t5_ff": _seeded(T5FeedForward, (2, 32, 64)),
    "attn_scores": _seeded(ScoresBeforeScaling, (2, 32, 64)),
    "residual": _seeded(ResidualStack, (2, 32, 64)),
    "long_sum": _seeded(LongSum, (2, 8, 64)),
    "layer_scale": _seeded(LayerScale, (2, 32, 64)),
    "gpt2": zoo.MODELS["gpt2"],
    "bert": zoo.MODELS["bert"],
}
# --size large: GPT-2 and BERT at hidden 256, 4 layers, vocabulary 8192, 2 x 128 tokens, where
# the zoo's (hidden 64, 2 x 64 tokens) spend most of their time on per-op overhead and casts.
LARGE = {"gpt2": _gpt2_large, "bert": _bert_large}


# --- the three files ------------------------------------------------------------------------

_WORKER = r"""
import json, sys, time, traceback
import onnx
from modelopt.onnx.autocast import convert_to_mixed_precision
for job in json.loads(sys.argv[1]):
    start = time.perf_counter()
    try:
        model = convert_to_mixed_precision(job["src"], "fp16", keep_io_types=True,
                                           calibration_data=job["calib"])
        onnx.save(model, job["dst"])
        print(json.dumps({"dst": job["dst"], "s": time.perf_counter() - start}), flush=True)
    except Exception as exc:
        print(json.dumps({"dst": job["dst"], "error": f"{type(exc).__name__}: {exc}"[:300]}),
              flush=True)
"""


def modelopt_python(venv: Path) -> tuple[Path | None, str]:
    """The venv's Python if it imports modelopt's AutoCast, else None and why."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None, (f"no Python at {python}: set up the venv as this module's docstring says "
                      "(or pass --venv)")
    done = subprocess.run([os.fspath(python), "-c", "import modelopt.onnx.autocast"],
                          capture_output=True, text=True)
    if done.returncode:
        return None, f"{python} cannot import modelopt.onnx.autocast: {done.stderr[-300:]}"
    return python, ""


def run_modelopt(python: Path, jobs: list[dict]) -> dict[str, dict]:
    """ModelOpt's AutoCast on each job (src, dst, calib) in one subprocess of the venv."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU provider, as the rest of the benchmark
    done = subprocess.run([os.fspath(python), "-c", _WORKER, json.dumps(jobs)],
                          capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            results[item["dst"]] = item
    for job in jobs:
        results.setdefault(job["dst"], {"error": f"worker exited {done.returncode}: "
                                                 f"{done.stderr.strip()[-300:]}"})
    return results


def export_fp32(model: nn.Module, inputs: tuple, path: Path) -> None:
    torch.onnx.export(model, inputs, os.fspath(path), dynamo=True, verbose=False)


def export_amprewrite(model: nn.Module, inputs: tuple, path: Path) -> str:
    """amprewrite's fp16 file; the note says when verification had to be turned off."""
    try:
        deploy.export(model, inputs, path=path, to="onnx", dtype="fp16", dynamic_batch=False,
                      check=False)
        return ""
    except VerificationError as exc:
        deploy.export(model, inputs, path=path, to="onnx", dtype="fp16", dynamic_batch=False,
                      check=False, verify=False)
        return f"verify=False (transform raised VerificationError: {str(exc)[:80]}...)"


# --- measuring --------------------------------------------------------------------------------

def feeds_for(path: Path, inputs: tuple) -> dict[str, np.ndarray]:
    import onnx

    names = [i.name for i in onnx.load(os.fspath(path), load_external_data=False).graph.input]
    return {n: t.numpy() for n, t in zip(names, inputs)}


def fp32_nodes(model) -> int:
    import onnx

    g = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.output]
             if v.type.HasField("tensor_type")}
    return sum(1 for n in g.node if n.op_type not in _NOT_COMPUTE
               and any(types.get(o) == onnx.TensorProto.FLOAT for o in n.output))


def describe(path: Path, inputs: tuple, refs: list[torch.Tensor]) -> dict:
    import onnx
    import onnxruntime

    from amprewrite.deploy.onnx_lean import cast_count
    from amprewrite.deploy.onnx_rounded import RoundedSession

    model = onnx.load(os.fspath(path))
    feeds = feeds_for(path, inputs)
    session = onnxruntime.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])
    plain = [torch.from_numpy(np.asarray(o)) for o in session.run(None, feeds)]
    exact = [torch.from_numpy(np.asarray(o)) for o in RoundedSession(model).run(feeds)]
    plain = [o for o in plain if o.is_floating_point()]
    exact = [o for o in exact if o.is_floating_point()]
    return {
        "error": max(rel_err(o.float(), r) for o, r in zip(exact, refs)),
        "ort_error": max(rel_err(o.float(), r) for o, r in zip(plain, refs)),
        "nonfinite": int(sum((~torch.isfinite(o)).sum() for o in exact)),
        "fp32_nodes": fp32_nodes(model), "casts": cast_count(model),
        "kb": sum(f.stat().st_size for f in (path, path.with_name(path.name + ".data"))
                  if f.exists()) / 1024,
    }


def latencies(paths: dict[str, Path], inputs: tuple, repeats: int,
              disabled: tuple[str, ...] = ()) -> dict[str, float]:
    """Median onnxruntime CPU latency of each file (1 thread), interleaved; ``disabled``:
    onnxruntime graph optimisers turned off (``disabled_optimizers``)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    fns = {}
    for tool, path in paths.items():
        session = onnxruntime.InferenceSession(os.fspath(path), options,
                                               providers=["CPUExecutionProvider"],
                                               disabled_optimizers=list(disabled))
        feeds = feeds_for(path, inputs)
        fns[tool] = lambda s=session, f=feeds: s.run(None, f)
    return {tool: ms for tool, (ms, _) in interleaved(fns, repeats, warmup=5).items()}


def measure(case: str, out: Path, python: Path | None, repeats: int,
            why_not: str, size: str = "small") -> list[dict]:
    model, inputs = (LARGE if size == "large" else CASES)[case]()
    with torch.no_grad():
        refs = float_leaves(model(*inputs))
    paths = {tool: out / f"{case}-{tool}.onnx" for tool in TOOLS}
    notes = {tool: "" for tool in TOOLS}
    export_fp32(model, inputs, paths["fp32"])
    torch._dynamo.reset()
    notes["amprewrite"] = export_amprewrite(model, inputs, paths["amprewrite"])
    made = ["fp32", "amprewrite"]
    if python is None:
        notes["modelopt"] = notes["modelopt_random"] = why_not
    else:
        calib = out / f"{case}.npz"
        np.savez(calib, **feeds_for(paths["fp32"], inputs))
        done = run_modelopt(python, [
            {"src": os.fspath(paths["fp32"]), "dst": os.fspath(paths[tool]),
             "calib": os.fspath(calib) if tool == "modelopt" else None}
            for tool in ("modelopt", "modelopt_random")])
        for tool in ("modelopt", "modelopt_random"):
            if "error" in done[os.fspath(paths[tool])]:
                notes[tool] = f"AutoCast failed: {done[os.fspath(paths[tool])]['error']}"
            else:
                made.append(tool)
    ok = {t: paths[t] for t in TOOLS if t in made}
    rows = []
    for tool in TOOLS:
        row: dict[str, object] = {"case": case, "tool": tool, "note": notes[tool]}
        if tool in ok:
            row.update(describe(ok[tool], inputs, refs))
        rows.append(row)
    times = latencies(ok, inputs, repeats)
    # onnxruntime 1.32's CPU SkipLayerNormalization, which it fuses from an fp32 Add and
    # LayerNormalization, is 4-7x slower than the two (docs/benchmarks.md): without that fusion
    unfused = latencies(ok, inputs, repeats, disabled=NO_SLN)
    other = venv_latencies(python, ok, inputs, repeats, out) if python is not None else {}
    for row in rows:
        if row["tool"] in times:
            row["ms"] = times[row["tool"]]
            row["ratio"] = times[row["tool"]] / times["fp32"]
            row["ms_no_sln"] = unfused[row["tool"]]
            if row["tool"] in other:
                row["ms_venv"] = other[row["tool"]]
    return rows


_TIMER = r"""
import json, sys, time
import numpy as np, onnxruntime
job = json.loads(sys.argv[1])
arrays = np.load(job["inputs"])
options = onnxruntime.SessionOptions()
options.intra_op_num_threads = options.inter_op_num_threads = 1
options.log_severity_level = 3
runs = {}
for tool, path in job["paths"].items():
    s = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feeds = {i.name: arrays[f"arr_{k}"] for k, i in enumerate(s.get_inputs())}
    runs[tool] = (s, feeds)
times = {tool: [] for tool in runs}
for k in range(job["repeats"] + 5):
    for tool, (s, feeds) in runs.items():
        start = time.perf_counter()
        s.run(None, feeds)
        if k >= 5:
            times[tool].append(time.perf_counter() - start)
print(json.dumps({t: 1e3 * float(np.median(v)) for t, v in times.items()}))
"""


def venv_latencies(python: Path, paths: dict[str, Path], inputs: tuple, repeats: int,
                   out: Path) -> dict[str, float]:
    """:func:`latencies` in the ModelOpt venv's onnxruntime (its own version), in a subprocess;
    empty where that fails."""
    arrays = out / "inputs.npz"
    np.savez(arrays, *[t.numpy() for t in inputs])
    job = {"paths": {t: os.fspath(p) for t, p in paths.items()}, "inputs": os.fspath(arrays),
           "repeats": repeats}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([os.fspath(python), "-c", _TIMER, json.dumps(job)],
                          capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def verdicts(rows: list[dict]) -> list[dict]:
    """Per case: amprewrite against ModelOpt on the issue's four goals."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["tool"]: r for r in rows if r["case"] == case}
        ours, peer = by.get("amprewrite", {}), by.get("modelopt", {})
        if "error" not in ours or "error" not in peer:
            continue
        finite = ours["nonfinite"] == 0 or peer["nonfinite"] > 0
        out.append({
            "case": case, "finite": finite,
            "error": ours["error"] <= peer["error"],
            "size": ours["kb"] <= GOALS["size"] * peer["kb"],
            "latency": ours["ms"] <= GOALS["latency"] * peer["ms"],
            "latency_no_sln": ours["ms_no_sln"] <= GOALS["latency"] * peer["ms_no_sln"],
            "error_ratio": ours["error"] / peer["error"] if peer["error"] else math.inf,
            "size_ratio": ours["kb"] / peer["kb"], "latency_ratio": ours["ms"] / peer["ms"],
            "latency_ratio_no_sln": ours["ms_no_sln"] / peer["ms_no_sln"],
        })
        if "ms_venv" in ours and "ms_venv" in peer:
            out[-1]["latency_venv"] = ours["ms_venv"] <= GOALS["latency"] * peer["ms_venv"]
            out[-1]["latency_ratio_venv"] = ours["ms_venv"] / peer["ms_venv"]
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.modelopt_autocast",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES),
                        help="default: all (with --size large: gpt2 and bert)")
    parser.add_argument("--size", choices=["small", "large"], default="small",
                        help="large: GPT-2 and BERT at hidden 256, 4 layers, vocabulary 8192, "
                             "2 x 128 tokens (writes NAME_large)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--name", default="modelopt_autocast")
    args = parser.parse_args(argv)
    cases = args.cases or list(LARGE if args.size == "large" else CASES)
    if args.size == "large":
        if set(cases) - set(LARGE):
            parser.error(f"--size large has only the cases {', '.join(LARGE)}")
        args.name += "_large"
    warnings.simplefilter("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the torchvision ops it skips
    python, why_not = modelopt_python(args.venv)
    if python is None:
        print(f"ModelOpt columns left empty: {why_not}", file=sys.stderr)
    rows: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            rows += measure(case, Path(tmp), python, args.repeats, why_not, args.size)
            for row in rows[-len(TOOLS):]:
                print(" ".join(f"{k}={row[k]:.3g}" if isinstance(row.get(k), float)
                               else f"{k}={row[k]}" for k in COLUMNS if k in row), flush=True)
    total = time.perf_counter() - start
    print(table(rows, COLUMNS))
    checks = verdicts(rows)
    print(table(checks, VERDICT_COLUMNS))
    modelopt_version = None
    if python is not None:
        modelopt_version = subprocess.run(
            [os.fspath(python), "-c", "import modelopt, onnx, onnxruntime; print(modelopt."
             "__version__, onnx.__version__, onnxruntime.__version__)"],
            capture_output=True, text=True).stdout.strip()
    save(args.name, rows, {"goals": GOALS, "verdicts": checks, "total_s": total,
                           "repeats": args.repeats, "size": args.size,
                           "modelopt_onnx_onnxruntime": modelopt_version,
                           "onnxruntime": __import__("onnxruntime").__version__})
    return rows


if __name__ == "__main__":
    main()
