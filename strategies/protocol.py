"""The message protocol between strategies and the ClientApp: config and metric keys.

Pure constants, importable by the ClientApp without pulling in the strategies.
"""

import re

# config sent with every round message
SERVER_ROUND = "server-round"  # Flower's 1-based round
IGNORE_AVAILABILITY = "ignore-availability"  # True: an oracle round that must reach every client
CLIENT_RULE = "client-rule"  # which client-side behaviour to run (see client_app.rules)
PLAIN_RULE = "plain"  # the client rule of every strategy but FedAWE: train from the received model
PROBE_BATCHES = "probe-batches"  # evaluate on this many mini-batches only (0 = all data)

# message type of the round-end broadcast (FedAWE's postponed broadcast)
ADOPT = "train.adopt"

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
