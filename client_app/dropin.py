"""The client side of flchurn for a plain Flower ClientApp: availability, and the rules' client part.

**Churn** (with ``server_app.dropin.with_availability`` on the server): a mod and a handler::

    app = ClientApp(mods=[availability_mod])   # was: ClientApp()
    app.query("identity")(identity)            # "which client are you?"

An app built on ``client_fn`` (a ``NumPyClient``) cannot register a handler (Flower: "Use either
@app.query() or client_fn, but not both") and needs none: its mods see every message, and
``availability_mod`` answers the identity query itself, so the one line is
``ClientApp(client_fn=client_fn, mods=[..., availability_mod])``.

``identity`` answers the server's identity query with the node's ``partition-id`` (node config;
Flower's simulation sets it), so the server applies the schedule by client id; a node without
one answers with an error naming the fix, and the server, failing closed, sends it nothing. (It
is a handler, not part of the mod, because Flower runs mods only around registered handlers.)
With ``availability-gate = "client"`` in the run config (and the schedule's ``availability`` spec
and ``schedule-seed`` there too) ``availability_mod`` declines the rounds in which its client is
offline, with an "unavailable" error reply, as a device that refuses work would; with the server
gate (the default) it passes every message on.

**Rules** (one mod, one handler):

Most rules need nothing from the client beyond Flower's usual train reply (the trained arrays
and ``num-examples``). Two things need the client's help, and this module gives both to any
ClientApp whose train function reads the received model from the message's ArrayRecord and
replies with the trained one in a single ArrayRecord (Flower's templates do)::

    from client_app.dropin import adopt, client_rule_mod

    app = ClientApp(mods=[client_rule_mod])   # was: ClientApp()
    app.train("adopt")(adopt)                 # FedAWE's round-end broadcast
    correct_gradients(model, context)         # in the train function, before training (SCAFFOLD)

- **Client rules** (``client_app.rules``; the strategy names one in the train config key
  ``client-rule``). For FedAWE (Xiang et al., NeurIPS 2024, Alg. 1) the mod hands the train
  function the client's OWN copy x_i in place of the received model, turns the trained model in
  the reply into the echo x_i^† (plus the echo factor and u_i the server needs), and ``adopt``
  keeps the server's round-end model as the new copy (FedPBC: the same without the echo).
  SCAFFOLD and Amplified SCAFFOLD (``client_app.scaffold``) change every local step
  (g − c_i + c): the mod strips the server's control variate c from the model it hands the train
  function, the train function calls ``correct_gradients(model, context)`` before training
  (gradient hooks: a no-op for every other rule), and the mod adds Δc_i to the reply and keeps
  c_i; a train function that did not call it gets an error reply that says so. The other rules'
  client rule is ``plain``: the train function runs as it is.
- **A stable client id.** Train and evaluate replies that carry no ``client-id`` get the node's
  ``partition-id`` (node config) as their ``client-id`` (:func:`availability_mod` does the same, so
  the churn lines alone give ``fedau`` & co. their ids), so rules that keep per-client state key
  it by the partition, which survives a SuperNode restart, rather than by Flower's node id.

Messages from a strategy that is not flchurn's (no ``client-rule`` in their config, e.g. Flower's
own ``FedAvg``) pass through unchanged.

The client copy lives in ``context.state`` (and in a file under a configured ``state-dir``),
as for the project's own ClientApp (``client_app.fedawe``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from availability import Schedule, build_schedule
from runconfig import AVAILABILITY_GATES, AvailabilityConfig, ConfigError, did_you_mean, from_run_config
from strategies.protocol import (
    ADOPT,
    CLIENT_ID,
    CLIENT_RULE,
    IDENTITY_QUERY,
    IGNORE_AVAILABILITY,
    PLAIN_RULE,
    SERVER_ROUND,
    UNAVAILABLE,
    server_round_of,
)

from .client_rule import correct_gradients as apply_correction

flwr_log = logging.getLogger("flwr")
NO_IDENTITY = 1001  # Error code: the node cannot say which client it is (no partition-id)

__all__ = ["adopt", "availability_mod", "client_rule_mod", "correct_gradients", "identity"]


def client_id_of(context: Context) -> int | None:
    """The node's ``partition-id`` (node config), or None where the node config has none."""
    pid = context.node_config.get("partition-id")
    return None if pid is None else int(pid)


