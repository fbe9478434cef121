"""How long the HTML report takes to open in headless Chromium, by graph size; and the
screenshots in docs/img/.

    python -m benchmarks.report_page [--layers 2 14 57] [--rounds 3] [--screenshots]

For a transformers LLaMA (the zoo's small config with ``--layers`` decoder layers; 57 layers give
a graph of about 5,000 nodes) this writes ``amprewrite dump``'s ``index.html`` and times, in one
headless Chromium, from navigation to the page's ready mark (the data parsed, the summary, the
module table and the collapsed graph drawn), then "expand all" (every node laid out and drawn)
and a search. Medians of ``--rounds`` fresh pages. Writes docs/benchmarks/report_page.{json,csv}.

``--screenshots`` also renders docs/img/report_*.png (the demo model and the LLaMA) and, when
the explorer extra is installed, docs/img/explorer_llama.png from ``amprewrite explore``.
Needs Debian's ``chromium`` and ``pip install playwright``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import amprewrite
from amprewrite.capture.trace import capture
from amprewrite.show.html import report_page

from .common import save, table

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--use-gl=swiftshader", "--enable-unsafe-swiftshader"]


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(0, 256, (2, 64)),)


def _page(model, inputs, title: str, check: bool, **options) -> tuple[str, int]:
    gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=inputs, verify=False,
                              **options)
    result = amprewrite.check_numerics(model, inputs, torch.bfloat16, gm=gm) if check else None
    page = report_page(capture(model, inputs).gm, gm, check=result, title=title,
                       report_text=str(amprewrite.report(gm)))
    return page, len(gm.graph.nodes)


def _browser(p):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        sys.exit("no chromium: apt-get install chromium")
    return p.chromium.launch(executable_path=exe, args=ARGS)


def _time_page(browser, path: Path, rounds: int) -> dict[str, float]:
    opened, expanded, searched = [], [], []
    for _ in range(rounds):
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        start = time.perf_counter()
        pg.goto(path.as_uri())
        pg.wait_for_selector("body[data-ready='1']", timeout=300_000)
        opened.append(time.perf_counter() - start)
        start = time.perf_counter()
        pg.click("[data-act=expand]")
        pg.evaluate("() => new Promise(r => requestAnimationFrame(() => r()))")
        expanded.append(time.perf_counter() - start)
        items = pg.evaluate("() => window.ampReport.visibleItems()")
        start = time.perf_counter()
        pg.fill("#graph input[type=search]", "softmax")
        pg.wait_for_function("() => document.querySelector('#graph .results').textContent"
                             ".includes('nodes match')")
        searched.append(time.perf_counter() - start - 0.15)  # the search waits 150 ms for typing
        pg.close()
    return {"open_s": statistics.median(opened), "expand_all_s": statistics.median(expanded),
            "expanded_items": items, "search_s": max(statistics.median(searched), 0.0)}


def _screenshots(p) -> None:
    from amprewrite.demo import demo_model

    IMG.mkdir(parents=True, exist_ok=True)
    browser = _browser(p)
    with tempfile.TemporaryDirectory() as tmp:
        model, inputs = demo_model()
        path = Path(tmp) / "demo.html"
        # As `amprewrite demo --out` writes it: the exact upsample rewrite shown.
        path.write_text(_page(model, inputs, "amprewrite: DemoNet", True, upsample="always")[0])
        pg = browser.new_page(viewport={"width": 1400, "height": 1100})
        pg.goto(path.as_uri())
        pg.wait_for_selector("body[data-ready='1']")
        pg.screenshot(path=str(IMG / "report_demo.png"))
        from amprewrite.testing import zoo

        model, inputs = zoo.llama()
        path = Path(tmp) / "llama.html"
        path.write_text(_page(model, inputs, "amprewrite: LlamaForCausalLM (transformers)",
                              True)[0])
        pg = browser.new_page(viewport={"width": 1400, "height": 1100})
        pg.goto(path.as_uri())
        pg.wait_for_selector("body[data-ready='1']")
        pg.screenshot(path=str(IMG / "report_llama_summary.png"))
        pg.click("#modules [data-depth='3']")
        pg.locator("#modules").screenshot(path=str(IMG / "report_llama_modules.png"))
        pg.fill("#graph input[type=search]", "q_proj")
        pg.wait_for_function("() => document.querySelector('#graph .results').textContent"
                             ".includes('nodes match')")
        pg.click("#graph .results [data-node]")
        pg.locator("#graph").screenshot(path=str(IMG / "report_llama_graph.png"))
    browser.close()
    try:
        import model_explorer  # noqa: F401
    except ImportError:
        print("explorer extra not installed: no Model Explorer screenshot")
        return
    _explorer_screenshot(p)


def _explorer_screenshot(p) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "amprewrite.cli", "explore", "amprewrite.testing.zoo:llama",
             "--host", "127.0.0.1", "--port", str(port), "--no-browser", "--out", tmp],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            url = None
            for line in proc.stdout:
                found = re.search(r"(http://127\.0\.0\.1:\d+/\?data=\S+)", line)
                if found:
                    url = found.group(1)
                    break
            browser = _browser(p)
            pg = browser.new_page(viewport={"width": 1500, "height": 950})
            pg.goto(url)
            pg.wait_for_function(
                "() => document.body.innerText.includes('relative error vs fp32')",
                timeout=120_000)
            pg.wait_for_timeout(3000)
            pg.screenshot(path=str(IMG / "explorer_llama.png"))
            browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 14, 57])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--screenshots", action="store_true")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
        browser = _browser(p)
        for layers in args.layers:
            page, nodes = _page(*_llama(layers), f"LLaMA, {layers} layers", False)
            path = Path(tmp) / f"llama{layers}.html"
            path.write_text(page)
            row = {"model": f"LlamaForCausalLM, {layers} layers", "nodes": nodes,
                   "page_mb": round(len(page.encode()) / 2**20, 2),
                   **_time_page(browser, path, args.rounds)}
            rows.append(row)
            print(table([row], list(row)), flush=True)
        browser.close()
        if args.screenshots:
            _screenshots(p)
    print(table(rows, list(rows[0])))
    save("report_page", rows, {"rounds": args.rounds})


if __name__ == "__main__":
    main()
