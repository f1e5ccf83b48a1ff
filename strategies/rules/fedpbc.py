"""FedPBC: federated learning with postponed broadcast.

Xiang, Ioannidis, Su and Yau (arXiv 2306.00280, "Towards Bias Correction of FedAvg over
Nonuniform and Time-Varying Communications"), Alg. 1; official code mingxiang12/FedPBC
(``varying_pbc.py``). Every client keeps its own model x_i (x^0 at start). In round t:

    x_i ← x_i + η_g (x_i^{t,end} − x_i)            (s local steps from x_i; i ∈ A_t)
    x^{t+1} = (1/|A_t|) Σ_{i∈A_t} x_i,              then x_i ← x^{t+1} for i ∈ A_t only

(the postponed broadcast: the new model reaches only the clients whose links were up, after the
round; nothing is broadcast at a round's start). It is FedAWE (Xiang et al., NeurIPS 2024) with
every echo factor 1, so it reuses FedAWE's server side and client rule (config
``fedawe-echo = false``): the client's own copy, its state dir, the round-end ``train.adopt``.

Paper and code vs. here: in the code every client, linked or not, runs its local steps every
round (``for n in range(num_clients)``: the unlinked ones keep training their own copy); here a
client that is unavailable is unreachable and does not train (FedAWE's echo is the correction
for exactly that). The code evaluates the mean of all clients' copies (``w_eval``), offered here
as the ``xbar`` evaluation (as for FedAWE), and decays the local lr as η_0/√(t/50 + 1) with t
counted in local steps (5 per round).

The code's step, in two versions: the first commit (2f364b4, 2024-03-23) has
``w_tmp += (w_tmp - w_local[n]) * lr_global``, i.e. x_i ← x_i^{t,end} + η_g (x_i^{t,end} − x_i) =
x_i + (1 + η_g)(x_i^{t,end} − x_i): at its default ``--lr-global 1`` each round's change counts
twice. The "minor fix" commit (2f6770c, 2024-04-15, the code's HEAD) made it
``w_tmp = w_local[n] + (w_tmp - w_local[n]) * lr_global``, the paper's step above, which is the
default here (``code_step = "fixed"``). ``code_step = "first-commit"`` runs the first commit's step
(the server's effective η_g becomes 1 + η_g, sent to the clients and used in FedAWE's checks).
"""

from __future__ import annotations

from typing import Any

from ..protocol import FEDAWE_ECHO, FEDAWE_ECHO_FACTOR, FEDPBC_CATCH_UP
from .fedawe import ClientReport, FedAWE, ReplyRejected


class FedPBC(FedAWE):
    """FedPBC (Xiang et al., arXiv 2306.00280, Alg. 1): x^{t+1} = mean_{A_t} x_i, postponed broadcast.

    FedAWE's server side with the echo factor fixed to 1 (a reply with another factor is
    rejected); ``clip`` (FedAWE's code option) stays available, off by default.

    Parameters
    ----------
    catch_up : the official code's offline computation: a client that comes back after missing
        rounds first runs the local steps of each missed round on its own copy (as the code's
        unlinked clients do every round), then this round's. The global model is then the code's
        exactly (a client's copy does not depend on the server while it is away); the cost is
        the missed rounds' local work, done on return. False (the default): the paper's
        description as this project can run it, only reachable clients train.
    code_step : "fixed" (default: the paper's step and the code's HEAD) or "first-commit" (the
        code's first published step, x_i + (1 + η_g)(x_i^{t,end} − x_i); module docstring).
    """

    name = "fedpbc"

    def __init__(self, *, catch_up: bool = False, code_step: str = "fixed", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if code_step not in ("fixed", "first-commit"):
            raise ValueError(f"fedpbc: code-step={code_step!r} is not one of 'fixed', 'first-commit'")
        if code_step == "first-commit" and catch_up:
            raise ValueError("fedpbc: code-step=first-commit and catch-up=true: the catch-up trains the missed "
                             "rounds in a row (the fixed step at η_g = 1); use one of them")
        if code_step == "first-commit":
            self.server_lr = 1.0 + self.server_lr  # x_i + (1 + η_g)(x_i^{t,end} − x_i), the first commit's step
        self.code_step = code_step
        if catch_up and self.server_lr != 1.0:
            raise ValueError(f"fedpbc: catch-up=true needs server_lr = 1 (the official code applies η_g to "
                             f"every round's local change, missed rounds included), got {self.server_lr}")
        self.catch_up = bool(catch_up)

    def client_config(self) -> dict[str, Any]:
        return {**super().client_config(), FEDAWE_ECHO: False, FEDPBC_CATCH_UP: self.catch_up}

    def _echo_factor(self, report: ClientReport) -> int:
        factor = super()._echo_factor(report)
        if factor != 1:
            raise ReplyRejected(f"'{FEDAWE_ECHO_FACTOR}'={factor}: FedPBC's clients do not echo (factor 1)")
        return factor

