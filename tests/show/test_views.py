"""The graph views: the HTML report and the Model Explorer export, checked against the report
they are drawn from, on a real transformers model, and opened in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode, urlparse

import pytest
import torch

import amprewrite
from amprewrite.capture.trace import captured_again, keep_captured
from amprewrite.show.explorer import graph_collection, node_data, write_model_explorer
from amprewrite.show.html import page_data, report_page
from amprewrite.show.views import graph_view, levels, module_rows, namespace
from amprewrite.testing import zoo

from .. import browser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama():
    """As explorer.prepare makes them: the graph before and the check's reference are the
    transform's own capture (one capture, not three)."""
    model, inputs = zoo.llama()
    with keep_captured():
        gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs)
        check = amprewrite.check_numerics(model, inputs, torch.bfloat16, gm=gm)
        before = captured_again(model, inputs)
    assert before is not None
    return model, inputs, before, gm, check


def test_levels_keep_indices_with_their_container():
    assert levels("") == []
    assert levels("model.layers.10.mlp.down_proj") == [
        "model", "model.layers.10", "model.layers.10.mlp", "model.layers.10.mlp.down_proj"]
    assert namespace("down.0.conv") == "down.0/conv"  # a root-level ModuleList
    assert namespace("0") == "0"


def test_summary_and_module_rows_add_up_to_the_report(llama):
    _, _, before, gm, check = llama
    rep = amprewrite.report(gm)
    data = page_data(before, gm, check=check)
    s = data["summary"]
    assert s["counts"] == rep.counts() and s["casts"] == len(rep.casts) > 0
    assert s["nodes"] == len(gm.graph.nodes)
    # The bytes a cast moves: its element count times the target dtype's size, from the graph.
    M = amprewrite.graph.meta
    casts = [n for n in gm.graph.nodes if M.CAST in n.meta]
    expected = sum(n.meta[M.ORIG].numel * n.meta[M.CAST].itemsize
                   for n in casts)
    assert s["cast_bytes"] == expected and s["cast_bytes_unknown"] == 0
    rows = module_rows(graph_view(gm))
    root = rows[0]
    ops = [d for d in rep.decisions if d.op.startswith("call_")]
    assert root.path == "" and root.ops == len(ops)
    assert root.low == sum(d.precision == "low" for d in ops)
    assert root.fp32 == sum(d.precision == "fp32" for d in ops)
    assert root.casts == sum(d.precision == "cast" for d in ops)
    by_path = {r.path: r for r in rows}
    # A LLaMA's layers are groups of their own, and each holds its 7 projections in low.
    for k in range(2):
        layer = by_path[f"model.layers.{k}"]
        assert layer.depth == 2 and layer.low >= 7
        assert layer.low == sum(r.low for r in rows if r.path.startswith(f"model.layers.{k}.")
                                and r.depth == 3) + sum(
            d.precision == "low" for d in ops if d.module_path == f"model.layers.{k}")
    # Regions are fp32 op nodes: the norms' variance computation is one of them.
    assert any("input_layernorm" in m for r in s["fp32_regions"] for m in r["modules"])
    assert s["check"]["output_error"] == pytest.approx(check.output_error)


def test_model_explorer_json_loads_with_the_packages_own_classes(llama, tmp_path):
    gb = pytest.importorskip("model_explorer.graph_builder")
    ndb = pytest.importorskip("model_explorer.node_data_builder")
    dacite = pytest.importorskip("dacite")
    _, _, before, gm, check = llama
    files = write_model_explorer(tmp_path, before, gm, check=check, label="LlamaForCausalLM")
    coll = dacite.from_dict(gb.GraphCollection, json.loads(files["amprewrite_graphs.json"]
                                                           .read_text()),
                            config=dacite.Config(strict=True))
    assert [g.id for g in coll.graphs] == ["before", "after"]
    after = coll.graphs[1]
    assert len(after.nodes) == len(gm.graph.nodes)
    by_id = {n.id: n for n in after.nodes}
    # Namespaces follow module paths; edges follow the graph's data flow.
    for node in gm.graph.nodes:
        me = by_id[node.name]
        assert me.namespace == namespace(node.meta.get(amprewrite.graph.meta.MODULE_PATH, ""))
        assert [e.sourceNodeId for e in me.incomingEdges] == [a.name for a in
                                                              node.all_input_nodes]
    assert {n.namespace for n in after.nodes} >= {"model/embed_tokens", "model/layers.0/mlp",
                                                  "model/layers.1/self_attn/q_proj", "lm_head"}
    decisions = {d.node: d for d in amprewrite.report(gm).decisions}
    q = next(n for n in after.nodes if n.namespace == "model/layers.0/self_attn/q_proj"
             and n.label == "linear")
    attrs = {kv.key: kv.value for kv in q.attrs}
    assert attrs["class"] == decisions[q.id].precision == "low"
    assert attrs["reason"] == decisions[q.id].reason
    for name in ("precision.json", "casts_bytes.json", "error_vs_fp32.json"):
        raw = json.loads(files[name].read_text())
        assert set(raw) == {"before", "after"}
        for graph_data in raw.values():
            # The precision overlay's values are class names: Model Explorer reads string values
            # as categories (GraphNodeData.showExpandedSummaryOnGroupNode's docstring) while the
            # Python dataclass hints numbers, so only that field is not type-checked there.
            loaded = dacite.from_dict(ndb.GraphNodeData, graph_data, config=dacite.Config(
                strict=True, check_types=name != "precision.json"))
            assert set(loaded.results) <= set(by_id)
            if name != "precision.json":
                assert all(isinstance(r.value, (int, float)) for r in loaded.results.values())
    precision = json.loads(files["precision.json"].read_text())["after"]["results"]
    assert {k: v["value"] for k, v in precision.items()} == {
        d.node: d.precision for d in decisions.values()}
    errors = json.loads(files["error_vs_fp32.json"].read_text())["after"]["results"]
    assert errors and all(v["value"] == pytest.approx(r.rel_err) for r in check.nodes
                          if r.rel_err is not None for v in [errors[r.node]])


