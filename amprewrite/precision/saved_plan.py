"""A saved plan: every precision decision of a transform, read back to be applied again
(DESIGN.md, "The plan as an artefact").

A plan file (:func:`amprewrite.save_plan`) is JSON: what it was made with (versions, device,
the policy) and, per graph, one entry per node under a key that does not depend on node
names: the node's module path, what it is (its op family, else its op) and its occurrence
among the nodes of that module and kind, in graph order (``model.layers.0.mlp:linear#1``).
Nodes the passes between record_ranges and paint_precision make are counted apart
(``...:mul@rescale_matmuls#0``): record_ranges reads a plan's ranges by the keys of the nodes
before them, and they must not renumber those. Graph inputs are ``input:<name>``,
parameters ``param:<qualified name>``.

This module reads plans (:func:`load_plan`) and matches them to a graph
(:meth:`SavedPlan.match`): the passes that consult a plan (record_ranges, paint_precision,
float8_linears) ask it for each node's entry. Writing, showing and diffing plans is
:mod:`amprewrite.precision.plan_file`.

>>> plan = load_plan({"amprewrite_plan": 1, "dtype": "bfloat16", "graphs": [{"plans": [
...     {"nodes": {":linear#0": {"class": "fp32", "reason": "by hand"}}}]}]})
>>> plan.dtype, plan.entry_count
(torch.bfloat16, 1)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx

from ..errors import PolicyError
from ..graph import meta as M
from ..graph.dtypes import low_dtype
from ..graph.modules import submodule
from .ops import Precision, family_of, op_qualname

__all__ = ["PLAN_FILE", "PLAN_FORMAT", "PlanMatch", "SavedPlan", "dumps", "load_plan", "node_keys",
           "saved_range", "selector_name", "short_dtype"]

PLAN_FORMAT = 1
"""The version of the file format, in every file's ``"amprewrite_plan"`` field."""

PLAN_FILE = "amprewrite_plan.json"
"""The name a plan goes by beside the weights: the extra file of a ``.pt2`` that
``amprewrite export`` writes (``torch.export.load(path, extra_files={PLAN_FILE: ""})``)."""

# The passes that run between record_ranges and paint_precision (amprewrite/passes/__init__.py):
# the nodes they make have keys of their own.
_MADE_AFTER_RANGES = frozenset({"transform_bodies", "rescale_matmuls"})
# Keys of graph inputs and parameters: they take no decision of their own, so a graph whose
# parameters are its inputs (the torch.compile backend's) still matches by its ops.
_VALUE_KEYS = ("input:", "param:")


