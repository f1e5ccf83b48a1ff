"""The client rules this ClientApp knows, by name (config ``client-rule``): the registry.

Each implements :class:`client_app.client_rule.ClientRule` (its module says what the members
are): ``plain`` (:class:`~client_app.client_rule.PlainRule`: train from the received model) and
the rules whose clients keep state: FedAWE's and FedPBC's (``client_app.fedawe``: the kept copy,
the echo, the catch-up), SCAFFOLD's and Amplified SCAFFOLD's (``client_app.scaffold``: the
control variate and the corrected steps). The project's ClientApp (``client_app.app``), the
cohort engine and the drop-in mod (``client_app.dropin``) look a message's rule up here and call
only the protocol's members.
"""

from __future__ import annotations

from .client_rule import ClientRule, PlainRule
from .fedawe import FedAWERule
from .scaffold import AmplifiedScaffoldRule, ScaffoldRule

CLIENT_RULES: dict[str, ClientRule] = {rule.name: rule for rule in (
    PlainRule(), FedAWERule(), ScaffoldRule(), AmplifiedScaffoldRule())}


def client_rule(name: str) -> ClientRule:
    if name not in CLIENT_RULES:
        raise ValueError(f"unknown client rule {name!r}; this ClientApp knows {sorted(CLIENT_RULES)}")
    return CLIENT_RULES[name]
