"""Shared test helpers: runtime dtype recording, model snapshots, error metrics."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys

import torch
from torch import fx, nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.graph import runtime
from amprewrite.passes.recompute_islands import region_bodies
from amprewrite.precision.ops import Precision
from amprewrite.show.numerics import rel_err  # noqa: F401  (re-exported for the tests)

LOW_DTYPES = [torch.bfloat16, torch.float16]


class DtypeRecorder(fx.Interpreter):
    """Runs a GraphModule and records the dtypes each node actually received and produced."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.seen: dict[str, tuple[list[torch.dtype], object]] = {}

    def run_node(self, n: fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op == "call_function" and n.target is runtime.recompute:
            # A recomputed region: record the dtypes of its body's nodes, not of the call.
            inner = DtypeRecorder(args[0])
            out = inner.run(*args[1:])
            self.seen.update(inner.seen)
            return out
        ins: list[torch.dtype] = []
        fx.node.map_aggregate((args, kwargs), lambda a: ins.append(a.dtype)
                              if isinstance(a, torch.Tensor) and a.is_floating_point() else None)
        out = super().run_node(n)
        self.seen[n.name] = (ins, out.dtype if isinstance(out, torch.Tensor) else None)
        return out


def runtime_dtypes(gm: fx.GraphModule, *inputs) -> dict[str, tuple[list[torch.dtype], object]]:
    rec = DtypeRecorder(gm)
    with torch.no_grad():
        rec.run(*inputs)
    return rec.seen


def _with_module_tensors(gm: fx.GraphModule, node: fx.Node, ins: list[torch.dtype]
                         ) -> list[torch.dtype]:
    """A module call also reads its own weights and buffers."""
    if node.op != "call_module":
        return ins
    module = gm.get_submodule(str(node.target))
    return [*ins, *(t.dtype for t in (*module.parameters(recurse=False),
                                      *module.buffers(recurse=False)) if t.is_floating_point())]


def assert_classes_respected(gm: fx.GraphModule, *inputs, low: torch.dtype) -> None:
    """Every LOW node got only ``low`` float inputs; every FP32 node computed in fp32: only fp32
    inputs, or a low data input through a mixed signature (a norm with fp32 weights and
    statistics, ``dtype=torch.float32``) where the probe confirmed one."""
    seen = runtime_dtypes(gm, *inputs)
    for node in all_nodes(gm):
        cls = node.meta.get(M.CLASS)
        if M.CAST in node.meta or node.name not in seen:
            continue
        ins, _ = seen[node.name]
        if cls == Precision.LOW:
            assert ins and all(d == low for d in ins), (node.format_node(), ins)
        elif cls == Precision.FP32:
            ins = _with_module_tensors(gm, node, ins)
            mixed = all(d == torch.float32 for d in ins) or (
                M.MIXED in node.meta
                and _computes_fp32(node, ins, node.meta.get(M.FAMILY) or ""))
            assert mixed, (node.format_node(), ins)


# The policy's intent (DESIGN.md's precision classes), written out here rather than read from
# the classes amprewrite painted, so that a planner that paints a family wrongly is caught:
# matmul-like ops run low; norms, softmax, exp/log/pow, reductions and losses compute in fp32.
LOW_FAMILIES = frozenset({"conv", "conv_transpose", "linear", "matmul",
                          "scaled_dot_product_attention"})
NORM_FAMILIES = frozenset({"batch_norm", "group_norm", "layer_norm", "instance_norm"})
FP32_FAMILIES = NORM_FAMILIES | frozenset({
    "rms_norm", "softmax", "log_softmax", "softmin", "logsumexp", "exp", "expm1", "log",
    "log1p", "pow", "reciprocal", "rsqrt", "trig", "sum", "mean", "var", "prod", "cumsum",
    "norm", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits"})
# The two rules of the policy that run a LOW family in fp32 (reasons written by paint_precision):
# the first matmul-like op of a position cone, and an op with no low kernel on the device.
_LOW_EXEMPT = ("position cone", "fp32 island")


def _computes_fp32(node: fx.Node, ins: list[torch.dtype], family: str) -> bool:
    if all(d == torch.float32 for d in ins):
        return True
    if node.kwargs.get("dtype") == torch.float32:  # softmax/sum(..., dtype=float32)
        return True
    # A norm kernel given a low input with fp32 weight and statistics accumulates in fp32
    # (DESIGN.md, "compute dtype is not storage dtype").
    return family in NORM_FAMILIES and all(d == torch.float32 for d in ins[1:]) and len(ins) > 1


def assert_policy_intent(gm: fx.GraphModule, *inputs, low: torch.dtype,
                         expect: dict[str, str] | None = None, keep_fp32=(),
                         allow_low=()) -> dict[str, set[str]]:
    """The graph runs what the policy says, whatever amprewrite's own classes say: every node of
    a LOW family got only ``low`` float inputs, every node of an FP32 family computed in fp32.

    ``keep_fp32``/``allow_low`` are the family names the caller overrode (a family kept fp32
    must compute in fp32; an FP32 family allowed low is not checked). ``expect`` maps family
    names to "low" or "fp32" that must each have run at least once, so that a graph without
    the op cannot pass vacuously. Returns {"low": families seen low, "fp32": ... fp32}."""
    seen = runtime_dtypes(gm, *inputs)
    want_low = LOW_FAMILIES - set(keep_fp32)
    want_fp32 = (FP32_FAMILIES - set(allow_low)) | set(keep_fp32)
    ran: dict[str, set[str]] = {"low": set(), "fp32": set()}
    for node in all_nodes(gm):
        family = node.meta.get(M.FAMILY)
        if family is None or M.CAST in node.meta or node.name not in seen:
            continue
        ins = _with_module_tensors(gm, node, seen[node.name][0])
        if not ins:
            continue
        if family in want_low and not str(node.meta.get(M.REASON, "")).startswith(_LOW_EXEMPT):
            assert all(d == low for d in ins), (
                f"{family} should run in {low}: {node.format_node()} got {ins}")
            ran["low"].add(family)
        elif family in want_fp32:
            assert _computes_fp32(node, ins, family), (
                f"{family} should compute in fp32: {node.format_node()} got {ins}")
            ran["fp32"].add(family)
    for family, where in (expect or {}).items():
        assert family in ran[where], f"no {family} node ran in {where} (ran: {ran})"
    return ran


def all_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's nodes and, in place of each ``runtime.recompute`` call, its body's (the
    pass ``recompute_islands`` outlines fp32 regions of train-mode graphs)."""
    bodies = region_bodies(gm)
    out = []
    for n in gm.graph.nodes:
        if n in bodies:
            out += [b for b in bodies[n].graph.nodes if b.op not in ("placeholder", "output")]
        else:
            out.append(n)
    return out


def saved_bytes(fn, model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward while ``fn(x)`` runs (``saved_tensors_hooks``), each
    storage counted once, ``model``'s parameters and buffers left out."""
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def casts(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in all_nodes(gm) if M.CAST in n.meta]


def by_family(gm: fx.GraphModule, family: str) -> list[fx.Node]:
    return [n for n in all_nodes(gm) if n.meta.get(M.FAMILY) == family]


def snapshot(model: nn.Module) -> dict[str, object]:
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    modes = {name: m.training for name, m in model.named_modules()}
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    ids = {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}
    return {"state": state, "modes": modes, "grads": grads, "ids": ids,
            "modules": [id(m) for m in model.modules()]}


def assert_same_snapshot(before: dict, model: nn.Module) -> None:
    after = snapshot(model)
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        w = after["state"][k]
        assert v.dtype == w.dtype and torch.equal(v, w), k
    assert before["modes"] == after["modes"]
    assert before["grads"] == after["grads"]
    assert before["ids"] == after["ids"]
    assert before["modules"] == after["modules"]


@contextlib.contextmanager
def unchanged(model: nn.Module):
    """Assert the block leaves ``model`` bitwise unchanged (tensors, modes, identities)."""
    before = snapshot(model)
    yield
    assert_same_snapshot(before, model)


def transform(*args, **kwargs):
    return amprewrite.transform(*args, **kwargs)


def transform_via(capture: str, model: nn.Module, *inputs, **kwargs) -> fx.GraphModule:
    """Transform with symbolic tracing (``capture="symbolic"``) or dynamo (``"dynamo"``)."""
    example = inputs if capture == "dynamo" else None
    return amprewrite.transform(model, example_inputs=example, **kwargs)


def graph_signature(gm: fx.GraphModule) -> list[tuple]:
    """The graph's structure without node names: (op, target, args with nodes as positions)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a):
        return fx.node.map_arg(a, lambda n: ("node", index[n]))

    return [(n.op, str(n.target) if n.op in ("placeholder", "get_attr", "call_module",
                                             "call_method") else n.target,
             norm(n.args), norm(dict(n.kwargs))) for n in gm.graph.nodes]


def prepared(model, last: str, example_inputs=None, **options):
    """``model`` captured and run through the passes before the one named ``last``; returns
    (graph, that pass bound to the policy), for a test to run it with ``run_pass`` and inspect."""
    from amprewrite.capture.trace import capture
    from amprewrite.passes import pipeline, run_until
    from amprewrite.precision.policy import Policy
    from amprewrite.precision.report import REPORT_KEY, Report

    policy = Policy(**options)
    gm = capture(model, example_inputs).gm
    gm.meta[REPORT_KEY] = Report(dtype=str(policy.dtype), capture="test")
    gm = run_until(gm, policy, last, include=False)
    (p,) = [p for p in pipeline(policy) if p.name == last]
    return gm, p


def rewrites(gm, pass_name: str) -> list:
    """The report's rewrites made by one pass."""
    return [r for r in gm.meta["amprewrite_report"].rewrites if r.pass_name == pass_name]


def corrupt_a_linear(monkeypatch, last: bool = False) -> list[str]:
    """Append a deliberately broken rewrite to the pipeline: the first (or last) linear planned
    in low precision gets an output off by 50% (a wrong low-precision kernel: keeping it in fp32
    is the fix). Returns the list the broken node's name is put in, for the message checks."""
    import torch.nn.functional as F

    import amprewrite.api as api
    from amprewrite.passes.base import Kind, Pass

    corrupted: list[str] = []

    def bad_linear(x, w, b=None):
        return F.linear(x, w, b) * 1.5

    class CorruptLinear(Pass):
        name, kind = "corrupt", Kind.REWRITE

        def run(self, gm):
            nodes = list(gm.graph.nodes)
            for node in reversed(nodes) if last else nodes:
                if (node.target in (F.linear, torch._C._nn.linear)
                        and node.meta.get(M.CLASS) == Precision.LOW):
                    node.target = bad_linear
                    corrupted.append(node.name)
                    return True
            return False

    real = api.pipeline

    def corrupted_pipeline(policy, **verify):  # the broken rewrite goes before the last step,
        passes = real(policy, **verify)        # the check
        return [*passes[:-1], CorruptLinear(policy), passes[-1]]

    monkeypatch.setattr(api, "pipeline", corrupted_pipeline)
    return corrupted


def run_cli(capsys, *args: object) -> tuple[int, str, str]:
    """The command line in this process (``cli.main`` parses the flags as the command does):
    exit code, stdout, stderr."""
    from amprewrite import cli

    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def count_calls(monkeypatch, owner: object, name: str) -> list:
    """``owner.name`` still called, each call appended (its args) to the returned list."""
    real, calls = getattr(owner, name), []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def run_in_process(*args: object, cwd=None) -> subprocess.CompletedProcess:
    """``amprewrite ARGS`` run by ``cli.main`` in this process, in the folder ``cwd``, its
    output caught as a process's would be: a ``CompletedProcess`` with the exit code, stdout and
    stderr (no terminal: the progress lines are plain, as off a terminal)."""
    from amprewrite import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def cli_process(*args: object, cwd=None) -> subprocess.Popen:
    """``python -m amprewrite.cli ARGS`` in a process of its own, pipes for stdout and stderr,
    started as a terminal starts it: Ctrl-C (SIGINT) raises KeyboardInterrupt there. A process
    that ignores SIGINT passes that on to what it starts (POSIX; pytest-xdist's workers ignore
    it), and Python then never turns SIGINT into KeyboardInterrupt."""
    def terminal_sigint():
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return subprocess.Popen([sys.executable, "-m", "amprewrite.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            preexec_fn=terminal_sigint if os.name == "posix" else None)
