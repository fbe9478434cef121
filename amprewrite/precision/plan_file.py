"""Plan files: write a transform's (or a compiled model's) decisions, show them, diff two.

``amprewrite.save_plan(gm, "plan.json")`` writes every decision the report holds under each
node's key (:mod:`amprewrite.precision.saved_plan`); ``transform(model, dtype, plan=...)``
and the backend's ``options={"plan": ...}`` apply it; ``amprewrite plan show`` and
``amprewrite plan diff`` (the CLI) are :func:`show_plan` and :func:`diff_plans`.

>>> import torch, amprewrite
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> text = amprewrite.save_plan(amprewrite.transform(model, "bf16"))
>>> gm = amprewrite.transform(model, "bf16", plan=text)
>>> [(d.key, d.precision) for d in amprewrite.report(gm).decisions if d.family]
[('0:linear#0', 'low'), ('1:softmax#0', 'fp32')]
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import PolicyError
from .report import CompiledReport, Decision, Report, range_cell, report, text_table
from .saved_plan import (
    PLAN_FORMAT,
    SavedPlan,
    dumps,
    load_plan,
    saved_range,
    selector_name,
    short_dtype,
)

__all__ = ["diff_plans", "option_notes", "plan_data", "policy_summary", "save_plan",
           "show_plan"]

# The classes of nodes that take a decision (the others are inputs, parameters, the output,
# casts and non-float values: structure).
_DECIDED = ("low", "fp32", "promote", "neutral")


def policy_summary(policy: object, model: object = None) -> dict:
    """The options of a :class:`~amprewrite.Policy` as a plan records them (JSON values), and
    the class of the ``model`` it transforms (``"model"``), where given."""
    fp8 = getattr(policy, "fp8", None)
    if fp8 is not None:
        fp8 = {k: (list(map(selector_name, v)) if isinstance(v, tuple) else v)
               for k, v in dataclasses.asdict(fp8).items()}
    device = getattr(policy, "device", None)
    out = {} if model is None else {"model": type(model).__name__}
    # keywords, not a literal: these option names are not an op table (test_ops' check)
    return dict(
        **out,
        dtype=short_dtype(policy.dtype),
        keep_fp32=[selector_name(s) for s in policy.keep_fp32],
        allow_low=[selector_name(s) for s in policy.allow_low],
        params=policy.params,
        keep_io_dtype=policy.keep_io_dtype,
        upsample=policy.upsample,
        overflow=policy.overflow,
        capture=policy.capture,
        fp8=fp8,
        calibration_batches=len(policy.calibration),
        device=None if device is None else str(device),
    )


# Options that shape the graph before the plan is applied (a rewrite, the capture) or after
# (stored weights, output casts): where a transform's differ from its plan's, a note says so.
_SHAPING = ("params", "keep_io_dtype", "upsample", "overflow", "capture")


def option_notes(policy: object) -> list[str]:
    """The report's notes on a transform with ``plan=`` whose options differ from the plan's."""
    plan = getattr(policy, "plan", None)
    if plan is None:
        return []
    saved, now = plan.policy, policy_summary(policy)
    return [f"plan: made with {k}={saved[k]!r}, applied with {k}={now[k]!r}: nodes the "
            "option makes or removes are decided afresh or named as missing" for k in _SHAPING
            if k in saved and saved[k] != now[k]]


def _range(d: Decision) -> dict | None:
    r = d.range
    if r is None:
        return None
    out: dict = {"absmax": r.absmax}
    if r.tiny_share:
        out["subnormal"] = r.tiny_share
    out["batches"] = r.batches
    return out


def _nodes(rep: Report) -> dict[str, dict]:
    """The entries of one plan: a report's decisions by key, in graph order."""
    nodes: dict[str, dict] = {}
    casts: dict[str, list[str]] = {}
    values: dict[str, dict] = {}
    for d in rep.decisions:
        if d.key is None:
            continue
        if d.precision == "cast":
            source, _, dtype = d.key.rpartition("->")
            casts.setdefault(source, []).append(dtype)
            continue
        if d.precision in _DECIDED:
            entry = {"node": d.node, "class": d.precision, "dtype": short_dtype(d.dtype)}
            if d.storage is not None and d.storage != d.dtype:
                entry["stored"] = short_dtype(d.storage)
            entry["reason"] = d.reason
            if d.fp8:
                entry["fp8"] = d.fp8
            if d.mixed:
                entry["mixed"] = d.mixed
        elif d.precision in ("input", "param"):
            entry = {"node": d.node, "stored": short_dtype(d.storage)}
            values[d.key] = entry
        else:
            continue
        r = _range(d)
        if r is not None:
            entry["range"] = r
        nodes[d.key] = entry
    for key, dtypes in casts.items():
        if key in nodes:
            nodes[key]["casts"] = dtypes
    for r in rep.rewrites:  # decided, then removed (a model's upcast the plan made a no-op)
        if r.key is not None and r.action == f"remove {r.node}" and r.key not in nodes:
            nodes[r.key] = {"node": r.node, "removed": f"{r.pass_name}: {r.reason}"}
    # an input or a parameter is worth an entry for its range or its casts only
    for key, entry in values.items():
        if "range" not in entry and "casts" not in entry:
            del nodes[key]
    return nodes


