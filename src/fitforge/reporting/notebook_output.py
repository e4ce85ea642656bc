"""A progress bar in a Jupyter notebook: one cell output per bar (shown with a ``display_id``), replaced in
place as it redraws, so that the saved notebook holds each bar's last text, not one output per redraw.
"""

from __future__ import annotations

from typing import Any


class CellLine:
    """One output of the running cell, a line of text that :meth:`show` replaces (a ``widget`` is shown
    until then); also the write-only ``file`` of tqdm's text bar."""

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
    """A tqdm bar drawn in a new :class:`CellLine`: tqdm's widget with ``ipywidgets``, else its text bar."""
    from tqdm import notebook as widgets  # imports quietly: IProgress is None without ipywidgets
    from tqdm.std import tqdm as text_bar

    if widgets.IProgress is not None:  # closed at the end (leave=False): the text takes its place
        bar = widgets.tqdm(**{**options, "leave": False}, display=False)
        return bar, CellLine(bar.container)
    cell = CellLine()
    return text_bar(**options, file=cell), cell
