"""Graphs for Google's Model Explorer: before and after as one graph collection, namespaced by
module path, plus node-data overlays (precision class, casts, error against fp32).

``amprewrite dump TARGET --format model-explorer`` writes the files; ``amprewrite explore TARGET``
starts Model Explorer on localhost with them (``pip install 'amprewrite[explorer]'``).

The JSON is Model Explorer's custom-graph format (``model_explorer.graph_builder`` and
``node_data_builder``), written here without importing the package:

>>> import torch, amprewrite
>>> from amprewrite.show.explorer import graph_collection
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
>>> x = (torch.randn(2, 8),)
>>> gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=x)
>>> from amprewrite.capture.trace import capture
>>> coll = graph_collection(capture(model, x).gm, gm, label="mlp")
>>> [g["id"] for g in coll["graphs"]]
['before', 'after']
>>> [n["namespace"] for n in coll["graphs"][1]["nodes"] if n["label"] == "linear"]
['0']
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import tempfile
from pathlib import Path
from urllib.parse import quote, unquote

import torch
from torch import fx

from ..errors import AmpRewriteError, UsageError
from .render import COLORS, color
from .views import before_after, namespace

__all__ = ["ExplorerMissingError", "explore", "graph_collection", "node_data", "prepare", "serve",
           "write_model_explorer"]

GRAPHS_FILE = "amprewrite_graphs.json"
OVERLAYS = {"precision": "precision.json", "casts": "casts_bytes.json",
            "error": "error_vs_fp32.json"}
INSTALL_HINT = "pip install 'amprewrite[explorer]'"


class ExplorerMissingError(AmpRewriteError, ImportError):
    """Model Explorer (the optional extra) is not installed."""


def _label(v) -> str:
    if v.precision == "cast":
        return f"cast to {v.dtype}"
    return v.target


def _node(v, classes: dict[str, str]) -> dict:
    precision = classes.get(v.name, v.precision)
    attrs = [("op", v.op), ("target", v.target), ("module", v.module or "(model)"),
             ("family", v.family), ("class", precision), ("compute dtype", v.dtype),
             ("storage dtype", v.storage), ("reason", v.reason), ("source", v.source)]
    if v.error is not None:
        attrs.append(("error vs fp32", f"{v.error:.3e}"))
    node = {"id": v.name, "label": _label(v), "namespace": namespace(v.module),
            "attrs": [{"key": k, "value": str(val)} for k, val in attrs if val],
            "incomingEdges": [{"sourceNodeId": a, "sourceNodeOutputId": "0",
                               "targetNodeInputId": str(k)} for k, a in enumerate(v.inputs)]}
    if v.shape or v.dtype:
        node["outputsMetadata"] = [{"id": "0", "attrs": [
            {"key": "tensor_shape",
             "value": f"{v.storage or v.dtype or '?'}[{v.shape.replace('x', ',')}]"}]}]
    if precision in COLORS or v.rewritten:
        node["style"] = {"backgroundColor": color(precision, v.rewritten)}
    return node


def graph_collection(before: fx.GraphModule, after: fx.GraphModule,
                     rewritten: set[str] | None = None, check: object | None = None,
                     label: str = "amprewrite") -> dict:
    """A Model Explorer ``GraphCollection`` (as JSON data) with graphs ``before`` and ``after``.

    The captured graph's nodes carry the class their node got in the transformed graph (the
    passes keep captured names), so the same colours mark the same decisions on both sides.
    """
    vb, va = before_after(before, after, rewritten, check)
    classes = {v.name: v.precision for v in va.nodes}
    return {"label": label, "graphs": [
        {"id": "before", "nodes": [_node(v, classes) for v in vb.nodes]},
        {"id": "after", "nodes": [_node(v, {}) for v in va.nodes]}]}


def _error_value(e: float) -> float:
    return e if math.isfinite(e) else 1e30  # node data values are numbers; non-finite is red


def node_data(before: fx.GraphModule, after: fx.GraphModule, rewritten: set[str] | None = None,
              check: object | None = None) -> dict[str, dict]:
    """Model Explorer node data (``ModelNodeData`` as JSON data, keyed by graph id) per overlay:
    ``precision`` (the class as a coloured label), ``casts`` (bytes each inserted cast writes)
    and, with a check result, ``error`` (relative error against the fp32 graph)."""
    vb, va = before_after(before, after, rewritten, check)
    classes = {v.name: v.precision for v in va.nodes}
    out: dict[str, dict] = {"precision": {}, "casts": {}}
    if check is not None:
        out["error"] = {}
    for gid, view in (("before", vb), ("after", va)):
        out["precision"][gid] = {"name": "precision", "results": {
            v.name: {"value": classes[v.name], "bgColor": color(classes[v.name])}
            for v in view.nodes if classes.get(v.name)},
            "showExpandedSummaryOnGroupNode": True}
        out["casts"][gid] = {"name": "bytes cast", "results": {
            v.name: {"value": v.nbytes or 0} for v in view.nodes
            if gid == "after" and v.precision == "cast"},
            "gradient": [{"stop": 0, "bgColor": "#f0f0f0"}, {"stop": 1, "bgColor": "#636363"}]}
        if check is not None:
            out["error"][gid] = {"name": "relative error vs fp32", "results": {
                v.name: {"value": _error_value(v.error)} for v in view.nodes
                if v.error is not None},
                "thresholds": [{"value": 1e-3, "bgColor": "#c7e9c0"},
                               {"value": 1e-2, "bgColor": "#fff7bc"},
                               {"value": 1e-1, "bgColor": "#fdae6b"},
                               {"value": 1e31, "bgColor": "#e34a33"}]}
    return out


def write_model_explorer(out: Path, before: fx.GraphModule, after: fx.GraphModule,
                         rewritten: set[str] | None = None, check: object | None = None,
                         label: str = "amprewrite") -> dict[str, Path]:
    """Write the graph collection and one node-data file per overlay into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = {GRAPHS_FILE: out / GRAPHS_FILE}
    files[GRAPHS_FILE].write_text(json.dumps(
        graph_collection(before, after, rewritten, check, label)))
    for name, data in node_data(before, after, rewritten, check).items():
        files[OVERLAYS[name]] = out / OVERLAYS[name]
        files[OVERLAYS[name]].write_text(json.dumps(data))
    return files


