"""The run-config sections that the ClientApp, the ServerApp and the deployment tools all read.

(The server's own section, ``ServerConfig``, is in ``server_app.config``.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import check


@dataclass(frozen=True)
class WorkloadConfig:
    """What a client and the server both need to rebuild the same data, model and training."""

    dataset: str = "digits"
    data_dir: str = ""  # where offline files live ("" = none; digits/synthetic/quadratic need none)
    download: bool = False  # fetch through torchvision when online and files are missing
    partition: str = "dirichlet:alpha=0.5"
    num_clients: int = 20
    data_seed: int = 0
    model: str = "cnn"
    train_seed: int = 0  # model init, batch order, local-epoch draws
    local_steps: str = "steps:n=10"  # or "epochs:min=2,max=5"
    batch_size: int = 32
    lr: float = 0.05
    lr_schedule: str = "constant"  # "inv-sqrt", "step:gamma=0.1,every=100", "exp:gamma=0.998", "cosine:rounds=T"
    solver: str = "sgd"  # "momentum", "prox", or the user's "module:Class[:k=v]"
    momentum: float = 0.0
    prox_mu: float = 0.0
    weight_decay: float = 0.0
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda", "cuda:1", "mps"
    state_dir: str = ""  # where clients keep their own state across restarts ("" = in memory)
    evaluation: str = ""  # the server's own metrics besides loss and accuracy: "module:function[:k=v]"

    def validate(self) -> WorkloadConfig:
        check(self.num_clients >= 1, "num-clients", self.num_clients, ">= 1")
        check(self.batch_size >= 1, "batch-size", self.batch_size, ">= 1")
        check(self.lr > 0, "lr", self.lr, "> 0")
        check(0 <= self.momentum < 1, "momentum", self.momentum, "[0, 1)")
        check(self.prox_mu >= 0, "prox-mu", self.prox_mu, ">= 0")
        check(self.weight_decay >= 0, "weight-decay", self.weight_decay, ">= 0")
        return self


AVAILABILITY_GATES = ("server", "client", "none")


@dataclass(frozen=True)
class AvailabilityConfig:
    """Which schedule decides who is online, and who enforces it in simulation.

    ``server``: the ServerApp's availability layer never delivers messages to offline clients
    (their replies never come). ``client``: every message is delivered and an offline client
    declines with an "unavailable" error reply, as a device that refuses work would.
    ``none``: nothing is filtered: in a real deployment the churn driver stops and starts the
    SuperNode processes, so the unavailable clients are really gone.
    """

    availability: str = "sine:gamma=0.3,period=20"
    schedule_seed: int = 0
    availability_gate: str = "server"

    def validate(self) -> AvailabilityConfig:
        check(self.availability_gate in AVAILABILITY_GATES, "availability-gate",
              self.availability_gate, f"one of {AVAILABILITY_GATES}")
        return self