def test_node_data_without_a_check_has_no_error_overlay(llama):
    _, _, before, gm, _ = llama
    assert set(node_data(before, gm)) == {"precision", "casts"}
    assert graph_collection(before, gm)["graphs"][0]["id"] == "before"


def _numbers(pg, selector: str, attr: str) -> dict[str, str]:
    return pg.eval_on_selector_all(
        selector, f"els => Object.fromEntries(els.map(e => [e.dataset.{attr}, e.textContent]))")


def test_html_report_in_chromium_matches_the_report(llama, tmp_path):
    _, _, before, gm, check = llama
    rep = amprewrite.report(gm)
    path = tmp_path / "index.html"
    path.write_text(report_page(before, gm, check=check, title="llama", report_text=str(rep)))
    with browser.page() as pg:
        pg.goto(path.as_uri())
        pg.wait_for_selector("body[data-ready='1']", timeout=30000)
        counts = _numbers(pg, "[data-count]", "count")
        assert {k: int(v) for k, v in counts.items()} == rep.counts()
        summary = _numbers(pg, "[data-summary]", "summary")
        assert int(summary["casts"]) == len(rep.casts)
        assert int(summary["rewrites"]) == sum(not r.action.startswith("cast")
                                               for r in rep.rewrites)
        assert float(summary["output-error"]) == pytest.approx(check.output_error, rel=1e-2)
        # The module table starts at depth 2 and opens to every module.
        shown = pg.eval_on_selector_all("#modules tr[data-module]", "rs => rs.map(r => "
                                        "r.dataset.module)")
        assert "model.layers.0" in shown and "model.layers.0.self_attn" not in shown
        pg.click("#modules [data-depth='99']")
        shown = pg.eval_on_selector_all("#modules tr[data-module]", "rs => rs.map(r => "
                                        "r.dataset.module)")
        assert "model.layers.1.self_attn.q_proj" in shown
        # The graph opens collapsed by module: fewer boxes than nodes, layers as groups.
        first = pg.evaluate("() => window.ampReport.visibleItems()")
        assert 0 < first < len(gm.graph.nodes) / 2
        assert pg.locator("svg g.gr[data-key]").count() >= 2
        # Search marks every matching node and lists them; clicking one opens its modules and
        # shows its details.
        pg.fill("#graph input[type=search]", "q_proj")
        pg.wait_for_function("() => document.querySelector('#graph .results').textContent"
                             ".includes('nodes match')")
        names = pg.eval_on_selector_all("#graph .results [data-node]",
                                        "ds => ds.map(d => d.dataset.node)")
        q_nodes = [d.node for d in rep.decisions if "q_proj" in d.module_path]
        assert set(q_nodes) <= set(names)
        pg.click(f"#graph .results [data-node='{q_nodes[0]}']")
        details = pg.inner_text("#graph .details")
        decision = next(d for d in rep.decisions if d.node == q_nodes[0])
        assert decision.node in details and decision.reason in details
        assert pg.locator("svg g.sel[data-key]").count() == 1
        assert pg.evaluate("() => window.ampReport.visibleItems()") > first
        # The before tab draws the captured graph.
        pg.click("[data-tab='before']")
        assert pg.locator("svg g[data-key]").count() > 0
        assert pg.amp_errors == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.status == 200, url
        return response.read().decode()


