"""The message protocol between strategies and the ClientApp: config and metric keys.

Constants (and where a message's round is), importable by the ClientApp without pulling in the
strategies.
"""

import re
from typing import Any

# config sent with every round message
SERVER_ROUND = "server-round"  # Flower's 1-based round
IGNORE_AVAILABILITY = "ignore-availability"  # True: an oracle round that must reach every client
CLIENT_RULE = "client-rule"  # which client-side behaviour to run (see client_app.rules)
PLAIN_RULE = "plain"  # the client rule of every strategy but FedAWE: train from the received model
# train config, per node, of rules whose clients keep state (SCAFFOLD's c_i, FedAWE's τ_i): the
# round of this node's client's last reply the server applied (−1: none); the client commits that
# reply's pending state and drops a pending one of another round (client_app.client_state)
ACCEPTED_ROUND = "accepted-round"
PROBE_BATCHES = "probe-batches"  # evaluate on this many mini-batches only (0 = all data)
LOCAL_STEPS = "local-steps"  # train exactly this many local steps this job (FedCompass's Q_i; else the workload's)
MAX_LOCAL_STEPS = "max-local-steps"  # train: run at most this many local steps in this job (the straggler
#   policy ``partial`` on the virtual clock: the steps that fit the deadline); the reply's num-steps says how many
UNAVAILABLE = 1000  # Error code of a client that declines work (the client-side availability gate)

# message type of the round-end broadcast (FedAWE's postponed broadcast)
ADOPT = "train.adopt"
# message type of the server's question "which client are you?" (client_app.dropin.identity answers)
IDENTITY_QUERY = "query.identity"

# metrics a training reply carries
CLIENT_ID = "client-id"
NUM_EXAMPLES = "num-examples"
NUM_STEPS = "num-steps"
A_NORM = "a-norm"
TRAIN_LOSS = "train-loss"
LR = "lr"  # the local learning rate the client used this round
TRAIN_TIME = "train-time"  # seconds of local training (only with node config report-timing=true)

# metrics an evaluate reply carries (Flower's templates say eval_loss, eval_acc: strategies.metrics)
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-accuracy"

# FedAWE (strategies.rules.fedawe, client_app.fedawe): config and reply keys
FEDAWE_RULE = "fedawe"  # the client rule's name (config ``client-rule``)
FEDAWE_SERVER_LR = "fedawe-server-lr"  # config: η_g, applied by the client in its echo
FEDAWE_SEND_UPDATE = "fedawe-send-update"  # config: also reply u_i = (t − τ_i) Δ_i (server clip)
FEDAWE_RUN_KEY = "fedawe-run-key"  # config: names this run's client-held state
FEDAWE_META_PREFIX = "fedawe."  # reply array keys with this prefix are metadata, not the model
FEDAWE_ECHO_FACTOR = "fedawe.echo-factor"  # reply: t − τ_i, shape (1,)
FEDAWE_UPDATE_PREFIX = "fedawe.update."  # reply: + model key -> that array's u_i
FEDAWE_RUN_KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # safe in a file name
FEDAWE_ECHO = "fedawe-echo"  # config: False = no echo (factor 1): FedPBC's client rule
FEDPBC_CATCH_UP = "fedpbc-catch-up"  # config: True = a returning client first trains the rounds it missed

# SCAFFOLD and Amplified SCAFFOLD (strategies.scaffold, client_app.scaffold): config and keys
SCAFFOLD_RULE = "scaffold"  # client rule: c_i kept by the client, drift-corrected local steps
AMPLIFIED_SCAFFOLD_RULE = "amplified-scaffold"  # ... c_i refreshed once per participation period
CORRECTED_RULES = (SCAFFOLD_RULE, AMPLIFIED_SCAFFOLD_RULE)  # client rules that change every local step
SCAFFOLD_RUN_KEY = "scaffold-run-key"  # config: names this run's client-held control variates
SCAFFOLD_META_PREFIX = "scaffold."  # array keys with this prefix are not the model
SCAFFOLD_C_PREFIX = "scaffold.c."  # train message: + model key -> the server's control variate c
SCAFFOLD_DC_PREFIX = "scaffold.dc."  # reply: + model key -> Δc_i = c_i^+ − c_i
SCAFFOLD_GAMMA = "scaffold-gamma"  # config: γ (local steps use η_l / γ; 1 for SCAFFOLD)
SCAFFOLD_PERIOD = "scaffold-period"  # config: P (c_i refreshed once per P rounds; 1 for SCAFFOLD)

# secure aggregation (spec option secure=secagg+: strategies.secure, client_app.secure): train config
SECURE_FACTORS = "secure-factors"  # per client id: the factor f_i a client multiplies its update by before masking
SECURE_EXAMPLE_SCALE = "secure-example-scale"  # > 0: also multiply by num-examples / this (data-size weights)
SECURE_CLIP_NORM = "secure-clip-norm"  # the client clips ‖Δ_i‖₂ to this before scaling (the norm bound, moved)
SECURE_CLIPPING_RANGE = "secure-clipping-range"  # SecAgg+'s per-entry range: a client refuses an entry beyond it


def server_round_of(content: Any) -> int | None:
    """The 1-based round a message's content names (a flwr RecordDict; ``server-round`` in any of its ConfigRecords:
    the project's strategies and Flower's own set it), or None for a message of no round."""
    for record in content.config_records.values():
        if SERVER_ROUND in record:
            return int(record[SERVER_ROUND])
    return None
