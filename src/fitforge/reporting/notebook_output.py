"""A progress bar in a Jupyter notebook: one cell output per bar, replaced in place as it redraws.

An output shown with a ``display_id`` is replaced when updated, by frontends (JupyterLab, VS Code,
Colab...) and headless runners (nbclient, papermill, ``nbconvert --execute``) alike, so the saved
notebook holds each bar's last text (or nothing, where the epoch's log line took its place). A text
bar on stderr would store one output per redraw, and tqdm's widget a view GitHub shows frozen at 0%;
so the widget (with ``ipywidgets``) shows only while the epoch runs, and text once it ends.
"""

from __future__ import annotations

from typing import Any


class CellLine:
    """One output of the running cell, a line of text that :meth:`show` replaces (a ``widget``, tqdm's
    bar, is shown until then). Also a write-only stream, the ``file`` of tqdm's text bar: what follows
    a write's last carriage return (the line a terminal would show) becomes the output's text.
    """

    encoding = "utf-8"  # tqdm draws its bar with block characters on a stream that takes them

    def __init__(self, widget: Any = None) -> None:
        from IPython.display import display

        self._text: str | None = None if widget is not None else ""
        shown = widget if widget is not None else {"text/plain": ""}
        self._handle = display(shown, raw=widget is None, display_id=True)

    def show(self, text: str) -> None:
        """Replace the output with ``text`` (``""`` leaves it empty); an unchanged text sends nothing."""
        if text != self._text:
            self._text = text
            self._handle.update({"text/plain": text}, raw=True)

    def write(self, text: str) -> int:
        if "\r" in text:  # tqdm redraws as "\r" + the line (+ spaces over a longer one); "\n" ends it
            self.show(text.rsplit("\r", 1)[1].rstrip())
        return len(text)

    def flush(self) -> None:
        pass


def notebook_bar(**options: Any) -> tuple[Any, CellLine]:
    """A tqdm bar (``options`` are tqdm's) drawn in a new :class:`CellLine`: tqdm's widget when
    ``ipywidgets`` is installed, else its text bar (and never tqdm's "IProgress not found" warning)."""
    from tqdm import notebook as widgets  # imports quietly: IProgress is None without ipywidgets
    from tqdm.std import tqdm as text_bar

    if widgets.IProgress is not None:  # closed at the end (leave=False): the text takes its place
        bar = widgets.tqdm(**{**options, "leave": False}, display=False)
        return bar, CellLine(bar.container)
    cell = CellLine()
    return text_bar(**options, file=cell), cell
