"""Flower's own server optimizers (FedAdam, FedYogi, FedAdagrad, FedAvgM) as one step function:
the narrow adapter that feeds them, so that no rule builds a message.

Flower's strategies take their step inside ``aggregate_train(server_round, replies)``. The rules
of :mod:`strategies.rules.flower_opt` have already averaged the accepted updates (Δ̄); this module
hands Flower's object one reply holding the averaged model x + Δ̄ and reads back its new model:
``FlowerStep(flower.FedAdam(...)).step(t, x, Δ̄)``. The optimizer's state (its moments, FedAvgM's
momentum) is on Flower's object, ``FlowerStep.optimizer``: the rule sets it from its ``State``
before the step and reads the new one back.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower

KEY = "x"  # the one flat array Flower's optimizer sees (its updates are elementwise)
flwr_log = logging.getLogger("flwr")


class FlowerStep:
    """One of Flower's server optimizers (``optimizer``: a ``flwr.serverapp.strategy`` FedOpt or
    FedAvgM), called as a step: x^{t+1} from x^t and the round's mean update."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def step(self, t: int, x: np.ndarray, u: np.ndarray | int) -> np.ndarray:
        """Flower's step from x^t (flat float32) with mean update ``u``; Flower is given the
        1-based round t + 1, as its own ServerApp would (FedAdam's bias correction)."""
        x32 = np.asarray(x, np.float32)
        if isinstance(self.optimizer, flower.FedAvgM):  # FedAvgM reads an ArrayRecord, FedOpt a dict
            self.optimizer.current_arrays = ArrayRecord({KEY: Array(x32)})
        else:
            self.optimizer.current_arrays = {KEY: x32}
        content = RecordDict({"arrays": ArrayRecord({KEY: Array(np.asarray(x + u, np.float32))}),
                              "metrics": MetricRecord({"num-examples": 1})})
        averaged = Message(content, dst_node_id=0, message_type=MessageType.TRAIN)
        level = flwr_log.level
        flwr_log.setLevel(logging.WARNING)  # its "Received 1 results" line would count the average as a reply
        try:
            arrays, _ = self.optimizer.aggregate_train(t + 1, [averaged])
        finally:
            flwr_log.setLevel(level)
        return np.asarray(arrays[KEY].numpy(), np.float32)
