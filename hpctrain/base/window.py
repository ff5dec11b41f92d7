"""Which steps a timeline records (`--trace WINDOW`): a range, the last N steps, or one step in N; each holds at
most a bounded number of steps, so a trace never grows with the run. Checked where the config is (a bad
window is refused at start-up with one line); recorded by `hpctrain.trace.spans`."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

MAX_STEPS = 1000  # most steps a window holds
EVERY_KEEP = 100  # every:N keeps the last this many sampled steps


@dataclass(frozen=True, slots=True)
class Window:
    """Which steps a trace records: `range` A..B, the `last` A steps, or `every` A-th step (the last `keep`)."""

    kind: str
    a: int
    b: int = 0

    @property
    def keep(self) -> int:
        """Most steps held at once."""
        return {"range": self.b - self.a + 1, "last": self.a, "every": EVERY_KEEP}[self.kind]

    def selects(self, step: int) -> bool:
        if self.kind == "range":
            return self.a <= step <= self.b
        return self.kind == "last" or step % self.a == 0

    def __str__(self) -> str:
        return f"{self.a}:{self.b}" if self.kind == "range" else f"{self.kind}:{self.a}"


def parse_window(spec: str) -> Window:
    """A --trace value: A:B (steps A to B), last:N (the run's last N steps) or every:N (one step in N)."""
    text = str(spec).strip()
    head, _, tail = text.partition(":")
    try:
        if head in ("last", "every"):
            n = int(tail)
            if n >= 1 and (head == "every" or n <= MAX_STEPS):
                return Window(head, n)
        else:
            a, b = int(head), int(tail)
            if 1 <= a <= b and b - a < MAX_STEPS:
                return Window("range", a, b)
    except ValueError:
        pass
    raise ConfigError(f"--trace {spec!r}: give a window of steps: A:B (steps A to B, 1 <= A <= B, at most {MAX_STEPS} "
                      f"steps, e.g. --trace 100:120), last:N (the last N <= {MAX_STEPS} steps of the run) or every:N "
                      f"(one step in N, the last {EVERY_KEEP} of them kept)")
