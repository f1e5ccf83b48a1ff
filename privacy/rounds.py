"""Central DP in the project's own round loop (run config ``dp-noise-multiplier`` > 0): each
training reply's update clipped to C before the rule sees it, the rule's aggregate noised with
σ_t = z·C/m_t, and the round accounted at q_t = m_t/N (:mod:`privacy.accountant`).

The loop (:mod:`server_app.experiment`) drives the rule directly, so Flower's wrappers (which
forward only Flower's ``Strategy`` methods) cannot hold it; this is the same step as
:class:`privacy.DifferentialPrivacyServerSideFixedClipping` with ``calibration="realised"``,
written as two calls around ``aggregate_train``. It is valid for a rule whose step is the equal-
weight mean of the round's accepted updates (``fedavg-active`` with ``weighting = "equal"``: Δ_t =
C/m_t), which :mod:`server_app.setup` checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message

from .wrappers import ChurnNoise, clip_update


class RoundPrivacy:
    """Clip before the rule, noise and account after it.

    Args:
        noise_multiplier: z (> 0).
        clipping_norm: C (> 0), the bound on each client's update ‖x_i − x‖.
        num_clients: N.
        delta: δ of the reported ε.
        accountant: ``"rdp"`` or ``"pld"``.
    """

    def __init__(self, noise_multiplier: float, clipping_norm: float, num_clients: int, delta: float,
                 accountant: str = "rdp") -> None:
        self.noise_multiplier, self.clipping_norm = noise_multiplier, clipping_norm
        self.churn = ChurnNoise(num_clients, delta, accountant=accountant)

    def state_dict(self) -> dict[str, Any]:
        """The accountant's rounds, for the run's checkpoint (a resumed run goes on from them)."""
        return self.churn.accountant.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.churn.accountant.load_state_dict(state)

    def clip(self, replies: Iterable[Message], arrays: ArrayRecord) -> Iterator[Message]:
        """Each reply with every array record's update (against the round's model) clipped to C."""
        reference = arrays.to_numpy_ndarrays()
        for reply in replies:
            if not reply.has_error():
                for name, record in reply.content.array_records.items():
                    update = record.to_numpy_ndarrays()
                    if [u.shape for u in update] == [r.shape for r in reference]:  # the model's record
                        clip_update(update, reference, self.clipping_norm)
                        reply.content[name] = ArrayRecord({k: Array(np.asarray(v)) for k, v in
                                                           zip(record.keys(), update, strict=True)})
            yield reply

    def release(self, rnd: int, arrays: ArrayRecord | None, participants: list[Any]
                ) -> tuple[ArrayRecord | None, dict[str, float]]:
        """The rule's new model with the round's noise (``None`` or no participant: nothing
        released), and the round's ``dp-*`` figures."""
        released = arrays is not None and bool(participants)
        z = self.churn.plan(self.noise_multiplier, self.clipping_norm, len(participants),
                            [1.0] * len(participants)) if released else 0.0
        if released and arrays is not None:
            noised = self.churn.noised(arrays.to_numpy_ndarrays())
            arrays = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(arrays.keys(), noised, strict=True)})
        spent = self.churn.release(rnd, participants if released else [], z)
        return arrays, spent.metrics()
