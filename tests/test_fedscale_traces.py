"""FedScale's own trace files (pickled dicts, written here in FedScale's layout): the restricted
reader, the text form both ways, and the mapping onto the devices file and trace-intervals."""

from __future__ import annotations

import json
import math
import pickle
from collections import OrderedDict
from fractions import Fraction

import numpy as np
import pytest

from availability import build_schedule
from virtualtime import ProfileError, fedscale, read_profiles, read_trace
from virtualtime.__main__ import main

CAPACITY = {1: {"computation": 153.0, "communication": 2276.0},
            2: {"computation": 61.5, "communication": 13320.5},
            3: {"computation": 420.25, "communication": 850.0}}
BEHAVIOUR = {
    1: {"duration": 3000, "inactive": [1000, 5000], "finish_time": 6000, "active": [0, 3000], "model": "SM-G930F"},
    2: {"duration": 1500, "inactive": [2500], "finish_time": 3000, "active": [1000], "model": "Pixel 2"},
    3: {"duration": 0, "inactive": [], "finish_time": 6000, "active": [], "model": "iPhone"},
}


def _pickle(path, obj, protocol=pickle.HIGHEST_PROTOCOL):
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_reads_both_traces_as_fedscale_writes_them(tmp_path, protocol):
    kind, doc = fedscale.read_pickle(_pickle(tmp_path / "cap", CAPACITY, protocol))
    assert (kind, doc) == (fedscale.CAPACITY, CAPACITY)
    kind, doc = fedscale.read_pickle(_pickle(tmp_path / "beh", BEHAVIOUR, protocol))
    assert (kind, doc) == (fedscale.BEHAVIOUR, BEHAVIOUR)
    # the device reader the deploy CLI and classes_from_trace use takes the pickle too
    assert read_trace(tmp_path / "cap") == {"1": (153.0, 2276.0), "2": (61.5, 13320.5), "3": (420.25, 850.0)}


@pytest.mark.parametrize("bad", [OrderedDict(a=1),            # a class: collections.OrderedDict
                                 {1: {"computation": np.float64(3.0), "communication": 5.0}},  # a NumPy scalar
                                 {1: Fraction(1, 3)}])
def test_a_pickle_with_a_non_plain_object_is_refused_before_it_is_built(tmp_path, bad):
    path = _pickle(tmp_path / "bad", bad)
    with pytest.raises(ProfileError, match=r"refused: the pickle needs the global \w+"):
        fedscale.load_plain_pickle(path)


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = _pickle(tmp_path / "evil", {1: Evil()})
    with pytest.raises(ProfileError, match="builtins.open|io.open"):
        fedscale.load_plain_pickle(path)
    assert not marker.exists()


@pytest.mark.parametrize(("doc", "match"), [
    ({1: {"computation": 0.0, "communication": 5.0}}, "'computation' must be a finite number > 0"),
    ({1: {"computation": 3.0}}, "needs 'computation'"),
    ({1: {"active": [0, 10], "inactive": [5], "finish_time": 20}}, "same length"),
    ({1: {"active": [0, 4], "inactive": [5, 8], "finish_time": 20}}, "interval 1"),
    ({1: {"active": [0], "inactive": [25], "finish_time": 20}}, "after its finish_time"),
    ([1, 2], "neither a client_device_capacity"),
])
def test_malformed_traces_name_the_client_and_field(tmp_path, doc, match):
    with pytest.raises(ProfileError, match=match):
        fedscale.read_pickle(_pickle(tmp_path / "t", doc))
    (tmp_path / "junk").write_bytes(b"\x80\x04junk")
    with pytest.raises(ProfileError, match="not a readable pickle"):
        fedscale.read_pickle(tmp_path / "junk")


@pytest.mark.parametrize("doc", [CAPACITY, BEHAVIOUR, {"u7": {"computation": 1.5, "communication": 9.0, "x": None}}])
def test_convert_round_trip_pickle_text_pickle_is_exact(tmp_path, doc, capsys):
    src = _pickle(tmp_path / "trace", doc)
    assert main(["convert", str(src), str(tmp_path / "trace.jsonl")]) == 0
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["fedscale"] == fedscale.kind_of(doc)
    assert [json.loads(line)["client"] for line in lines[1:]] == list(doc)  # ids keep their type and order
    assert main(["convert", str(tmp_path / "trace.jsonl"), str(tmp_path / "back")]) == 0
    back = pickle.loads((tmp_path / "back").read_bytes())
    assert back == doc and list(back) == list(doc)
    assert all(type(a) is type(b) for a, b in zip(back, doc, strict=True))


