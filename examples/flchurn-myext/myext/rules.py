"""A rule of the user's own: FedAvg over the clients that replied, its step scaled by the round's
participation, max(floor, |A_t| / N). A round that few clients reach moves the model less, as in
FedAvg over all clients (Wang & Ji, ICML 2024, Sec. 3), while the direction stays the
participants' weighted mean.

Reached as ``strategy = "myext.rules:ParticipationScaled:floor=0.2"``, or, with this package
installed, by its entry point: ``strategy = "participation-scaled:floor=0.2"``. Its spec
parameters are its own keyword arguments; Flower's arguments and the project's sanity bounds come
with the base class.
"""

from __future__ import annotations

import numpy as np

from strategies import FedAvgActive


class ParticipationScaled(FedAvgActive):
    needs_num_clients = True  # |A_t| / N needs N (the run config's num-clients)

    def __init__(self, *, floor: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"floor={floor} must lie in (0, 1]")
        self.floor = floor

    def aggregate(self, t: int, x: np.ndarray, reports):
        moved, metrics = super().aggregate(t, x, reports)
        scale = max(self.floor, len(reports) / self.require_num_clients())
        return x + np.float32(scale) * (moved - x), {**metrics, "step-scale": scale}
