"""One round of Flower's SecAgg+ for a Message-API rule: Flower's own stages, driven with our messages.

Flower 1.42's ``SecAggPlusWorkflow`` runs the protocol (Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017; Bell et al., "Secure
Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020: SecAgg+) in four stages
(``setup``, ``share_keys``, ``collect_masked_vectors``, ``unmask``), each a public method
``stage(grid, context, state)`` that returns False when the round must halt. Only two calls tie
them to Flower's legacy strategies: ``setup_stage`` asks ``context.strategy.configure_fit`` for the
nodes and their fit instructions, and ``unmask_stage`` hands the unmasked aggregate to
``context.strategy.aggregate_fit``. :func:`secagg_plus_round` answers both with a small adapter
(:class:`_Nodes`: the nodes the rule addressed; the aggregate kept) and replaces the fit
instructions by the rule's own train message contents, so the clients receive the project's
Message-API train message in the stage that trains, and the client's side is Flower's
``secaggplus_mod`` unchanged (``client_app.secure`` answers it in the legacy ``fitres`` layout it
reads). The key agreement, Shamir shares, masks, dropout recovery and quantisation are Flower's.

One change to Flower's bookkeeping: Flower 1.42 counts every addressed node that did not send
its masked vector as a dropout whose key must be recovered, also one that left before sharing its
key shares, whose shares no client holds (``KeyError`` in the mod's unmasking, then "Not enough
shares": the round halts). Here, after ``share_keys``, the round's nodes are those that shared
their keys (U2 in Bonawitz et al., Fig. 4): a node gone before that was never masked with.

Every stage message also carries ``config.server-round`` (besides Flower's ``group_id``), so an
availability grid dates it as a message of that round. Flower's ``random.shuffle`` of the
neighbour ring is seeded per round (and the global ``random`` state restored), so a run repeats.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid

from .failures import quoted_error
from .grid import DelegatingGrid
from .protocol import SERVER_ROUND
from .secagg_checks import (
    DROPPED,
    SECURE_CLIENT_HINT,
    attack_reason,
    capture_sum,
    model_entries,
    problems_of,
    sum_problem,
)

log = logging.getLogger("flwr")  # Flower's logger: ChurnGrid follows SecAgg+'s outcome lines on it

STAGES = (Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK)
MAX_WEIGHT = 1.0  # each client's Flower weight is 1 (num_examples = 1): its vector is already weighted
FAILED_CLOSED = "SecAgg+, round %s: %s"  # one line per attack, before "halted." (server_app's watch records it)
DROPPED_NODE = "SecAgg+, round %s, before training: %s"  # a malformed reply's node dropped (not a failed round)


@dataclass(frozen=True)
class SecAggPlusSettings:
    """SecAgg+'s parameters (Flower's ``SecAggPlusWorkflow`` arguments, same meaning).

    shares : each client's secrets are shared with this many clients (a float: that fraction of
        the round's addressed nodes; 1.0 = all of them).
    threshold : shares needed to recover a secret (a float: that fraction of ``shares``, at least 2);
        a round in which some client keeps fewer active neighbours halts.
    clipping_range : SecAgg+ quantises each entry of a client's vector in [-range, range]; the
        client refuses (never clips) an entry beyond it (``client_app.secure``).
    quantization_range, modulus_range : Flower's (2**22, 2**32): a round sums at most
        ``modulus_range / quantization_range - 1`` = 1023 clients without overflow.
    timeout : seconds each stage waits for its replies.
    """

    shares: float = 1.0
    threshold: float = 0.6
    clipping_range: float = 8.0
    quantization_range: int = 2**22
    modulus_range: int = 2**32
    timeout: float = 120.0

    def __post_init__(self) -> None:
        self.workflow()  # Flower's own checks of the values
        if not (np.isfinite(self.clipping_range) and self.clipping_range > 0):
            raise ValueError(f"secure-clipping-range must be > 0, got {self.clipping_range}")
        if not self.timeout > 0:
            raise ValueError(f"secure-timeout must be > 0 seconds, got {self.timeout}")

    def workflow(self) -> SecAggPlusWorkflow:
        return SecAggPlusWorkflow(self.shares, self.threshold, max_weight=MAX_WEIGHT,
                                  clipping_range=float(self.clipping_range),
                                  quantization_range=int(self.quantization_range),
                                  modulus_range=int(self.modulus_range), timeout=float(self.timeout))

    @property
    def quantum(self) -> float:
        """One quantisation step of an entry (2 × range / quantization range); stochastic rounding
        errs by less than one step per client and entry."""
        return 2 * self.clipping_range / self.quantization_range


@dataclass
class SecAggOutcome:
    """What one SecAgg+ round gave the server.

    stage : the last stage run (``unmask`` when completed).
    setup_answers : the nodes that answered the setup stage. When some addressed node did not
        (offline), the round restarts once with those that did, so that SecAgg+'s shares and
        threshold count the nodes that are there, as in a deployment where offline nodes are not
        connected.
    completed : whether the sum was unmasked.
    total : Σ over ``survivors`` of their vectors (float64, flat), None unless completed.
    survivors : node -> its stage-2 reply (the stage that trains): the nodes whose masked vectors
        are in the sum (a node that left before unmasking still counts: its mask is recovered).
    sent : node -> the stage-2 message it was sent.
    addressed, threshold, shares : the round's nodes and protocol sizes.
    failures : the error replies' reasons (quoted), and why the round halted.
    attacks : why the round failed closed (a malformed stage reply, its node named and dropped; an
        exception of a stage; an unmasked sum no honest survivors can give): the round applies
        nothing, and is a failed round, not churn.
    problems : why a halted round is not churn either: every node that answered the setup raised
        in its ClientApp (a ClientApp without the secure client half does): a failed round.
    malformed : (node, stage, why) of each malformed reply among ``attacks`` (a stage exception has none).
    dropped : the attacks of nodes dropped before the stage that trains, the round run again
        without them (:func:`secagg_plus_round`): they no longer fail the round.
    """

    stage: str = Stage.SETUP
    completed: bool = False
    total: np.ndarray | None = None
    survivors: dict[int, Message] = field(default_factory=dict)
    sent: dict[int, Message] = field(default_factory=dict)
    addressed: list[int] = field(default_factory=list)
    threshold: int = 0
    shares: int = 0
    failures: list[str] = field(default_factory=list)
    setup_answers: list[int] = field(default_factory=list)  # the nodes that answered the setup stage
    attacks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    malformed: list[tuple[int, str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


class _Nodes:
    """The legacy strategy Flower's stages call: the nodes the rule addressed; the aggregate kept."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes
        self.results: list[tuple[Any, Any]] | None = None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[tuple[Any, FitIns]]:
        return [(SimpleNamespace(node_id=n), FitIns(Parameters([], ""), {})) for n in self.nodes]

    def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]], failures: list[Any]) -> tuple[None, dict]:
        self.results = results
        return None, {}  # nothing for Flower's History: the rule applies the sum