def _check_served(url: str, out: Path, n_after: int, cast_bytes: float) -> None:
    base = url.split("/?", 1)[0]
    assert _get(base + "/check_health") == "model_explorer_ok"
    assert "<html" in _get(base + "/").lower()  # the Model Explorer app itself
    data = json.loads(unquote(parse_qs(urlparse(url).query)["data"][0]))

    def served(path: str) -> dict:
        reply = json.loads(_get(base + "/api/v1/read_text_file?" + urlencode({"path": path})))
        assert "error" not in reply, reply
        return json.loads(reply["content"])

    (model,) = data["models"]
    assert Path(model["url"]) == out / "amprewrite_graphs.json"
    graphs = served(model["url"])
    assert [g["id"] for g in graphs["graphs"]] == ["before", "after"]
    assert len(graphs["graphs"][1]["nodes"]) == n_after
    assert [p["selectedGraphId"] for p in data["uiState"]["paneStates"]] == ["after", "before"]
    overlays = {Path(p).name: served(p) for p in data["nodeData"]}
    assert set(overlays) == {"precision.json", "casts_bytes.json", "error_vs_fp32.json"}
    casts = overlays["casts_bytes.json"]["after"]["results"]
    assert sum(r["value"] for r in casts.values()) == cast_bytes


def test_explore_serves_model_explorer_with_both_graphs_and_overlays(tmp_path):
    pytest.importorskip("model_explorer")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "amprewrite.cli", "explore", "amprewrite.testing.zoo:llama",
         "--port", str(port), "--host", "127.0.0.1", "--no-browser", "--out", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url, lines, deadline = None, [], time.monotonic() + 240
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"(http://127\.0\.0\.1:\d+/\?data=\S+)", line)
            url = found.group(1) if found else None
        assert url, "".join(lines)
        n_after = len(json.loads((tmp_path / "amprewrite_graphs.json").read_text())
                      ["graphs"][1]["nodes"])
        cast_bytes = sum(r["value"] for r in json.loads(
            (tmp_path / "casts_bytes.json").read_text())["after"]["results"].values())
        # What the server hands the page, checked over HTTP before the browser part (which
        # skips where no Chromium can start): the app, the two graphs and every overlay.
        _check_served(url, tmp_path, n_after, cast_bytes)
        with browser.page(1500, 950) as pg:
            pg.goto(url)
            pg.wait_for_function(
                "() => document.body.innerText.includes('relative error vs fp32')", timeout=90000)
            text = pg.inner_text("body")
            assert "LlamaForCausalLM" in text and f"{n_after} nodes" in text
            # Two panes, after on the left and before on the right, and the after pane's
            # aggregated stats sum the cast overlay to the bytes the report page shows.
            assert "LlamaForCausalLM | after" in text and "LlamaForCausalLM | before" in text
            assert text.index("| after") < text.index("| before")
            assert "precision" in text and "bytes cast" in text
            pg.wait_for_function(f"() => document.body.innerText.includes('{cast_bytes}')",
                                 timeout=30000)
            # The graph is drawn: the WebGL canvas is there and not blank.
            shot = pg.locator("canvas").first.screenshot()
            assert len(shot) > 5000
            assert pg.amp_errors == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_explore_without_the_extra_says_how_to_install(tmp_path):
    # A module named model_explorer that fails to import stands for the missing extra.
    (tmp_path / "model_explorer.py").write_text("raise ImportError('not installed')\n")
    done = subprocess.run([sys.executable, "-m", "amprewrite.cli", "explore",
                           "amprewrite.testing.zoo:llama"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2
    assert "pip install 'amprewrite[explorer]'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["unet2d_condition", "gpt2"])
def test_module_paths_are_the_models_own_module_names(name):
    # Dynamo names diffusers' submodules through the instance dict
    # (L['self'].__dict__['_modules']['time_proj']); the views, the report and keep_fp32
    # selectors need the plain path, "time_proj".
    model, inputs = getattr(zoo, name)()
    gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs, verify=False)
    names = dict(model.named_modules())
    paths = {n.meta.get(amprewrite.graph.meta.MODULE_PATH, "") for n in gm.graph.nodes} - {""}
    assert len(paths) > 20 and paths <= set(names), sorted(paths - set(names))[:5]
    top = {r.path for r in module_rows(graph_view(gm)) if r.depth == 1}
    assert top <= set(names) and "__dict__" not in "".join(top)


def test_explore_on_a_busy_port_says_so_before_any_work():
    pytest.importorskip("model_explorer")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "amprewrite.cli", "explore",
                               "amprewrite.testing.zoo:llama", "--host", "127.0.0.1", "--port",
                               str(port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr and "--port" in done.stderr
    assert "[2/3]" not in done.stderr  # refused before loading the model
