"""Render graphs as text: a node table, Graphviz dot coloured by precision, and SVG (when the
``dot`` program is installed). The HTML report is :mod:`amprewrite.show.html`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from torch import fx

from ..precision.report import NAME_CAPS, text_table
from .views import graph_view

__all__ = ["COLORS", "Rendered", "SvgRender", "color", "node_table", "to_dot", "to_svg"]

COLORS = {
    "low": "#9ecae1",  # blue: runs in bf16/fp16
    "fp32": "#fdae6b",  # orange: kept in fp32
    "cast": "#bdbdbd",  # grey: a cast amprewrite inserted
    "rewritten": "#a1d99b",  # green: made by a pass of kind REWRITE (passes.rewrite_passes)
    "promote": "#fff5eb",
    "neutral": "#f2f2f2",
}


def color(precision: str, rewritten: bool = False) -> str:
    """The fill colour of a node of class ``precision``; white for inputs, params, non-float."""
    if rewritten and precision != "cast":
        return COLORS["rewritten"]
    return COLORS.get(precision, "#ffffff")


def node_table(gm: fx.GraphModule, rewritten: set[str] = frozenset()) -> str:
    """One aligned text row per node: name, op, target, module, family, class, dtype, reason.

    Columns are as wide as their longest entry (names, module paths and families up to
    :data:`~amprewrite.precision.report.NAME_CAPS`; a longer one pushes the rest of its row right),
    so every name is whole (grep finds it); a column empty in every row (family, class and
    reason of a graph before the passes) is left out.
    """
    cols = ["name", "op", "target", "module", "family", "precision", "dtype", "reason"]
    head = [*cols[:5], "class", "dtype", "reason"]
    view = graph_view(gm, rewritten)
    rows = [[str(getattr(v, "dtypes" if c == "dtype" else c) or "") for c in cols]
            for v in view.nodes]
    keep = [i for i in range(len(cols)) if i == 0 or any(r[i] for r in rows)]
    caps = {0: NAME_CAPS[0], 3: NAME_CAPS[1], 4: NAME_CAPS[2]}  # name, module, family
    return text_table([[head[i] for i in keep]] + [[r[i] or "-" for i in keep] for r in rows],
                      caps=[caps.get(i) for i in keep])


def to_dot(gm: fx.GraphModule, title: str, rewritten: set[str] = frozenset()) -> str:
    """Graphviz source: data-flow edges, nodes filled by precision class."""
    lines = [f'digraph "{title}" {{', "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             f'  label="{title}"; labelloc=t;']
    view = graph_view(gm, rewritten)
    for v in view.nodes:
        text = f"{v.name}\\n{v.target}" + (f"\\n{v.dtypes}" if v.dtype else "")
        lines.append(f'  "{v.name}" [label="{_esc(text)}", '
                     f'fillcolor="{color(v.precision, v.rewritten)}"];')
    for v in view.nodes:
        for a in v.inputs:
            lines.append(f'  "{a}" -> "{v.name}";')
    lines.append("}")
    return "\n".join(lines)


def _esc(s: str) -> str:
    return s.replace('"', '\\"')


@dataclass
class Rendered:
    """What happened to one render: ``svg`` when it worked, else ``problem`` says why not."""

    name: str
    nodes: int
    svg: str | None = None
    problem: str | None = None


class SvgRender:
    """Graphviz ``dot -Tsvg`` runs started at once, side by side, in the background, finished
    (or stopped) by :meth:`wait` under one overall ``timeout``.

    >>> job = SvgRender({"g.svg": ('digraph { a -> b }', 2)}, timeout=30, dot="/no/such/dot")
    >>> job.wait()[0].problem
    "Graphviz 'dot' is not installed (/no/such/dot not found); install graphviz for SVG"
    """

    def __init__(self, sources: dict[str, tuple[str, int]], timeout: float = 120,
                 dot: str | None = None):
        self.timeout = timeout
        self.started = time.monotonic()
        self.results = {name: Rendered(name, nodes) for name, (_, nodes) in sources.items()}
        self._procs: dict[str, subprocess.Popen] = {}
        self._out: dict[str, list[str]] = {}
        self._threads: list[threading.Thread] = []
        exe = dot or shutil.which("dot")
        missing = (f"Graphviz 'dot' is not installed ({dot} not found); install graphviz for SVG"
                   if dot else "Graphviz 'dot' is not installed (not on PATH); install graphviz "
                   "for SVG (apt-get install graphviz, brew install graphviz)")
        for name, (source, _) in sources.items():
            try:
                proc = subprocess.Popen([exe or "dot", "-Tsvg"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=os.name == "posix")
            except FileNotFoundError:
                self.results[name].problem = missing
                continue
            except OSError as exc:
                self.results[name].problem = f"dot could not be started: {exc}"
                continue
            self._procs[name] = proc
            # communicate() in a thread: it feeds stdin and drains both pipes, so a large graph
            # cannot block on a full pipe while the caller writes other files.
            out: list[str] = []
            self._out[name] = out
            thread = threading.Thread(target=lambda p=proc, s=source, o=out: o.extend(
                _communicate(p, s)), daemon=True)
            thread.start()
            self._threads.append(thread)

    def pending(self) -> list[str]:
        """The renders still running."""
        return [n for n, p in self._procs.items() if p.poll() is None]

    def wait(self, on_wait=None) -> list[Rendered]:
        """Wait for every render until the overall timeout, then stop those still running.
        ``on_wait(pending names, seconds waited)`` is called about once a second."""
        deadline = self.started + self.timeout
        while self.pending() and time.monotonic() < deadline:
            if on_wait is not None:
                on_wait(self.pending(), time.monotonic() - self.started)
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        for name, proc in self._procs.items():
            result = self.results[name]
            if proc.poll() is None:
                _kill(proc)
                result.problem = (f"dot timed out after {self.timeout:g} s on a graph of "
                                  f"{result.nodes} nodes; raise --render-timeout")
        for thread in self._threads:
            thread.join(timeout=5)
        for name, proc in self._procs.items():
            result = self.results[name]
            if result.problem is not None:
                continue
            stdout, stderr = (self._out[name] + ["", ""])[:2]
            if proc.returncode != 0 or "<svg" not in stdout:
                lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
                said = "; ".join(lines[:3]) or "no message"
                result.problem = f"dot failed (exit status {proc.returncode}): {said}"
            else:
                result.svg = stdout[stdout.find("<svg"):]
        return list(self.results.values())

    def stop(self) -> None:
        """Kill the renders still running (Ctrl-C)."""
        for proc in self._procs.values():
            if proc.poll() is None:
                _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """Kill a render and whatever it started: a ``dot`` that is a wrapper script leaves a child
    holding the output pipes open, and reading them would wait for that child."""
    if os.name == "posix":
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the render's
        except ProcessLookupError:
            pass
    else:
        proc.kill()
    proc.wait()


def _communicate(proc: subprocess.Popen, source: str) -> tuple[str, str]:
    try:
        return proc.communicate(source)
    except (OSError, ValueError):  # killed at the deadline while writing
        return "", ""


def to_svg(dot_source: str, timeout: float = 120) -> str | None:
    """SVG rendered by Graphviz's ``dot``, or None when it is not installed, fails or runs past
    ``timeout`` seconds (:class:`SvgRender` says which)."""
    return SvgRender({"graph.svg": (dot_source, 0)}, timeout).wait()[0].svg