class _StageGrid(DelegatingGrid):
    """The grid the stages send through: dates every message by ``server-round``, keeps each
    stage's messages and replies (as lists: Flower's stages read the replies more than once)."""

    def __init__(self, grid: Grid, server_round: int, entries: int = 0) -> None:
        super().__init__(grid)
        self.server_round, self.entries = server_round, entries
        self.attacks: list[tuple[int, str, str]] = []  # (node, stage, why): malformed replies, dropped
        self.sent: dict[str, dict[int, Message]] = {}
        self.replies: dict[str, list[Message]] = {}
        self.node_of: dict[str, int] = {}  # message id -> the node it went to (an error reply may come from the SuperLink)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        stage = ""
        for m in messages:  # each its own content, as over the wire (a stage shares one; the mod pops from it)
            records = dict(m.content.items())
            records[RECORD_KEY_CONFIGS] = ConfigRecord(dict(m.content.config_records[RECORD_KEY_CONFIGS]))
            records.setdefault("config", ConfigRecord({SERVER_ROUND: self.server_round}))
            m.content = RecordDict(records)
            stage = str(m.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE, ""))
        replies = list(self.grid.send_and_receive(messages, timeout=timeout)) if messages else []
        self.sent[stage] = {m.metadata.dst_node_id: m for m in messages}
        self.node_of.update({m.metadata.message_id: m.metadata.dst_node_id for m in messages})
        bad = problems_of(replies, self.sent[stage], self.node_of, stage, self.entries)
        self.attacks += [(node, stage, why) for node, why in bad]
        dropped = {node for node, _ in bad}  # Flower's stage never reads them: those nodes did not answer
        replies = [m for m in replies if self.node_of.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)
                   not in dropped or m.has_error()]
        self.replies[stage] = replies
        return replies

    def push_messages(self, messages):  # noqa: D102
        raise NotImplementedError("SecAgg+'s stages send through send_and_receive")

    def pull_messages(self, message_ids):  # noqa: D102
        raise NotImplementedError("SecAgg+'s stages send through send_and_receive")