def test_text_form_errors_exit_2_with_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"fedscale": "client_device_capacity", "version": 1}\n{"client": 1, "computation": 2}\n')
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert "client 1: needs 'computation' (ms per sample) and 'communication'" in capsys.readouterr().err
    bad.write_text('{"fedscale": "client_device_capacity", "version": 1}\n{"computation": 2}\n')
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert "line 2: expected an object with a 'client' id" in capsys.readouterr().err
    src = _pickle(tmp_path / "cap", CAPACITY)
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "intervals", "--nodes", "2"]) == 2
    assert "needs a client_behave_trace" in capsys.readouterr().err


def test_behaviour_maps_to_trace_intervals_as_fedscale_reads_it(tmp_path, capsys):
    src = _pickle(tmp_path / "beh", BEHAVIOUR)
    out = tmp_path / "iv.json"
    assert main(["convert", str(src), str(out), "--to", "intervals", "--nodes", "4"]) == 0
    doc = json.loads(out.read_text())
    # node i is FedScale's client i + 1 -> keys[(i + 1) % 3] = 2, 3, 1, 2; period 6000 (longest finish_time);
    # client 2's 3000 s cycle repeats twice in it
    assert doc["period"] == 6000
    assert doc["clients"] == {"0": [[1000, 2500], [4000, 5500]], "1": [], "2": [[0, 1000], [3000, 5000]],
                              "3": [[1000, 2500], [4000, 5500]]}
    schedule = build_schedule(f"trace-intervals:path={out},round_seconds=1", 4, 0)
    keys = list(BEHAVIOUR)

    def fedscale_active(entry, t):  # FedScale's ClientMetadata.is_active (closed), without its cursor
        tau = t % entry["finish_time"]
        return any(a <= tau <= b for a, b in zip(entry["active"], entry["inactive"], strict=True))

    for t in range(125, 13000, 250):  # off the interval ends, where closed and half-open differ
        expect = [fedscale_active(BEHAVIOUR[keys[(i + 1) % 3]], t) for i in range(4)]
        assert list(schedule.available(t)) == expect, t


def test_behaviour_with_cycles_that_do_not_divide_the_period_says_so(tmp_path, capsys):
    doc = {1: {"active": [0], "inactive": [100], "finish_time": 400},
           2: {"active": [50], "inactive": [250], "finish_time": 300}}
    src = _pickle(tmp_path / "beh", doc)
    assert main(["convert", str(src), str(tmp_path / "iv.json"), "--to", "intervals", "--nodes", "2"]) == 0
    assert "1 of 2 clients have a finish_time that does not divide the period 400 s" in capsys.readouterr().err
    iv = json.loads((tmp_path / "iv.json").read_text())["clients"]
    assert iv == {"0": [[50, 250], [350, 400]], "1": [[0, 100]]}  # node 0 = key 2 (cut at 400), node 1 = key 1


def test_capacity_maps_to_a_devices_file_with_fedscale_job_times(tmp_path, capsys):
    src = _pickle(tmp_path / "cap", CAPACITY)
    out = tmp_path / "devices.toml"
    assert main(["convert", str(src), str(out), "--to", "devices", "--nodes", "3", "--batch-size", "20"]) == 0
    plan = read_profiles(out, 3)
    # node i looks up key (i + 1) % 3 as FedScale's aggregator does: 1, 2, then 0 (absent: the 0th in order)
    for node, key in [(0, 1), (1, 2), (2, 1)]:
        dc = plan.profile_of(node)
        assert math.isclose(dc.step_ms, 3 * 20 * CAPACITY[key]["computation"])
        assert dc.up_kbps == dc.down_kbps == round(CAPACITY[key]["communication"])
    assert main(["convert", str(src), str(out), "--to", "devices", "--nodes", "3", "--classes", "3"]) == 0
    classes = read_profiles(out, 3).classes
    speeds = sorted(dc.speed or 1.0 for dc in classes)
    assert speeds == pytest.approx([61.5 / 420.25, 61.5 / 153.0, 1.0], rel=1e-3)
