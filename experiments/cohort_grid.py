"""The cohort engine: an in-process Grid that trains a round's whole cohort at once.

Run config ``engine``: ``per-client`` (every train message through the ClientApp, one after the
other), ``cohort`` (this grid) or ``auto`` (:func:`auto_engine`: the faster engine, the cohort
unless the model declares otherwise; on a CPU with the per-client engine's numbers bit for bit). :class:`CohortGrid` receives a round's train messages together; for each it runs the
ClientApp's own *start* (:func:`client_app.app.train_start`: decode, the availability gate, the
client rule's start model such as FedAWE's own copy) and *reply*
(:func:`client_app.app.train_reply`: metrics, FedAWE's echo, FedNova's a-norm), and replaces only
the local training in between by :class:`workloads.vmapped.CohortTrainer` (stacked parameters,
one batched solver step; a vmapped pass on a GPU, each client's own pass on a CPU). Every other message (identity queries, evaluation, FedAWE's adoption) goes
through the ClientApp as in :class:`~experiments.inprocess.InProcessGrid`. Replies come back in
the messages' order, so the strategy, the schedule, the checkpoints and the results folder cannot
tell the engines apart.

A workload the cohort engine cannot batch (see :func:`workloads.vmapped.cohort_unsupported`), and a
rule whose client corrects every local step (SCAFFOLD, Amplified SCAFFOLD), runs per client; the
reason is logged once and recorded in ``config.json`` (``engine-used``,
``engine-reason``; how the cohort computed: ``engine-kernels``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from flwr.app import Context, Message, MessageType

from client_app.app import TrainStart, local_training, train_reply, train_start
from runconfig import WorkloadConfig, from_run_config
from server_app.config import ENGINES
from strategies.protocol import CORRECTED_RULES, LOCAL_STEPS
from strategies.secure import secure_spec
from workloads.vmapped import CohortTrainer, batched_kernels, prefers_cohort
from workloads.workload import Workload, get_workload

from .grid import InProcessGrid, default_client_app

log = logging.getLogger(__name__)
COHORT_PULL = 1024  # training messages started and trained together when their replies are pulled


def auto_engine(wl: Workload) -> tuple[str, str]:
    """(engine, why) for ``engine = auto``: :func:`workloads.vmapped.prefers_cohort` on the
    workload's actual model (``config.json`` records it: ``engine-used``, ``engine-reason``,
    ``engine-kernels``). The cohort is the faster engine on both kinds of machine
    (``benchmarks/engine_speed.py``): on a GPU its one vmapped pass (2.4-3.3x the per-client
    engine's speed on an H200), on a CPU each client's pass with the per-client kernels, which
    skips the ClientApp's per-message training path and computes the per-client engine's numbers
    bit for bit (:func:`workloads.vmapped.batched_kernels`), so there auto changes the time a run
    takes, never its numbers."""
    cohort, why = prefers_cohort(wl.new_model())
    return ("cohort" if cohort else "per-client"), f"auto: {why}"


def kernels_record(wl: Workload) -> str:
    """How the cohort engine computes each client's pass on this run's device (``engine-kernels``)."""
    if batched_kernels(wl.device):
        return f"vmapped ({wl.device.type}): one batched pass a chunk, within the config's own sensitivity of per-client"
    return f"per-client ({wl.device.type}): each client's own pass, bit-identical to engine=per-client"


class CohortGrid(InProcessGrid):
    """An :class:`InProcessGrid` that trains each round's train messages as one cohort."""

    def __init__(self, num_nodes: int, run_config: Mapping[str, Any], engine: str = "cohort", **kwargs: Any) -> None:
        super().__init__(num_nodes, run_config, **kwargs)
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: one of {ENGINES}")
        self.requested = engine
        self.run_config = dict(run_config)
        self._trainer: CohortTrainer | None = None
        self._record: dict[str, str] | None = None

    @property
    def engine_record(self) -> dict[str, str]:
        """What ``config.json`` records: ``engine-used``; when not what was asked, ``engine-reason``;
        for the cohort, ``engine-kernels`` (:func:`kernels_record`)."""
        if self._record is None:
            wl = get_workload(from_run_config(WorkloadConfig, self.run_config))
            used, why = (("cohort", "") if self.requested == "cohort" else auto_engine(wl))
            if used == "cohort" and self.app is not default_client_app:
                used, why = "per-client", "a ClientApp other than client_app.app: its own train handler must run"
            rule = str(self.run_config.get("strategy", "")).split(":", 1)[0]
            if used == "cohort" and rule in CORRECTED_RULES:
                used, why = "per-client", (f"strategy '{rule}' corrects every local step with the client's "
                                           "control variate, which the vmapped solver does not apply")
            if used == "cohort" and secure_spec(str(self.run_config.get("strategy", ""))):
                used, why = "per-client", "secure=secagg+: SecAgg+'s stages run in each client's mod (client_app.secure)"
            if used == "cohort":
                try:
                    self._trainer = CohortTrainer(wl)
                except Exception as exc:  # noqa: BLE001 - any model it cannot batch: per client, said once
                    used, why = "per-client", f"the cohort engine cannot batch this workload: {exc}"
            if used == "per-client":
                log.warning("engine=%s: training per client (%s)", self.requested, why)
            self._record = {"engine-used": used, **({"engine-reason": why} if why else {}),
                            **({"engine-kernels": kernels_record(wl)} if used == "cohort" else {})}
        return self._record

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """The replies, in the messages' order. Training messages are delivered now and trained
        when their replies are pulled, :data:`COHORT_PULL` at a time (their start models, the
        trained models and the replies of one such group at most in memory); any other message
        is answered now, as in :class:`InProcessGrid`."""
        messages = list(messages)
        if self.engine_record["engine-used"] != "cohort" or not any(
                m.metadata.message_type == MessageType.TRAIN for m in messages):
            return super().send_and_receive(messages, timeout=timeout)
        items: list[Message | tuple[Message, Context]] = []
        for msg in messages:
            if msg.metadata.message_type != MessageType.TRAIN:
                items.extend(super().send_and_receive([msg], timeout=timeout))
            elif (delivered := self.deliver(msg)) is not None:  # None: the reply never comes
                items.append((msg, delivered))
        return self._cohort_replies(deque(items))

    def _cohort_replies(self, items: deque[Message | tuple[Message, Context]]) -> Iterator[Message]:
        while items:
            group: list[Message | tuple[Message, Context]] = []
            while items and len(group) < COHORT_PULL:
                group.append(items.popleft())
            yield from self._train_group(group)

    def _train_group(self, items: list[Message | tuple[Message, Context]]) -> list[Message]:
        replies: list[Message | None] = []
        starts: list[tuple[int, TrainStart]] = []
        for item in items:
            if isinstance(item, Message):
                replies.append(item)
                continue
            ts = train_start(*item)
            if isinstance(ts, Message):
                replies.append(ts)  # declined by the client-side gate
                continue
            if ts.stop is not None or LOCAL_STEPS in ts.config or (
                    len(ts.rule.rounds(ts.context, ts.client, ts.rnd, ts.config)) > 1):
                replies.append(train_reply(ts, *local_training(ts)))  # FedPBC's catch-up, a rule's own steps, a deadline's stop
                continue
            starts.append((len(replies), ts))
            replies.append(None)
        if starts:
            assert self._trainer is not None  # built above, with the first train message
            by_round: dict[int, list[tuple[int, TrainStart]]] = {}
            for slot, ts in starts:
                by_round.setdefault(ts.rnd, []).append((slot, ts))
            for rnd, group in by_round.items():
                trained = self._trainer.train([ts.client for _, ts in group], [ts.start for _, ts in group], rnd,
                                              [ts.steps for _, ts in group])
                for (slot, ts), (state, result) in zip(group, trained, strict=True):
                    replies[slot] = train_reply(ts, state, result)
        return [r for r in replies if r is not None]
