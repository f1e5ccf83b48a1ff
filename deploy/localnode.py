"""One SuperNode of a :class:`deploy.local.ProcessSite`: its partition, its Runtime API port (held
while it runs), its process, the next incarnation booted ahead (:mod:`deploy.boot`) and the Flower
node ids it registered under."""

from __future__ import annotations

from dataclasses import dataclass, field

from .procs import PortReservation, Proc


@dataclass
class Node:
    partition: int
    port: int
    proc: Proc | None = None
    reservation: PortReservation | None = None  # its Runtime API port, held until it stops
    node_ids: list[int] = field(default_factory=list)  # one per incarnation, once registered
    booted: Proc | None = None  # its next incarnation, started ahead and not connected (deploy.boot)
    incarnations: int = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.alive

    def reserve_port(self) -> None:
        """A fresh Runtime API port, held while the node runs: nobody else gets it."""
        self.reservation = PortReservation.replacing(self.reservation)
        self.port = self.reservation.port