def _versions() -> dict:
    """amprewrite's, torch's and Python's versions, and those of the model libraries loaded."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        own = version("amprewrite")
    except PackageNotFoundError:
        own = "unknown"
    out = {"amprewrite": own, "torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "diffusers"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__version__", None):
            out[name] = module.__version__
    return out


def _device(device: str | None) -> str:
    """The device kernels were probed on (``transform(device=...)``, else the CPU), with the
    GPU's name where it is one."""
    device = device or "cpu"
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def plan_data(obj: object) -> dict:
    """The plan of ``obj`` as the dict its file holds: a GraphModule or ExportedProgram from
    :func:`amprewrite.transform`, or a module compiled with ``backend="amprewrite"`` (or a
    model whose blocks were) after its first call."""
    rep = report(obj)  # a PolicyError for anything amprewrite did not transform or compile
    model = obj
    if isinstance(rep, CompiledReport):
        model = getattr(obj, "_orig_mod", obj)
        if not rep.graphs:
            raise PolicyError(
                "this compiled module has no planned graph yet: call it once (the backend "
                "plans on the first call), then save its plan.")
        graphs = []
        for g in rep.graphs:
            plans = g.plans or [g.report]
            graphs.append({
                "blocks": list(g.blocks),
                "plans": [{"blocks": [b for b, i in g.plan_of.items() if i == k],
                           "nodes": _nodes(p)} for k, p in enumerate(plans)],
            })
        first = rep.graphs[0].report
    else:
        first = rep
        graphs = [{"plans": [{"nodes": _nodes(rep)}]}]
    policy = dict(first.policy)
    # the transformed model's class: transform records it, the backend's graphs do not
    name = policy.pop("model", None)
    return {
        "amprewrite_plan": PLAN_FORMAT,
        "model": name or type(model).__name__,
        "dtype": first.dtype,
        "capture": first.capture,
        "made_with": {**_versions(), "device": _device(policy.get("device"))},
        "policy": policy,
        "graphs": graphs,
    }


def save_plan(obj: object, path: str | os.PathLike | None = None) -> str:
    """Write the precision plan of ``obj`` to ``path`` (JSON) and return its text.

    ``obj``: a GraphModule (or ExportedProgram) from :func:`amprewrite.transform`, or a module
    compiled with ``torch.compile(..., backend="amprewrite")`` after its first call (every
    graph's plans, with the blocks each serves). The file holds each node's decision under a
    key made of its module path, op and occurrence, its class, dtype, storage, reason,
    recorded range, casts, float8 verdict; the options it was made with; the versions and
    device. ``path=None`` writes nothing (the text can go into a checkpoint). Apply it with
    ``transform(model, dtype, plan=path_or_text)`` (docs/guide.md, "Plans").

    >>> import torch, amprewrite
    >>> gm = amprewrite.transform(torch.nn.Sequential(torch.nn.Linear(4, 4)), "fp16")
    >>> '"0:linear#0": {"node": "linear", "class": "low", "dtype": "float16"' in save_plan(gm)
    True
    """
    text = dumps(plan_data(obj))
    if path is not None:
        Path(path).write_text(text)
    return text


# --- show ----------------------------------------------------------------------------------
def _cell_range(entry: Mapping) -> str:
    r = saved_range(entry)
    return "-" if r is None else range_cell(r)


def _why(entry: Mapping) -> str:
    """An entry's reason, with its float8 verdict where it has one."""
    return str(entry.get("reason", "-")) + (f"; {entry['fp8']}" if entry.get("fp8") else "")


def _dtype_cell(entry: Mapping) -> str:
    dtype = entry.get("dtype") or "-"
    stored = entry.get("stored")
    if stored and stored != entry.get("dtype") and entry.get("dtype"):
        dtype += "->" + stored
    elif stored and not entry.get("dtype"):
        dtype = stored
    return dtype


def _header(plan: SavedPlan) -> list[str]:
    data = plan.data
    made = data.get("made_with") or {}
    shown = ", ".join(f"{k} {v}" for k, v in made.items())
    opts = ", ".join(f"{k}={v!r}" for k, v in plan.policy.items()
                     if v not in (None, [], 0) or k in ("keep_io_dtype",))
    return [f"amprewrite plan: {plan.model}, dtype={data.get('dtype')}, "
            f"capture={data.get('capture')} ({plan.source})",
            f"made with: {shown}", f"policy: {opts}"]


