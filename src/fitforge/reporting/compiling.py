"""What ``torch.compile`` did during a fit of a compiled net: the graphs it compiled and the graph breaks, from
Dynamo's own counters read on the host at the fit's start and end; one warning each when they cost (graph breaks
run part of the net eagerly; many graphs mean recompiling)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from fitforge.core.clock import compiled

log = logging.getLogger("fitforge")
RECOMPILES = 4  # more graphs than this in one fit is recompiling (a training and an evaluation graph are normal)


class CompileWatch:
    """Dynamo's counters at a fit's start (nothing when ``net`` is not compiled); :meth:`report` at its end."""

    def __init__(self, net: Any) -> None:
        self.active = compiled(net)
        self.graphs, self.breaks = _counted() if self.active else (0, Counter())

    def report(self) -> None:
        """Log the fit's graphs and graph breaks; a warning for graph breaks, and one for many graphs."""
        if not self.active:
            return
        graphs, breaks = _counted()
        graphs -= self.graphs
        breaks.subtract(self.breaks)
        broken = +breaks  # those of this fit
        log.info("torch.compile: %d graph(s) compiled in this fit, %d graph break(s)", graphs, sum(broken.values()))
        if broken:
            reason, count = broken.most_common(1)[0]
            log.warning(
                "torch.compile: %d graph break(s) in this fit: the net runs partly eagerly between its graphs; the "
                "most frequent (%d): %s",
                sum(broken.values()),
                count,
                _reason(reason),
            )
        if graphs > RECOMPILES:
            log.warning(
                "torch.compile: %d graphs compiled in this fit: the net was compiled again for new input shapes or "
                "dtypes (a smaller last batch, sequences of other lengths); give batches one shape (drop_last=True, "
                "padding to a fixed length) or compile dynamic shapes (compile={'dynamic': True})",
                graphs,
            )


def _reason(text: str) -> str:
    """A graph break's reason in one line: Dynamo's title, and its explanation where it gives one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    explained = next(
        (line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")), ""
    )
    return (lines[0] + (f": {explained}" if explained else ""))[:300] if lines else "(no reason given)"


def _counted() -> tuple[int, Counter]:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), Counter(counters["graph_break"])
