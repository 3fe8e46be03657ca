"""Progress for people: a live bar on a terminal, plain periodic lines in logs and CI."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Shows step, loss, samples/s and ETA. Only rank 0 creates one."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, lines: int = 10) -> None:
        self.stream = stream or sys.stderr
        self.total, self.start = total, start
        self._bar = None
        if self.stream.isatty():
            self._bar = tqdm(total=total, initial=start, file=self.stream, unit="step", dynamic_ncols=True)
        self._every = max(1, (total - start) // lines)
        self._t0 = time.perf_counter()
        self._last_line = start

    def update(self, step: int, loss: float, samples_per_s: float, extra: str = "") -> None:
        """``extra``: a short live note (the stragglers flagged now), shown after the figures."""
        if self._bar is not None:
            self._bar.n = step
            postfix = {"loss": f"{loss:.4f}", "samples_s": f"{samples_per_s:,.0f}"}
            if extra:
                postfix["note"] = extra
            self._bar.set_postfix(postfix, refresh=True)
            return
        if step - self._last_line >= self._every or step == self.total:
            self._last_line = step
            done = step - self.start
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / done * (self.total - step) if done else 0.0
            note = f"  {extra}" if extra else ""
            print(f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s  ETA {eta:.0f}s{note}",
                  file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line of its own (a failure, a restart), above the bar on a terminal."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