def show_plan(plan: object) -> str:
    """A plan (a path, its text, its dict or a :class:`SavedPlan`) printed as the report
    prints decisions: one line per node with its key, class, dtype, range, casts and reason."""
    plan = load_plan(plan)
    lines = _header(plan)
    for g, graph in enumerate(plan.graphs):
        for k, p in enumerate(graph["plans"]):
            nodes = p["nodes"]
            counts: dict[str, int] = {}
            for e in nodes.values():
                if e.get("class"):
                    counts[e["class"]] = counts.get(e["class"], 0) + 1
            casts = sum(len(e.get("casts", ())) for e in nodes.values())
            fp8 = [e for e in nodes.values() if e.get("fp8")]
            where = ""
            if graph.get("blocks") is not None:
                served = p.get("blocks") or graph.get("blocks") or []
                where = (f"graph {g} plan {k} (blocks: "
                         f"{', '.join(b or '(the module)' for b in served) or '-'}): ")
            lines.append(f"{where}nodes: "
                         + ", ".join(f"{v} {c}" for c, v in sorted(counts.items()))
                         + f"; casts: {casts}"
                         + (f"; float8: {sum(str(e['fp8']).startswith('fp8') for e in fp8)} "
                            f"of {len(fp8)} linears" if fp8 else ""))
            rows = [["node", "key", "class", "dtype", "|x| max", "casts", "reason"]]
            for key, e in nodes.items():
                rows.append([str(e.get("node", "-")), key, str(e.get("class", "-")),
                             _dtype_cell(e), _cell_range(e),
                             ",".join(e.get("casts", ())) or "-", _why(e)])
            lines.append(text_table(rows, caps=(32, 48, 8, 18, 12, 16)))
    return "\n".join(lines)


# --- diff ----------------------------------------------------------------------------------
# What a node's decision is, for a diff: its class, dtypes, casts, float8 choice and mixed
# signature. Reasons and ranges are shown, not compared (a reworded reason is no change).
_COMPARED = ("class", "dtype", "stored", "casts", "fp8", "mixed")


def _decision(entry: Mapping) -> dict:
    out = {}
    for field in _COMPARED:
        value = entry.get(field)
        if field == "stored" and value is None:
            value = entry.get("dtype")
        if field == "fp8" and value:
            value = str(value).split(":", 1)[0]  # the choice ("fp8 (tensorwise)" / "bf16")
        if field == "casts":
            value = sorted(value or ())
        out[field] = value
    return out


def diff_plans(a: object, b: object) -> tuple[list[str], bool]:
    """The lines ``amprewrite plan diff`` prints and whether the plans' decisions differ: each
    node whose class, dtype, storage, casts, float8 choice or mixed signature differ, with
    both reasons; the nodes only one of them has; the options and versions that differ."""
    a, b = load_plan(a), load_plan(b)
    lines: list[str] = []
    for what, left, right in (("policy", a.policy, b.policy),
                              ("made with", a.data.get("made_with") or {},
                               b.data.get("made_with") or {})):
        for key in [*left, *(k for k in right if k not in left)]:
            if left.get(key) != right.get(key):
                lines.append(f"{what}: {key}: {left.get(key)!r} -> {right.get(key)!r}")
    if a.data.get("dtype") != b.data.get("dtype"):
        lines.append(f"dtype: {a.data.get('dtype')} -> {b.data.get('dtype')}")
    differ = False
    pairs = max(len(a.graphs), len(b.graphs))
    for g in range(pairs):
        ga = a.graphs[g]["plans"] if g < len(a.graphs) else []
        gb = b.graphs[g]["plans"] if g < len(b.graphs) else []
        for k in range(max(len(ga), len(gb))):
            na = ga[k]["nodes"] if k < len(ga) else {}
            nb = gb[k]["nodes"] if k < len(gb) else {}
            where = f" (graph {g} plan {k})" if pairs > 1 or len(ga) > 1 or len(gb) > 1 else ""
            found = _diff_nodes(na, nb)
            if found:
                differ = True
                lines.append(f"{len(found)} node(s) differ{where}:")
                lines += [line for node in found for line in node]
    if not differ:
        lines.append(f"the plans' decisions are the same ({a.entry_count} entries)")
    return lines, differ


def _diff_nodes(na: Mapping[str, Mapping], nb: Mapping[str, Mapping]) -> list[list[str]]:
    """The lines of each node whose decision differs: one, or three with both reasons."""
    out: list[list[str]] = []
    for key in [*na, *(k for k in nb if k not in na)]:
        ea, eb = na.get(key), nb.get(key)
        if ea is None or eb is None:
            side, e = ("b", eb) if ea is None else ("a", ea)
            if "class" not in e:
                continue  # an input's or parameter's range alone: no decision
            out.append([f"  {key} ({e.get('node', '-')}): only in {side}: {e.get('class')} "
                        f"{_dtype_cell(e)}: {e.get('reason', '-')}"])
            continue
        da, db = _decision(ea), _decision(eb)
        changed = [f for f in _COMPARED if da[f] != db[f]]
        if not changed:
            continue
        shown = "; ".join(f"{f}: {_show(da[f])} -> {_show(db[f])}" for f in changed)
        name = ea.get("node") if ea.get("node") == eb.get("node") else (
            f"{ea.get('node')} / {eb.get('node')}")
        out.append([f"  {key} ({name}): {shown}", f"    a: {_why(ea)}", f"    b: {_why(eb)}"])
    return out


def _show(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(value) or "none"
    return str(value)