def secagg_plus_round(grid: Grid, server_round: int, contents: Mapping[int, RecordDict],
                      settings: SecAggPlusSettings, seed: int = 0) -> SecAggOutcome:
    """Run SecAgg+ over the nodes of ``contents`` (node -> its train message content, sent in the
    stage that trains); the unmasked sum of the survivors' vectors, or where it halted."""
    nodes = sorted(contents)
    log.info("Secure aggregation commencing.")
    out = _run(grid, server_round, contents, nodes, settings, seed)
    answered = sorted(set(out.setup_answers))
    if out.stage == Stage.SETUP and not out.completed and not out.attacks and 2 <= len(answered) < len(nodes):
        log.info("SecAgg+: %d of the %d addressed node(s) answered the setup: the round restarts with them "
                 "(its shares and threshold count the nodes that are there)", len(answered), len(nodes))
        out = _run(grid, server_round, {n: contents[n] for n in answered}, answered, settings, seed)
        out.addressed = nodes
    named = {node for node, _, _ in out.malformed}
    rest = [n for n in (sorted(set(out.setup_answers)) or nodes) if n not in named]
    if (out.stage in (Stage.SETUP, Stage.SHARE_KEYS) and out.malformed and len(out.malformed) == len(out.attacks)
            and len(rest) >= 2):
        # only named nodes' malformed replies, before anyone trained: the round again without them, so
        # that no one client can veto a secure round (issue 47); a second attack fails it closed
        dropped = [attack_reason(node, stage, why, then=DROPPED) for node, stage, why in out.malformed]
        for why in dropped:
            log.warning(DROPPED_NODE, server_round, why)
        out = _run(grid, server_round, {n: contents[n] for n in rest}, rest, settings, seed)
        out.addressed, out.dropped = nodes, dropped
    for why in out.attacks:
        log.warning(FAILED_CLOSED, server_round, why)
    log.info("Secure aggregation completed." if out.completed else "Secure aggregation halted.")
    return out


