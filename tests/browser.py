"""Headless Chromium for the report tests (Debian's ``chromium`` driven by Playwright).

Without a browser the tests that need one skip (local runs), unless
``AMPREWRITE_REQUIRE_BROWSER=1`` makes a missing browser a failure. ``.ci/run`` sets it always,
and stops before the tests when it cannot install Chromium. A test should check what it can
without a browser (files written, pages served) before it asks for one, so that a skip never
hides those checks.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM = os.environ.get("AMPREWRITE_CHROMIUM") or shutil.which("chromium") or shutil.which(
    "chromium-browser")
# What a closed network needs: no background requests, no component updates, no sandbox as root.
ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--use-gl=swiftshader", "--enable-unsafe-swiftshader"]


def _missing(what: str) -> None:
    message = (f"{what}; install Debian's chromium (apt-get install chromium) and "
               "`pip install playwright`")
    if os.environ.get("AMPREWRITE_REQUIRE_BROWSER") == "1":
        pytest.fail(message + " (AMPREWRITE_REQUIRE_BROWSER=1)")
    pytest.skip(message)


@contextlib.contextmanager
def page(width: int = 1400, height: int = 1000):
    """A fresh page; page errors are collected in ``page.amp_errors``."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed")
    if CHROMIUM is None:
        _missing("no chromium executable")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            pg = browser.new_page(viewport={"width": width, "height": height})
            pg.amp_errors = []
            pg.on("pageerror", lambda e: pg.amp_errors.append(str(e)))
            yield pg
        finally:
            browser.close()
