"""Medians with min–max, and ratios to a baseline measured in the same run."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Summary:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        return cls(statistics.median(values), min(values), max(values), len(values))

    @classmethod
    def paired(cls, values: list[float], base: list[float], higher_is_better: bool = True) -> Summary:
        """Ratios to ``base`` round by round (the two measured back to back, so a slower spell of a
        shared machine falls on both); above 1, ``values`` is better (for times: ``base``'s over these)."""
        return cls.of([(v / b) if higher_is_better else (b / v) for v, b in zip(values, base, strict=True)])

    def ratio_to(self, base: Summary, higher_is_better: bool = True) -> Summary:
        """The ratio of medians, with a range from the extremes of both runs."""
        if higher_is_better:
            return Summary(self.median / base.median, self.min / base.max, self.max / base.min, self.n)
        return Summary(base.median / self.median, base.min / self.max, base.max / self.min, self.n)

    def dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.min:.2f}–{self.max:.2f})"


def summarize_keys(runs: list[dict]) -> dict:
    """Runs that each give the same keys → each key's ``Summary.dict()`` over the runs."""
    return {key: Summary.of([run[key] for run in runs]).dict() for key in runs[0]}


def fmt(s: dict, digits: int = 1) -> str:
    """A ``Summary.dict()`` as the results tables print it: "median (min–max)"."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"