def short_dtype(dtype: object) -> str | None:
    """``"bfloat16"`` for ``torch.bfloat16`` (or its string), None for None."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def selector_name(selector: object) -> str:
    """A ``keep_fp32`` / ``allow_low`` selector as a plan records it: a string as it is, a
    module type by its qualified name (``torch.nn.modules.normalization.LayerNorm``)."""
    if isinstance(selector, type):
        return f"{selector.__module__}.{selector.__qualname__}"
    return str(selector)


def dumps(data: dict) -> str:
    """A plan as its file holds it: indented JSON with one line per node entry, so that a
    change of one decision is a change of one line in a review.

    >>> print(dumps({"a": 1, "graphs": [{"plans": [{"nodes": {"k": {"class": "low"}}}]}]}), end="")
    {
     "a": 1,
     "graphs": [
      {
       "plans": [
        {
         "nodes": {
          "k": {"class": "low"}
         }
        }
       ]
      }
     ]
    }
    """
    return _emit(data, 0) + "\n"


def _emit(value: object, depth: int) -> str:
    pad = " " * (depth + 1)
    if not isinstance(value, (dict, list)) or not value:
        return json.dumps(value)
    if isinstance(value, list):
        items = [pad + _emit(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"
    items = [f"{pad}{json.dumps(k)}: "
             + (_entries(v, depth + 1) if k == "nodes" else _emit(v, depth + 1))
             for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def _entries(nodes: dict, depth: int) -> str:
    if not nodes:
        return "{}"
    pad = " " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {json.dumps(v)}" for k, v in nodes.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def _what(gm: fx.GraphModule, node: fx.Node, family: str | None) -> str:
    """What a node is, for its key: its op family, else its op."""
    if family:
        return family
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        try:
            return type(submodule(gm, str(node.target))).__name__
        except AttributeError:
            return str(node.target)
    qual = op_qualname(node.target)
    return qual or getattr(node.target, "__name__", str(node.target))


def node_keys(gm: fx.GraphModule, families: Mapping[fx.Node, str | None] | None = None
              ) -> dict[fx.Node, str]:
    """The plan key of every node of ``gm`` (see the module docstring); ``families``: each
    node's family name where already known (paint_precision's), else found here.

    >>> import torch
    >>> from amprewrite.capture.trace import capture
    >>> gm = capture(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())).gm
    >>> list(node_keys(gm).values())
    ['input:input', '0:linear#0', '1:relu#0', 'output']
    """
    keys: dict[fx.Node, str] = {}
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            keys[node] = f"input:{node.target}"
            continue
        if node.op == "get_attr":
            keys[node] = f"param:{node.target}"
            continue
        if node.op == "output":
            keys[node] = "output"
            continue
        if families is not None and node in families:
            family = families[node]
        else:
            module = None
            if node.op == "call_module":
                try:
                    module = submodule(gm, str(node.target))
                except AttributeError:
                    module = None
            fam = family_of(node, module)
            family = fam.name if fam is not None else None
        made = node.meta.get(M.MADE_BY)
        base = (f"{node.meta.get(M.MODULE_PATH, '')}:{_what(gm, node, family)}"
                + (f"@{made}" if made in _MADE_AFTER_RANGES else ""))
        k = counts.get(base, 0)
        counts[base] = k + 1
        keys[node] = f"{base}#{k}"
    return keys


def saved_range(entry: Mapping[str, object]):
    """The :class:`~amprewrite.precision.ranges.ValueRange` an entry records, or None."""
    from .ranges import ValueRange

    r = entry.get("range")
    if not isinstance(r, Mapping) or "absmax" not in r:
        return None
    return ValueRange(float(r["absmax"]), float(r.get("subnormal", 0.0)),
                      int(r.get("batches", 0)))


@dataclass
class PlanMatch:
    """A saved plan matched to one graph: each node's entry (``entries``), the nodes that need
    a decision and have none (``new``: the model changed) and the plan's nodes this graph does
    not have (``missing``)."""

    entries: dict[fx.Node, dict]
    new: list[fx.Node] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


class SavedPlan:
    """A plan file read back (:func:`load_plan`). Two plans are equal when their contents are
    (a digest of the JSON), so a :class:`~amprewrite.Policy` holding one compares and hashes.

    ``source``: where it was read from (a path, or ``"<dict>"`` / ``"<text>"``)."""

    def __init__(self, data: dict, source: str):
        if not isinstance(data, dict) or data.get("amprewrite_plan") != PLAN_FORMAT:
            found = data.get("amprewrite_plan") if isinstance(data, dict) else None
            raise PolicyError(
                f"plan {source} is not an amprewrite plan of format {PLAN_FORMAT} (its "
                f"'amprewrite_plan' field is {found!r}): pass a file written by "
                "amprewrite.save_plan (or its text, or the dict json.load gives), made by an "
                "amprewrite that writes this format.")
        graphs = data.get("graphs")
        if not isinstance(graphs, list) or not all(
                isinstance(g, dict) and isinstance(g.get("plans"), list) and g["plans"]
                and all(isinstance(p, dict) and isinstance(p.get("nodes"), dict)
                        for p in g["plans"]) for g in graphs):
            raise PolicyError(
                f"plan {source} has no valid 'graphs' list (each graph a 'plans' list, each "
                "plan a 'nodes' object of entries by key): was it edited beyond the fields "
                "of its entries? Save it again with amprewrite.save_plan.")
        self.data, self.source = data, source
        self.digest = hashlib.sha256(
            json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
        self.dtype = low_dtype(data.get("dtype"))
        for g in graphs:
            for p in g["plans"]:
                for key, entry in p["nodes"].items():
                    cls = entry.get("class") if isinstance(entry, dict) else None
                    if cls is not None and cls not in _CLASSES:
                        raise PolicyError(
                            f"plan {source}: node '{key}' has class {cls!r}; a class is one of "
                            f"{', '.join(map(repr, _CLASSES))} (edit it to 'fp32' to keep the "
                            "node in float32, 'low' to run it in the low dtype).")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SavedPlan) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"SavedPlan({self.source!r}, {self.entry_count} entries)"

    @property
    def model(self) -> str:
        return str(self.data.get("model", "?"))

    @property
    def policy(self) -> dict:
        return dict(self.data.get("policy") or {})

    @property
    def graphs(self) -> list[dict]:
        return self.data["graphs"]

    @property
    def entry_count(self) -> int:
        return sum(len(p["nodes"]) for g in self.graphs for p in g["plans"])

    def scoped(self, prefix: str) -> SavedPlan | None:
        """The plan of the region body ``prefix`` (an activation checkpoint's, transformed as a
        graph of its own): its entries, saved as ``<prefix>/<key>``, by their own keys; None
        when the plan has none."""
        start = prefix + "/"
        graphs = [{**g, "plans": [{**p, "nodes": {k[len(start):]: v for k, v in p["nodes"].items()
                                                  if k.startswith(start)}} for p in g["plans"]]}
                  for g in self.graphs]
        if not any(p["nodes"] for g in graphs for p in g["plans"]):
            return None
        return SavedPlan({**self.data, "graphs": graphs}, f"{self.source} ({prefix})")

    def match(self, keys: Mapping[fx.Node, str], wanted: Iterable[fx.Node]) -> PlanMatch:
        """Each node's entry from the saved graph that knows most of ``wanted`` (the nodes
        that take a decision); raises :class:`~amprewrite.errors.PolicyError` when it knows
        fewer than half of them: a plan for another model."""
        wanted = list(wanted)
        best, best_known = 0, -1
        for g, graph in enumerate(self.graphs):
            nodes = graph["plans"][0]["nodes"]
            known = sum(keys[n] in nodes for n in wanted)
            if known > best_known:
                best, best_known = g, known
        if wanted and best_known * 2 < len(wanted):
            raise PolicyError(
                f"plan {self.source} was made for {self.model}, and of this graph's "
                f"{len(wanted)} nodes that take a precision decision only {best_known} have "
                "an entry in it: it is a plan for another model (or for another capture of "
                "this one; a plan's keys are module paths and ops, docs/guide.md, \"Plans\"). "
                "Pass the plan saved for this model, or transform without plan= to decide "
                "afresh and save that with amprewrite.save_plan.")
        nodes = self.graphs[best]["plans"][0]["nodes"]
        entries = {n: nodes[k] for n, k in keys.items() if k in nodes}
        present = set(keys.values())
        # (a region body's entries, <body>/<key>, are matched by the body's own transform)
        missing = [k for k in nodes if k not in present and not k.startswith(_VALUE_KEYS)
                   and "->" not in k and "/" not in k]
        new = [n for n in wanted if n not in entries]
        return PlanMatch(entries, new, missing)


_CLASSES = tuple(p.value for p in Precision)


def load_plan(value: object) -> SavedPlan:
    """A plan from a path (``str`` / ``os.PathLike``), its JSON text (a ``str`` starting with
    ``{``, as a checkpoint or an artefact's extra file carries it), the dict ``json.load``
    gives, or a :class:`SavedPlan` (returned as is)."""
    if isinstance(value, SavedPlan):
        return value
    if isinstance(value, Mapping):
        return SavedPlan(dict(value), "<dict>")
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return SavedPlan(_parse(value, "<text>"), "<text>")
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PolicyError(
                f"plan={str(value)!r}: cannot read it ({exc.strerror or exc}). Pass the path "
                "of a file written by amprewrite.save_plan, its JSON text or its dict.") from None
        return SavedPlan(_parse(text, str(path)), str(path))
    raise PolicyError(
        f"plan must be a path to a file written by amprewrite.save_plan, its JSON text, the "
        f"dict json.load gives or a loaded plan; got {type(value).__name__}.")


def _parse(text: str, source: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyError(
            f"plan {source} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
            f"{exc.colno}): an edit broke it. Fix that line, or save the plan again with "
            "amprewrite.save_plan.") from None
