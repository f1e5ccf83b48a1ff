"""On/off sessions in seconds, per client: an alternating renewal process.

``exponential``: a client starts online with probability on / (on + off) (the process's
stationary share), and its sessions and gaps last exponential times of means ``session_on_s``
and ``session_off_s`` (memoryless, so the first one needs no residual correction).
``periodic``: online for ``session_on_s`` from t = 0, offline ``session_off_s``, and so on.

Every draw is a hash of (seed, client, session index) (SplitMix64), not a stream: a client's
sessions are the same whatever is asked, in whatever order, and a client costs O(1) memory (its
cursor: the index and start of the interval last asked about).
"""

from __future__ import annotations

import math

import numpy as np

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def uniform(seed: int, client: int, k: int, salt: int) -> float:
    """A uniform draw in (0, 1) keyed by (seed, client, k, salt)."""
    h = splitmix64(splitmix64(splitmix64(splitmix64(seed & MASK) ^ client) ^ k) ^ salt)
    return ((h >> 11) + 0.5) / float(1 << 53)


class Sessions:
    """Who is in an online session at virtual time t, for clients with per-client means."""

    def __init__(self, on_s: np.ndarray, off_s: np.ndarray, periodic: np.ndarray, seed: int) -> None:
        self.on_s, self.off_s, self.periodic, self.seed = on_s, off_s, periodic, int(seed)
        n = len(on_s)
        self.k = np.zeros(n, dtype=np.int64)  # cursor: index of the interval last asked about
        self.start = np.zeros(n, dtype=np.float64)  # ... and its start

    def _first_on(self, c: int) -> bool:
        on, off = self.on_s[c], self.off_s[c]
        return bool(self.periodic[c]) or bool(uniform(self.seed, c, 0, 0) < on / (on + off))

    def _length(self, c: int, k: int, on: bool) -> float:
        mean = float(self.on_s[c] if on else self.off_s[c])
        if self.periodic[c]:
            return mean
        return -mean * math.log(uniform(self.seed, c, k, 1))

    def interval(self, c: int, t: float) -> tuple[bool, float, float]:
        """(online?, start, end) of client ``c``'s interval that holds time ``t`` (>= 0)."""
        if not math.isfinite(self.on_s[c]) or self.off_s[c] == 0:
            return True, 0.0, math.inf  # never off
        if self.periodic[c]:
            period = float(self.on_s[c] + self.off_s[c])
            n = math.floor(t / period)
            base = n * period
            if t - base < self.on_s[c]:
                return True, base, base + float(self.on_s[c])
            return False, base + float(self.on_s[c]), base + period
        if t < self.start[c]:
            self.k[c], self.start[c] = 0, 0.0
        k, start = int(self.k[c]), float(self.start[c])
        first = self._first_on(c)
        while True:
            on = first if k % 2 == 0 else not first
            end = start + self._length(c, k, on)
            if t < end:
                self.k[c], self.start[c] = k, start
                return bool(on), start, end
            k, start = k + 1, end
