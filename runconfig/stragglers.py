"""What a round does with a client that cannot finish its local work before the deadline.

Run config ``straggler-policy`` (read by the ServerApp's virtual clock and by a deployed client):

- ``drop`` (default): the client trains all its steps; a reply after the deadline is dropped
  (recorded ``late``);
- ``partial``: the client runs the local steps that fit before the deadline (at least
  ``straggler-min-steps``) and replies on time with the steps it did (``num-steps``);
- ``wait``: the deadline does not close the round: it waits for every client that will reply.

A deployed client (no virtual clock) under ``partial`` stops local training ``straggler-upload-s``
seconds before the round's deadline (``round-deadline`` after the train message was created).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import check

STRAGGLER_POLICIES = ("drop", "partial", "wait")


@dataclass(frozen=True)
class StragglerConfig:
    straggler_policy: str = "drop"  # "partial": the steps that fit the deadline; "wait": no deadline
    straggler_min_steps: int = 1  # partial: a client runs at least this many local steps
    straggler_upload_s: float = 1.0  # partial, deployed: seconds kept before the deadline for the reply

    def validate(self) -> StragglerConfig:
        check(self.straggler_policy in STRAGGLER_POLICIES, "straggler-policy", self.straggler_policy,
              f"one of {STRAGGLER_POLICIES}")
        check(self.straggler_min_steps >= 1, "straggler-min-steps", self.straggler_min_steps, ">= 1")
        check(self.straggler_upload_s >= 0, "straggler-upload-s", self.straggler_upload_s, ">= 0 seconds")
        return self
