"""Progress on the steps a user waits on: a live line on stderr (rich) while a terminal is
attached, plain log lines or nothing otherwise. Plain lines carry no terminal codes, and a
step that runs long says so every :data:`HEARTBEAT` seconds (a CI log never goes quiet for
half a minute while a large model is captured).

One reporter is active at a time (a context variable). Library code reports into whichever is
active with :func:`status` and :func:`detail`, and says nothing when none is: the CLI opens a
numbered :class:`Steps` for a command, ``amprewrite.transform(progress=...)`` opens one for
itself unless a caller already has one open.

>>> with Steps(2, show=False) as steps:
...     steps.step("capturing")
...     status("round 1")
...     steps.step("writing files")
>>> status("no reporter is active: nothing happens")
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections.abc import Iterator

__all__ = ["Steps", "detail", "on_terminal", "status", "transform_progress"]

# Seconds without a plain line after which a logging reporter writes where it is.
HEARTBEAT = 10.0

_ACTIVE: contextvars.ContextVar[Steps | None] = contextvars.ContextVar("amp_progress",
                                                                       default=None)


def on_terminal() -> bool:
    """Whether stderr is a terminal, where a live progress line can be redrawn."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class Steps:
    """Numbered steps ``[k/N] message`` with a spinner, a bar and the elapsed time.

    Args:
        total: the number of steps (``None``: unnumbered, a spinner only).
        show: draw the live line; ``None`` (default) draws it when stderr is a terminal.
        log: when not drawing, write each step (and each :func:`status` given ``log=True``) as
            one plain line ``amprewrite: [k/N] message`` instead, for CI logs; a step silent
            for ``heartbeat`` seconds gets a line with its status and the time so far.
        label: what the unnumbered line starts with, and each plain line.
        log_status: when logging, write every new status as a line too (``transform``'s own
            reporter, whose statuses are its stages).
        heartbeat: seconds of silence before a logging reporter writes where it is.
    """

    def __init__(self, total: int | None, *, show: bool | None = None, log: bool = False,
                 label: str = "amprewrite", log_status: bool = False,
                 heartbeat: float | None = None):
        self.total, self.label, self.count = total, label, 0
        self.show = on_terminal() if show is None else show
        self.log = log and not self.show
        self.log_status = log_status
        self.heartbeat = HEARTBEAT if heartbeat is None else heartbeat
        self.message, self._status = "", ""
        self._live = self._task = None
        self._token: contextvars.Token | None = None
        self.start = time.perf_counter()
        self._last_line = self._step_start = self.start
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> Steps:
        if self.show:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total:
                columns.append(BarColumn(bar_width=20))
            columns += [TimeElapsedColumn(), TextColumn("[dim]{task.fields[detail]}")]
            # force_terminal: show=True draws even where rich would not detect a terminal.
            console = Console(file=sys.stderr, force_terminal=True)
            self._live = Progress(*columns, console=console, transient=True,
                                  refresh_per_second=8)
            self._task = self._live.add_task(self.label, total=self.total, detail="")
            self._live.start()
        elif self.log:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                          name="amprewrite-progress")
            self._beat.start()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
        self._done.set()
        if self._beat is not None:
            self._beat.join()
        if self._live is not None:
            self._live.stop()

    def _heartbeat(self) -> None:
        """While logging: after ``heartbeat`` seconds without a line, say where the step is."""
        while not self._done.wait(min(1.0, self.heartbeat / 4)):
            now = time.perf_counter()
            with self._lock:
                quiet = now - self._last_line >= self.heartbeat and self.count > 0
                text = self._where(self._status)
            if quiet:
                self._line(f"{text} (still running, {now - self._step_start:.0f} s)")

    def _prefix(self) -> str:
        return f"[{self.count}/{self.total}] " if self.total else ""

    def _draw(self, advance: float = 0) -> None:
        if self._live is not None:
            text = self.message + (f": {self._status}" if self._status else "")
            self._live.update(self._task, description=self._prefix() + _escape(text),
                              advance=advance, detail="", refresh=True)  # every stage is seen

    def step(self, message: str) -> None:
        """Start the next step."""
        with self._lock:
            self.count += 1
            self.message, self._status = message, ""
            self._step_start = time.perf_counter()
        self._draw(advance=1 if self.count > 1 else 0)
        if self.log:
            self._line(message)

    def status(self, text: str, log: bool = False) -> None:
        """Say where the current step is (``round 3: 2 nodes kept``)."""
        with self._lock:
            new = text != self._status
            self._status = text
        self._draw()
        if self.log and (log or (self.log_status and new)):
            self._line(self._where(text))

    def detail(self, text: str) -> None:
        """A short, frequently replaced note after the elapsed time (the pass running)."""
        if self._live is not None:
            self._live.update(self._task, detail=_escape(text))

    def _where(self, status: str) -> str:
        """The step and its status, for a plain line; an unnumbered reporter's statuses are
        its stages, so they stand alone."""
        if not status:
            return self.message
        if not self.message or self.total is None:
            return status
        return f"{self.message}: {status}"

    def _line(self, text: str) -> None:
        with self._lock:
            self._last_line = time.perf_counter()
            sys.stderr.write(f"{self.label}: {self._prefix()}{text}\n")
            sys.stderr.flush()


def _escape(text: str) -> str:
    return text.replace("[", "\\[")  # rich markup


def status(text: str, log: bool = False) -> None:
    """Report ``text`` as the state of the active reporter's step; nothing when none is active."""
    active = _ACTIVE.get()
    if active is not None:
        active.status(text, log)


def detail(text: str) -> None:
    """Report a short detail (the pass running) to the active reporter, if any."""
    active = _ACTIVE.get()
    if active is not None:
        active.detail(text)


@contextlib.contextmanager
def transform_progress(show: bool | None, label: str = "amprewrite.transform"
                       ) -> Iterator[None]:
    """The reporter of one ``transform`` call: the caller's when one is active (the CLI's step
    line then shows the transform's stages), else one of its own when ``show`` (``None``: when
    stderr is a terminal): a live line on a terminal, plain lines (one per stage) elsewhere;
    else none."""
    if show is False:  # quiet even inside a caller's reporter
        token = _ACTIVE.set(None)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
        return
    if _ACTIVE.get() is not None or not (show or on_terminal()):
        yield
        return
    with Steps(None, log=True, log_status=True, label=label) as steps:
        steps.step(label if steps.show else "started")
        yield


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = 40) -> Iterator[None]:
    """Raise the named loggers to ``level`` (default ``logging.ERROR``) for the block: torch's
    and torchao's internal log lines are noise in a user's transform (dynamo's shape warnings,
    torch.onnx's list of skipped ops, torchao's unloadable CUDA extensions on a CPU)."""
    import logging

    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, levels):
            lg.setLevel(old)
