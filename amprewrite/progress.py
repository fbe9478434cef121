"""Progress on the steps a user waits on: a live line on stderr (rich) while a terminal is
attached, plain log lines or nothing otherwise.

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
import time
from collections.abc import Iterator

__all__ = ["Steps", "detail", "on_terminal", "status", "transform_progress"]

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
            one plain line ``amprewrite: [k/N] message`` instead, for CI logs.
        label: what the unnumbered line starts with.
    """

    def __init__(self, total: int | None, *, show: bool | None = None, log: bool = False,
                 label: str = "amprewrite"):
        self.total, self.label, self.count = total, label, 0
        self.show = on_terminal() if show is None else show
        self.log = log and not self.show
        self.message, self._status = "", ""
        self._live = self._task = None
        self._token: contextvars.Token | None = None
        self.start = time.perf_counter()

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
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
        if self._live is not None:
            self._live.stop()

    def _prefix(self) -> str:
        return f"[{self.count}/{self.total}] " if self.total else ""

    def _draw(self, advance: float = 0) -> None:
        if self._live is not None:
            text = self.message + (f": {self._status}" if self._status else "")
            self._live.update(self._task, description=self._prefix() + _escape(text),
                              advance=advance, detail="", refresh=True)  # every stage is seen

    def step(self, message: str) -> None:
        """Start the next step."""
        self.count += 1
        self.message, self._status = message, ""
        self._draw(advance=1 if self.count > 1 else 0)
        if self.log:
            self._line(message)

    def status(self, text: str, log: bool = False) -> None:
        """Say where the current step is (``round 3: 2 nodes kept``)."""
        self._status = text
        self._draw()
        if self.log and log:
            self._line(f"{self.message}: {text}" if self.message else text)

    def detail(self, text: str) -> None:
        """A short, frequently replaced note after the elapsed time (the pass running)."""
        if self._live is not None:
            self._live.update(self._task, detail=_escape(text))

    def _line(self, text: str) -> None:
        sys.stderr.write(f"amprewrite: {self._prefix()}{text}\n")
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
    line then shows the transform's stages), else a live line of its own when ``show`` (``None``:
    when stderr is a terminal), else none."""
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
    with Steps(None, show=True, label=label) as steps:
        steps.step(label)
        yield
