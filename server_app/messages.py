"""What a Flower message says about its round and stage (:mod:`server_app.churngrid` reads it).

- Its round: ``server-round`` in a ConfigRecord (Flower's Message-API strategies, the project's
  rules), else a numeric ``group_id`` (Flower's legacy workflows, ``DefaultWorkflow`` and every
  stage of ``SecAggPlusWorkflow``); :class:`RoundUnknown` for a message that names none.
- Its SecAgg+ stage, and whether it is the stage that trains (``collect_masked_vectors``).
- Flower's loops' log lines the grid follows: the round a loop starts, SecAgg+'s outcome, the
  end of the loop's rounds.
- The reply Flower's SuperLink gives for a message to an unavailable node.
"""

from __future__ import annotations

import uuid

from flwr.app import Message, MessageType
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from flowerlink import set_message_id, unavailable_node_reply
from strategies.protocol import server_round_of

STAGES = Stage.all()  # SecAgg+'s stages, in order
TRAINING_STAGE = Stage.COLLECT_MASKED_VECTORS  # SecAgg+'s stage that runs the client's fit
ROUND_STARTS = ("[ROUND %s]", "[ROUND %s/%s]")  # DefaultWorkflow's and Strategy.start's log lines
SECURE_DONE = {"Secure aggregation completed.": True, "Secure aggregation halted.": False}  # SecAggPlusWorkflow's log
RUN_ENDS = ("[SUMMARY]", "Strategy execution finished in %.2fs")  # DefaultWorkflow's and Strategy.start's last rounds


class RoundUnknown(ValueError):
    """A message whose round cannot be determined: it is refused, never passed through."""


def stage_of(m: Message) -> str | None:
    """The SecAgg+ stage a message belongs to (None: not a SecAgg+ message)."""
    record = m.content.config_records.get(RECORD_KEY_CONFIGS)
    stage = None if record is None else record.get(Key.STAGE)
    return None if stage is None else str(stage)


def is_training(m: Message, stage: str | None) -> bool:
    """A message of the stage that trains: TRAIN, and of SecAgg+ only ``collect_masked_vectors``."""
    return m.metadata.message_type == MessageType.TRAIN and stage in (None, TRAINING_STAGE)


def dated_round(m: Message) -> int | None:
    """The round a message names: ``server-round`` in a ConfigRecord, else a numeric ``group_id``."""
    rnd = server_round_of(m.content)
    if rnd is not None:
        return rnd
    group = m.metadata.group_id
    return int(group) if group.isdigit() else None


def unavailable_reply(m: Message) -> Message:
    """The reply Flower's SuperLink gives for a message to an unavailable node (its id set as a
    grid's push would, so a strategy can match the reply to it)."""
    if not m.metadata.message_id:
        try:
            set_message_id(m, m.object_id)
        except Exception:  # noqa: BLE001 - a message Flower cannot hash (a test double's): any unique id
            set_message_id(m, uuid.uuid4().hex)
    return unavailable_node_reply(m)
