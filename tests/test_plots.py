"""The run's plots: whole-number ticks, participants next to accuracy, the schedule next to who replied."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from server_app.results import accuracy_figure, participation_figure, plot_run  # noqa: E402


def visible_ticks(axis):
    lo, hi = sorted(axis.get_view_interval())
    return [t for t in axis.get_majorticklocs() if lo - 1e-9 <= t <= hi + 1e-9]


def assert_integer_ticks(axis):
    ticks = visible_ticks(axis)
    assert ticks, "no ticks"
    assert all(float(t).is_integer() for t in ticks), ticks


def synthetic(num_clients, num_rounds, seed=0):
    rng = np.random.default_rng(seed)
    schedule = rng.random((num_rounds, num_clients)) < 0.4
    realised = schedule & (rng.random((num_rounds, num_clients)) < 0.9)
    rows = [{"round": t + 1, "participants": np.flatnonzero(realised[t]).tolist(),
             "test-accuracy": 0.1 + 0.8 * t / num_rounds} for t in range(num_rounds)]
    return rows, realised, schedule


@pytest.mark.parametrize(("num_clients", "num_rounds"), [(4, 3), (4, 12), (1000, 300)])
def test_accuracy_figure_has_integer_rounds_and_the_participants_per_round(num_clients, num_rounds):
    rows, realised, _ = synthetic(num_clients, num_rounds)
    rows[1]["test-accuracy-xbar"] = 0.5  # an extra model's curve (FedAWE's x̄) is drawn too
    fig = accuracy_figure(rows, num_clients)
    top, bottom = fig.axes
    for axis in (top.xaxis, bottom.xaxis, bottom.yaxis):
        assert_integer_ticks(axis)
    assert {line.get_label() for line in top.get_lines()} == {"test-accuracy", "test-accuracy-xbar"}
    heights = [bar.get_height() for bar in bottom.patches]
    assert heights == realised.sum(axis=1).tolist()  # one bar per round: how many replied
    assert bottom.get_ylabel() == "participants"
    plt.close(fig)


@pytest.mark.parametrize(("num_clients", "num_rounds"), [(4, 3), (4, 12), (1000, 300)])
def test_participation_figure_shows_the_schedule_next_to_the_realised_matrix(num_clients, num_rounds):
    _, realised, schedule = synthetic(num_clients, num_rounds)
    fig = participation_figure(realised, schedule)
    left, right = fig.axes
    assert "schedule" in left.get_title() and "realised" in right.get_title()
    np.testing.assert_array_equal(left.images[0].get_array(), schedule.T)
    np.testing.assert_array_equal(right.images[0].get_array(), realised.T)
    for ax in (left, right):
        assert_integer_ticks(ax.xaxis)
        assert_integer_ticks(ax.yaxis)
        assert len(visible_ticks(ax.yaxis)) <= 12  # no per-client labels at 1000 clients
        assert min(visible_ticks(ax.yaxis)) >= 0 and max(visible_ticks(ax.yaxis)) <= num_clients - 1
        assert min(visible_ticks(ax.xaxis)) >= 1 and max(visible_ticks(ax.xaxis)) <= num_rounds
    plt.close(fig)


def test_plot_run_writes_both_images(tmp_path):
    rows, realised, schedule = synthetic(4, 5)
    plot_run(tmp_path, rows, realised, schedule)
    for name in ("accuracy.png", "participation.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
