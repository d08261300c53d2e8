"""A cost model of one's own (docs/integration.md, "Extending"): a phase's cost per item read off measured
points instead of counted FLOPs, for a phase whose FLOPs misjudge its time.

Give it to the phase it models (``BackbonePhase("text", MeasuredCost(...), ...)``); tests/balance/test_cost.py plans a
step with it.
"""
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np


@dataclass(frozen=True)
class MeasuredCost:
    """Seconds per item, interpolated linearly between measured (tokens, seconds) points (beyond the last
    point: extrapolated from the last two); no activation memory counted."""

    tokens: Tuple[int, ...]
    seconds: Tuple[float, ...]

    def __post_init__(self):
        increasing = list(self.tokens) == sorted(set(self.tokens))
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds) or not increasing:
            raise ValueError("MeasuredCost needs two or more points, tokens strictly increasing, one time each")

    def item_cost(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.float64)
        (t0, t1), (s0, s1) = self.tokens[-2:], self.seconds[-2:]
        beyond = s1 + (tokens - t1) * (s1 - s0) / (t1 - t0)
        return np.where(tokens > t1, beyond, np.interp(tokens, self.tokens, self.seconds))

    def item_memory(self, tokens) -> np.ndarray:
        return np.zeros(np.shape(tokens))

    def signature(self) -> Dict[str, object]:
        return {"measured_tokens": self.tokens}
