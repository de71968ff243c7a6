"""Progress of a run: a tqdm bar with loss and samples/s when stderr is a terminal, else a log
line every ``log_every`` steps. Only rank 0 shows anything."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

logger = logging.getLogger("dynemb.train")


class Progress:
    """Shows training progress.

    Args:
        total: the last step of the run.
        enabled: whether this process shows anything (rank 0).
        interactive: a bar (True) or log lines (False); default: whether stderr is a terminal.
    """

    def __init__(self, total: int, *, enabled: bool = True,
                 interactive: bool | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar = None
        if enabled and self.interactive:
            self.bar = tqdm(total=total, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def advance_to(self, step: int) -> None:
        """Moves the bar to ``step`` (a resumed run)."""
        if self.bar is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def step(self) -> None:
        """One step done."""
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, loss: float, samples_per_s: float) -> None:
        """The mean training loss of the steps since the last report, and the throughput."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:,.0f}")
        else:
            logger.info("step %*d/%d  loss %.4f  %s samples/s", len(str(self.total)), step,
                        self.total, loss, f"{samples_per_s:,.0f}")

    def note(self, text: str) -> None:
        """A message that does not break the bar (evaluations, checkpoints)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            logger.info("%s", text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