def _run(grid: Grid, server_round: int, contents: Mapping[int, RecordDict], nodes: list[int],
         settings: SecAggPlusSettings, seed: int) -> SecAggOutcome:
    workflow = settings.workflow()
    adapter = _Nodes(nodes)
    context = SimpleNamespace(
        state=RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round}),
                          MAIN_PARAMS_RECORD: ArrayRecord()}),
        strategy=adapter, client_manager=SimpleNamespace(num_available=lambda: len(nodes)))
    entries = model_entries(contents[nodes[0]]) if nodes else 0
    state, stages = WorkflowState(), _StageGrid(grid, server_round, entries)
    out, unmasked = SecAggOutcome(addressed=nodes), dict[str, Any]()
    for stage, step in zip(STAGES, (workflow.setup_stage, workflow.share_keys_stage,
                                    workflow.collect_masked_vectors_stage, workflow.unmask_stage), strict=True):
        out.stage = stage
        saved = random.getstate()
        random.seed(f"secagg+:{seed}:{server_round}")  # the setup's shuffle of the neighbour ring
        try:
            with capture_sum(unmasked) if stage == Stage.UNMASK else contextlib.nullcontext():
                ok = step(stages, context, state)  # type: ignore[arg-type]  # the two calls a LegacyContext serves
        except Exception as err:  # noqa: BLE001  # any reply a stage cannot digest: a failed round, never a crash
            ok = False
            out.attacks.append(attack_reason(None, stage, f"Flower's stage raised {type(err).__name__}: "
                                                          f"{str(err).splitlines()[0][:160] if str(err) else ''}",
                                             who="a reply the stage could not digest (its node not told apart)"))
        finally:
            random.setstate(saved)
        out.attacks[:0] = [attack_reason(node, st, why) for node, st, why in stages.attacks]
        out.malformed += stages.attacks
        stages.attacks = []
        if out.attacks:  # a malformed reply (its node dropped) or a stage that raised: fail closed now
            out.failures += [_reason(m, stages.node_of) for m in stages.replies.get(stage, []) if m.has_error()]
            return out
        if stage == Stage.SETUP and state.nid_to_fitins:  # the rule's own train messages in the stage that trains
            state.nid_to_fitins = {n: RecordDict(dict(contents[n].items())) for n in state.nid_to_fitins}
        if stage == Stage.SHARE_KEYS:  # U2 of Bonawitz et al.: only who shared keys can be masked with, or recovered
            state.sampled_node_ids = set(state.active_node_ids)
        out.threshold, out.shares = state.threshold, state.num_shares
        out.failures += [_reason(m, stages.node_of) for m in stages.replies.get(stage, []) if m.has_error()]
        if stage == Stage.SETUP:
            out.setup_answers = [m.metadata.src_node_id for m in stages.replies.get(stage, []) if not m.has_error()]
            raised = [m for m in stages.replies.get(stage, [])
                      if m.has_error() and m.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION]
            if raised and not out.setup_answers:
                out.problems.append(f"every node that answered SecAgg+'s setup raised in its ClientApp "
                                    f"({len(raised)}; {_reason(raised[0], stages.node_of)}): {SECURE_CLIENT_HINT}")
        if not ok:
            need = f"threshold {state.threshold}" if state.threshold else "SecAgg+ needs 2 or more"
            out.failures.append(f"SecAgg+ halted at stage {stage}: {len(state.active_node_ids)} of {len(nodes)} "
                                f"node(s) active, {need}")
            return out
    out.sent = stages.sent.get(Stage.COLLECT_MASKED_VECTORS, {})
    out.survivors = {m.metadata.src_node_id: m for m in stages.replies.get(Stage.COLLECT_MASKED_VECTORS, [])
                     if not m.has_error()}
    results = adapter.results or []
    why = (f"SecAgg+ unmasked {len(results)} vectors but {len(out.survivors)} nodes sent one"
           if len(results) != len(out.survivors) else
           "Flower's unmask stage no longer hands its integers to factor_extract (strategies/secagg_checks.py)"
           if "q_total" not in unmasked else
           sum_problem(unmasked["q_total"], unmasked["integers"], len(out.survivors), settings.quantization_range))
    if why:
        out.attacks.append(attack_reason(None, Stage.UNMASK, f"the unmasked sum: {why}"))
        return out
    if results:
        mean = np.concatenate([np.asarray(a, np.float64).ravel() for a in parameters_to_ndarrays(results[0][1].parameters)])
        out.total = mean * len(results)  # Flower's unmask gives the mean of weight-1 vectors
    out.completed = True
    return out


def _reason(m: Message, node_of: Mapping[str, int]) -> str:
    node = node_of.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)
    return f"node {node}: {quoted_error(m.error.reason)}"
