"""Every rule declares its state; the base checkpoints it under one layout; reports read it
through the rule; checkpoints of the previous layout still load; the wire protocol stays light."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from replies import run_round

from strategies import ORACLES, STRATEGIES, build_strategy

ROOT = Path(__file__).resolve().parent.parent
N = 4


def build(name):
    extra = {"probabilities": lambda t: np.full(N, 0.5)} if name in ORACLES else {}
    return build_strategy(name, num_clients=N, min_available_nodes=1, **extra)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_checkpoint_has_one_layout_and_the_rule_reads_its_declared_state(name):
    s = build(name)
    saved = s.state_dict()
    assert set(saved) == {"format", "rule", "rng", "identity", "bounds", "state"} and saved["rule"] == name
    cls = STRATEGIES[name]
    assert dataclasses.is_dataclass(cls.State)
    assert set(saved["state"]) == {f.name for f in dataclasses.fields(cls.State)}
    assert isinstance(cls.read_state(saved), cls.State)
    other = "fedavg-active" if name != "fedavg-active" else "mifa"
    with pytest.raises(ValueError, match=f"state of strategy '{other}'"):
        s.load_state_dict(build(other).state_dict())


def test_a_mifa_checkpoint_round_trip_keeps_the_table_and_the_binding():
    a = build("mifa")
    x = run_round(a, 1, np.zeros(2), {0: np.array([1.0, 0.0]), 2: np.array([0.0, 3.0])})
    b = build("mifa")
    b.load_state_dict(a.state_dict())
    assert b.node_of_client == a.node_of_client == {0: 100, 2: 102}
    np.testing.assert_array_equal(b.table.rows, a.table.rows)
    assert STRATEGIES["mifa"].read_state(a.state_dict()).table["seen"].tolist() == [True, False, True, False]
    assert (run_round(a, 2, x, {1: np.ones(2)}) == run_round(b, 2, x, {1: np.ones(2)})).all()


def format_1(**own):
    """A checkpoint as the code before the one layout wrote it: the base's keys at the top."""
    return {"rng": np.random.default_rng(7).bit_generator.state, "client_of_node": {100: 0},
            "node_of_client": {0: 100}, **own}


def test_checkpoints_of_the_previous_layout_load():
    R = np.full((N, N), 0.5)
    fdms = build("fl-fdms")
    fdms.load_state_dict(format_1(**{"fl-fdms": {"R": R, "count": np.ones((N, N), np.int64), "candidates": None}}))
    np.testing.assert_array_equal(fdms.R, R)
    assert fdms.node_of_client == {0: 100} and fdms.rng.random() == np.random.default_rng(7).random()
    assert STRATEGIES["fl-fdms"].read_state(format_1(**{"fl-fdms": {"R": R, "count": None,
                                                                    "candidates": None}})).R is R
    nova = build("fednova")
    nova.load_state_dict(format_1(buffer=np.ones(3)))
    np.testing.assert_array_equal(nova.buffer, np.ones(3))
    fedau = build("fedau")
    fedau.load_state_dict(format_1(fedau=None))  # saved before its first round
    assert fedau.count.tolist() == [0] * N


def test_a_checkpoint_of_another_rule_or_format_is_a_clear_error():
    with pytest.raises(ValueError, match="no 'fl-fdms' entry"):
        build("fl-fdms").load_state_dict(format_1(buffer=None))
    with pytest.raises(ValueError, match=r"lacks \['size_of', 'last_loss'\]"):
        build("pow-d").load_state_dict(format_1())
    with pytest.raises(ValueError, match="unknown strategy checkpoint format 9"):
        build("mifa").load_state_dict({**build("mifa").state_dict(), "format": 9})


def test_the_wire_protocol_and_the_weightings_import_no_rule_module():
    code = ("import sys, strategies.protocol, strategies.weighting; "
            "print(sorted(m for m in sys.modules if m.startswith('strategies')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "['strategies', 'strategies.protocol', 'strategies.weighting']"
