"""What trainers report of their per-source losses (LOSS_REPORT), gathered by the planner: pure, no I/O.

Each report is one rank's sums over a range of steps: per source, the sum of its tokens' losses and how many
tokens had a label. The planner keeps the totals since it started (``mean``) and each rank's latest report
(``recent``: the mean over the newest report of every rank, what the metrics and STATUS show beside the realised
weights)."""

from __future__ import annotations

import numpy as np

from mixplane.protocol import LossReport


class SourceLosses:
    def __init__(self, n_sources: int) -> None:
        self.n = n_sources
        self.loss_sum = np.zeros(n_sources, np.float64)
        self.tokens = np.zeros(n_sources, np.int64)
        self.reports = 0
        self.through = -1  # the newest step any report covered
        self.latest: dict[int, LossReport] = {}  # rank -> its newest report

    def add(self, r: LossReport) -> None:
        if len(r.loss) != self.n:
            raise ValueError(f"a loss report for {len(r.loss)} sources, the mixture has {self.n}")
        self.loss_sum += np.asarray(r.loss, np.float64)
        self.tokens += np.asarray(r.tokens, np.int64)
        self.reports += 1
        self.through = max(self.through, r.step)
        old = self.latest.get(r.rank)
        if old is None or r.step >= old.step:
            self.latest[r.rank] = r

    @staticmethod
    def _means(loss: np.ndarray, tokens: np.ndarray) -> list[float | None]:
        return [float(s / t) if t else None for s, t in zip(loss.tolist(), tokens.tolist())]

    def mean(self) -> list[float | None]:
        """Mean token loss per source over every report (None: no token of it reported)."""
        return self._means(self.loss_sum, self.tokens)

    def recent(self) -> list[float | None]:
        """Mean token loss per source over the newest report of each rank."""
        loss = np.zeros(self.n, np.float64)
        tokens = np.zeros(self.n, np.int64)
        for r in self.latest.values():
            loss += np.asarray(r.loss, np.float64)
            tokens += np.asarray(r.tokens, np.int64)
        return self._means(loss, tokens)

    def rank_through(self) -> dict[int, int]:
        """Each reporting rank's newest reported step."""
        return {rank: r.step for rank, r in sorted(self.latest.items())}

    def status(self) -> dict[str, object]:
        return {"reports": self.reports, "through": self.through, "tokens": self.tokens.tolist(),
                "loss_sum": self.loss_sum.tolist(), "mean": self.mean(), "recent": self.recent(),
                "ranks": {str(k): v for k, v in self.rank_through().items()}}