def _require():
    try:
        import model_explorer
    except ImportError:
        raise ExplorerMissingError(
            f"Model Explorer is not installed. Install the optional extra with `{INSTALL_HINT}` "
            "(it pulls ai-edge-model-explorer). `amprewrite dump TARGET --format model-explorer` "
            "writes the same graph and node-data JSON files without it, for a Model Explorer "
            "installed elsewhere.") from None
    return model_explorer


def prepare(model: torch.nn.Module, example_inputs: object = None, dtype=torch.bfloat16, *,
            check: bool = True, out: str | Path | None = None, **options) -> dict[str, Path]:
    """Capture, transform and (with ``check`` and inputs) measure ``model``; write the Model
    Explorer files into ``out`` and return them. Without ``out`` they go to a new temporary
    folder that the caller removes (:func:`explore` does when the server stops)."""
    from ..api import transform
    from ..capture.trace import capture, captured_again, keep_captured
    from .numerics import check_numerics
    options.setdefault("verify", False)
    with keep_captured():  # the graph before and the check's reference: the transform's capture
        after = transform(model, dtype=dtype, example_inputs=example_inputs, **options)
        before = captured_again(model, example_inputs, options.get("capture", "dynamo"))
        if before is None:
            before = capture(model, example_inputs).gm
        result = (check_numerics(model, example_inputs, dtype, gm=after)
                  if check and example_inputs is not None else None)
    folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="amprewrite-me-"))
    return write_model_explorer(folder, before, after, None, result,
                                label=type(model).__name__)


def _port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            s.bind((host if host != "localhost" else "127.0.0.1", port))
        except OSError:
            raise UsageError(f"port {port} on {host} is in use; pass another one, e.g. "
                             f"--port {port + 1}.") from None


def _open_side_by_side(config, label: str) -> None:
    """Make the address Model Explorer prints open two panes: after on the left, before on the
    right (its own ``uiState`` URL field, as its "share" links carry it). Node data given at
    start-up colours only the first pane's graph, so after, where the casts are, goes first."""
    plain = config.to_url_param_value

    def with_panes() -> str:
        data = json.loads(unquote(plain()))
        data["uiState"] = {"paneStates": [
            {"deepestExpandedGroupNodeIds": [], "selectedNodeId": "", "selectedGraphId": gid,
             "selectedCollectionLabel": label, "widthFraction": 0.5, "selected": gid == "after"}
            for gid in ("after", "before")]}
        return quote(json.dumps(data))

    config.to_url_param_value = with_panes


def serve(files: dict[str, Path], host: str = "localhost", port: int = 8080,
          open_browser: bool = True) -> None:
    """Start Model Explorer with the files :func:`prepare` wrote; blocks until Ctrl+C."""
    me = _require()
    _port_free(host, port)
    config = me.config().add_model_from_path(str(files[GRAPHS_FILE]))
    for name in OVERLAYS.values():
        if name in files:
            config.add_node_data_from_path(str(files[name]))  # "" targets every graph
    _open_side_by_side(config, json.loads(files[GRAPHS_FILE].read_text())["label"])
    print(f"amprewrite: graphs and overlays in {files[GRAPHS_FILE].parent}", flush=True)
    me.visualize_from_config(config, host=host, port=port, no_open_in_browser=not open_browser)


def explore(model: torch.nn.Module, example_inputs: object = None, dtype=torch.bfloat16, *,
            host: str = "localhost", port: int = 8080, open_browser: bool = True,
            check: bool = True, out: str | Path | None = None, **options) -> None:
    """Start Model Explorer on ``host:port`` with the graph before and after and the overlays;
    blocks until interrupted (Ctrl+C). ``check`` adds the per-node error overlay (needs
    ``example_inputs``). ``options`` are :func:`amprewrite.transform`'s keywords.
    """
    _require()
    _port_free(host, port)
    with contextlib.ExitStack() as stack:
        # Without ``out`` the files live as long as the server: removed when it stops.
        folder = out if out is not None else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="amprewrite-me-"))
        serve(prepare(model, example_inputs, dtype, check=check, out=folder, **options), host,
              port, open_browser)
