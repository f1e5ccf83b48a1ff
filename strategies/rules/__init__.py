"""The aggregation rules, one module per rule (or family of variants).

Every module here is imported by :mod:`strategies.registry`, and every
:class:`~strategies.base.AvailabilityStrategy` subclass with a ``name`` in it is registered: a new
rule is one new module in this folder. The plumbing the rules share (the Flower adapter, reply
parsing, bounds, state) stays one level up, in :mod:`strategies`.
"""
