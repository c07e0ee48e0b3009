"""A one-line progress bar with ETA for the RL loop (stderr; one line per step when not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_seconds"]


def format_seconds(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:4.1f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


class ProgressBar:
    """``ProgressBar(total, start=k)``: `update(step, **fields)` after each step.

    The ETA extrapolates the mean time of the steps run by this process (steps restored from a
    checkpoint do not count), so it is honest right after a resume.
    """

    def __init__(self, total: int, *, start: int = 0, width: int = 24, stream: TextIO | None = None, enabled=True):
        self.total, self.start, self.width = total, start, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()

    def eta(self, step: int) -> float:
        done = step - self.start
        if done <= 0:
            return float("nan")
        return (time.perf_counter() - self.t0) / done * (self.total - step)

    def render(self, step: int, fields: dict[str, float]) -> str:
        frac = step / self.total if self.total else 1.0
        fill = int(round(frac * self.width))
        bar = "#" * fill + "-" * (self.width - fill)
        eta = self.eta(step)
        eta_s = "?" if eta != eta else format_seconds(eta)
        elapsed = format_seconds(time.perf_counter() - self.t0)
        extra = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        return f"[{bar}] {step}/{self.total} {elapsed} eta {eta_s} {extra}".rstrip()

    def update(self, step: int, **fields: float) -> None:
        if not self.enabled:
            return
        line = self.render(step, fields)
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if step >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
