"""The client's side of ``secure=secagg+``: Flower's ``secaggplus_mod``, fed the client's weighted update.

:func:`secure_mod` is a Flower mod. A TRAIN message that carries SecAgg+'s config record goes to
Flower's own ``secaggplus_mod`` (key setup, key shares, masking, unmasking: Flower's code,
unchanged); every other message passes straight on. In the stage that trains
(``collect_masked_vectors``) the mod calls the ClientApp's train handler and reads its reply in the
legacy ``fitres`` layout; :func:`masked_input` turns the handler's reply into that layout:

- Δ_i = the trained floating arrays − the received ones, as one flat vector (the strategy's
  layout: the floating arrays in the record's order);
- clipped to ‖Δ_i‖₂ ≤ ``secure-clip-norm`` (the server's norm bound, which it cannot apply to a
  masked update: moved here, before masking);
- times f_i, the server's factor for this client's id (``secure-factors``; FedAU's ω_i/N,
  debiased FedAvg's 1/(N π̂_i)..., divided by the largest so that f_i ≤ 1), and for data-size
  weights also num-examples / ``secure-example-scale``;
- with Flower's weight ``num_examples`` = 1, so that the unmasked mean times the number of
  survivors is the sum Σ f_i Δ_i the strategy needs; the reply's metrics travel in the clear, as
  in Flower's SecAgg+.

An entry beyond SecAgg+'s clipping range would be clipped silently by Flower's quantiser: the client
refuses instead (a ValueError naming the entry and the spec key), so its node counts as dropped
and its masks are recovered. Flower's stochastic rounding draws from numpy's global generator:
seeded here per (round, client) and restored, so a run repeats. In a deployment whose nodes hand
messages to a long-lived worker (``client_app.worker``), the worker runs the ClientApp with its mods
again: the stage that trains reaches it with SecAgg+'s stage already taken (Flower's mod pops it),
so this mod passes it straight to the train handler there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from flwr.app import Context, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat

from strategies.protocol import (
    CLIENT_ID,
    NUM_EXAMPLES,
    SECURE_CLIP_NORM,
    SECURE_CLIPPING_RANGE,
    SECURE_EXAMPLE_SCALE,
    SECURE_FACTORS,
    SERVER_ROUND,
)

SEED_SALT = 0x5EC_A66  # numpy's global generator for Flower's stochastic rounding: (salt, round, client)


def secure_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower mod: SecAgg+ messages to Flower's ``secaggplus_mod`` (the stage that trains through
    :func:`masked_input`), every other message straight on."""
    record = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if msg.metadata.message_type != MessageType.TRAIN or record is None or Key.STAGE not in record:
        return call_next(msg, context)  # not SecAgg+'s, or its training stage already taken up (the node's worker)
    config: Any = msg.content.config_records.get("config", {})
    client = context.node_config.get("partition-id", context.node_id)
    saved = np.random.get_state()
    np.random.seed([SEED_SALT, int(cast(int, config.get(SERVER_ROUND, 0))), int(cast(int, client)) % 2**32])
    try:
        return secaggplus_mod(msg, context, functools.partial(masked_input, call_next=call_next))
    finally:
        np.random.set_state(saved)


def masked_input(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The train handler's reply in the legacy ``fitres`` layout ``secaggplus_mod`` reads, its
    parameters the weighted, clipped update (one flat vector), its weight 1."""
    reply = call_next(msg, context)
    if reply.has_error():
        raise RuntimeError(f"secure=secagg+: the train handler replied with an error: {reply.error.reason}")
    config = msg.content["config"]
    metrics = dict(next(iter(reply.content.metric_records.values())))
    vector = weighted_update(msg.content.array_records["arrays"].to_numpy_ndarrays(),
                             next(iter(reply.content.array_records.values())).to_numpy_ndarrays(), config, metrics)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([vector]), 1, cast(dict[str, Any], metrics))
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def weighted_update(start: list[np.ndarray], trained: list[np.ndarray], config: Any,
                    metrics: dict[str, Any]) -> np.ndarray:
    """f_i · clip(Δ_i) as one flat float64 vector (the strategy's layout); ValueError when it
    cannot be masked faithfully."""
    if len(start) != len(trained) or any(a.shape != b.shape for a, b in zip(start, trained, strict=True)):
        raise ValueError("secure=secagg+: the trained model's arrays differ from the received model's")
    delta = np.concatenate([(np.asarray(b, np.float64) - np.asarray(a, np.float64)).ravel()
                            for a, b in zip(start, trained, strict=True) if a.dtype.kind == "f"] or [np.zeros(0)])
    if not np.isfinite(delta).all():
        raise ValueError("secure=secagg+: the update has non-finite entries")
    norm, bound = float(np.linalg.norm(delta)), float(config[SECURE_CLIP_NORM])
    if norm > bound:
        delta *= bound / norm  # the server's norm bound, applied before masking
    factors = cast(list[float], config[SECURE_FACTORS])
    client = int(metrics[CLIENT_ID])
    if not 0 <= client < len(factors):
        raise ValueError(f"secure=secagg+: client id {client} has no factor (the server sent {len(factors)})")
    factor = float(factors[client])
    scale = float(config.get(SECURE_EXAMPLE_SCALE, 0.0))
    if scale > 0:
        factor *= float(metrics[NUM_EXAMPLES]) / scale
    vector = factor * delta
    limit = float(config[SECURE_CLIPPING_RANGE])
    largest = float(np.abs(vector).max()) if vector.size else 0.0
    if not (math.isfinite(largest) and largest <= limit):
        raise ValueError(f"secure=secagg+: an entry of the weighted update is {largest:.4g}, beyond SecAgg+'s "
                         f"clipping range {limit:g} (Flower's quantiser would clip it silently): raise the strategy "
                         f"spec's secure-clipping-range, or bound updates with max-update-norm")
    return vector