def _config(msg: Message) -> Any:
    """The message's one ConfigRecord (empty when it has none; several is an error)."""
    records = msg.content.config_records
    if len(records) > 1:
        raise ValueError(f"client_rule_mod: expected one ConfigRecord in the message, got {list(records)}")
    return next(iter(records.values()), {})


def _config_key(msg: Message) -> str:
    return next(iter(msg.content.config_records), "config")


def _single_arrays(msg: Message, what: str) -> tuple[str, ArrayRecord]:
    records = msg.content.array_records
    if len(records) != 1:
        raise ValueError(f"client_rule_mod: the {what} must hold one ArrayRecord, got {list(records)}")
    return next(iter(records.items()))


def _rule_and_round(msg: Message, context: Context) -> tuple[Any, Any, int, int]:
    """(client rule, config, client id, 0-based round) of a train or broadcast message."""
    from .rules import client_rule  # torch: only where a client rule runs

    config = _config(msg)
    rule = client_rule(str(config.get(CLIENT_RULE, PLAIN_RULE)))
    client = client_id_of(context)
    client = context.node_id if client is None else client
    return rule, config, client, int(config.get(SERVER_ROUND, 1)) - 1


def _add_client_id(reply: Message, context: Context) -> None:
    client = client_id_of(context)
    if client is None or reply.has_error() or len(reply.content.metric_records) != 1:
        return
    metrics = next(iter(reply.content.metric_records.values()))
    if CLIENT_ID not in metrics:
        metrics[CLIENT_ID] = client


def client_rule_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A Flower mod: runs the strategy's client rule around the train function (see the module)."""
    config = _config(msg)
    if CLIENT_RULE not in config:  # not one of flchurn's strategies (Flower's own): change nothing
        return call_next(msg, context)
    if msg.metadata.message_type != MessageType.TRAIN or config[CLIENT_RULE] == PLAIN_RULE:
        reply = call_next(msg, context)
        _add_client_id(reply, context)
        return reply
    rule, config, client, t = _rule_and_round(msg, context)
    key, received = _single_arrays(msg, "train message")
    start = rule.start(received.to_torch_state_dict(), context, client, t, config)
    # a new RecordDict: the received one may be shared with other nodes' messages (in-process grids)
    rounds = rule.rounds(context, client, t, config)
    original, first = dict(msg.content.items()), start
    for missed in rounds[:-1]:  # FedPBC's catch-up: the train function runs each missed round first
        earlier = ConfigRecord({**dict(config), SERVER_ROUND: missed + 1})
        msg.content = RecordDict({**original, key: ArrayRecord(start), _config_key(msg): earlier})
        done = call_next(msg, context)
        if done.has_error():
            return done
        start = _single_arrays(done, "train reply")[1].to_torch_state_dict()
    msg.content = RecordDict({**original, key: ArrayRecord(start)})
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    reply_key, trained = _single_arrays(reply, "train reply")
    reply.content[reply_key] = ArrayRecord(rule.reply(first, trained.to_torch_state_dict(), context, client,
                                                      t, config))
    _add_client_id(reply, context)
    return reply


def correct_gradients(model: Any, context: Context) -> Any:
    """The client rule's drift correction on ``model``'s local steps (SCAFFOLD's, registered by its
    ``start``: :mod:`client_app.client_rule`); call it in the train function before training. A
    no-op (None) for every other rule."""
    return apply_correction(model, context)


def adopt(msg: Message, context: Context) -> Message:
    """The handler of the strategy's round-end broadcast (``train.adopt``; FedAWE's x^{t+1})."""
    rule, config, client, t = _rule_and_round(msg, context)
    _, received = _single_arrays(msg, "broadcast")
    rule.adopt(received.to_torch_state_dict(), context, client, t, config)
    return Message(RecordDict({"metrics": MetricRecord({CLIENT_ID: client})}), reply_to=msg)


def identity(msg: Message, context: Context) -> Message:
    """The handler of the server's identity query (``app.query("identity")``): this node's client
    id and N (node config), or an error reply naming the fix."""
    client = client_id_of(context)
    if client is None:
        return Message(Error(code=NO_IDENTITY, reason=(
            f"node {context.node_id} has no 'partition-id' in its node config, so it cannot say which client it "
            f"is: start the SuperNode with --node-config \"partition-id=I num-partitions=N\"")), reply_to=msg)
    n = context.node_config.get("num-partitions", context.run_config.get("num-clients", 0))
    return Message(RecordDict({"identity": MetricRecord({"client-id": client, "num-partitions": int(n)})}),
                   reply_to=msg)


@functools.lru_cache(maxsize=8)
def _schedule(spec: str, num_clients: int, seed: int) -> Schedule:
    return build_schedule(spec, num_clients, seed)


def declines(msg: Message, context: Context) -> bool:
    """The client gate: True when the run config's ``availability-gate`` is ``client`` and this
    node's client is offline in the message's round (always True where it has no client id:
    closed, not open)."""
    gate = context.run_config.get("availability-gate", "server")
    rnd = server_round_of(msg.content)
    if gate == "server" or gate == "none" or rnd is None or msg.metadata.message_type == IDENTITY_QUERY:
        return False
    if gate not in AVAILABILITY_GATES:
        raise ConfigError(f"run config 'availability-gate' = {gate!r}: expected one of {AVAILABILITY_GATES}"
                          f"{did_you_mean(gate, AVAILABILITY_GATES)}")
    if any(r.get(IGNORE_AVAILABILITY, False) for r in msg.content.config_records.values()):
        return False
    client = client_id_of(context)
    if client is None:
        flwr_log.warning("node %d: client gate without a 'partition-id' in the node config: declining", context.node_id)
        return True
    acfg = from_run_config(AvailabilityConfig, {k: context.run_config[k] for k in ("availability", "schedule-seed")
                                                if k in context.run_config})
    n = int(str(context.node_config.get("num-partitions", context.run_config.get("num-clients", 0))))
    return not _schedule(acfg.availability, n, acfg.schedule_seed).is_available(client, rnd - 1)


def availability_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A Flower mod: answers the server's identity query itself (so a ``client_fn`` app, which
    cannot register a query handler, needs only this mod), under the client gate declines the
    rounds in which this client is offline, and puts the node's ``partition-id`` as ``client-id``
    in the train and evaluate replies to flchurn's rules (as :func:`client_rule_mod`): a rule with
    per-client state (``fedau``, ``mifa``, ...) then keys it by the partition, which survives a
    SuperNode's restart. Flower's own strategies' replies are left as they are."""
    if msg.metadata.message_type == IDENTITY_QUERY:
        return identity(msg, context)
    if declines(msg, context):
        return Message(Error(code=UNAVAILABLE, reason=f"client {client_id_of(context)} unavailable in round "
                                                      f"{server_round_of(msg.content)}"), reply_to=msg)
    ours = msg.metadata.message_type in (MessageType.TRAIN, MessageType.EVALUATE) and any(
        CLIENT_RULE in record for record in msg.content.config_records.values())  # read before the handler pops
    reply = call_next(msg, context)
    if ours:  # a rule of flchurn's: its per-client state is keyed by the partition id, not the node id
        _add_client_id(reply, context)
    return reply


assert ADOPT == f"{MessageType.TRAIN}.adopt"  # the handler is registered as app.train("adopt")
assert IDENTITY_QUERY == f"{MessageType.QUERY}.identity"  # registered as app.query("identity")
