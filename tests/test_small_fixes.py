"""The small items of a researcher's run: one ``results:`` line, no empty ``checkpoints/``, a
report's Regenerate note that says where its commands run, and a study's seeds that own the three
seed keys."""

from __future__ import annotations

import json
import shutil

import pytest
from extension_fixtures import MYEXT

from experiments import once
from experiments.report import regenerate_from, write_report
from experiments.studyfile import StudyError, load_study

RUN = ["num-clients=3", "num-server-rounds=2", "local-steps=steps:n=1", "model=logreg", "availability=always",
       "progress=false"]


def test_once_prints_results_once_and_checkpoint_every_0_makes_no_checkpoints_folder(tmp_path, capsys):
    assert once.main([*RUN, "checkpoint-every=0", f"results-dir={tmp_path}", "run-name=plain"]) == 0
    out = capsys.readouterr().out
    assert out.count("results: ") == 1 and str(tmp_path / "plain") in out
    assert (tmp_path / "plain" / "metrics.jsonl").is_file() and not (tmp_path / "plain" / "checkpoints").exists()
    assert once.main([*RUN, "checkpoint-every=1", f"results-dir={tmp_path}", "run-name=quiet", "--quiet"]) == 0
    assert capsys.readouterr().out.count("results: ") == 1
    assert sorted(p.name for p in (tmp_path / "quiet" / "checkpoints").iterdir()) == ["round-0001.pt", "round-0002.pt"]


def test_the_regenerate_note_says_where_the_commands_run(tmp_path):
    assert regenerate_from(str(MYEXT / "study.toml")) == "from the repository root"
    assert regenerate_from("fednova") == "from the repository root"
    outside = tmp_path / "mine.toml"
    shutil.copy(MYEXT / "study.toml", outside)
    note = regenerate_from(str(outside))
    assert "repository root" not in note and "folder the sweep was started in" in note and str(outside) in note
    write_report(load_study(str(outside)), tmp_path / "nothing", tmp_path / "r", study=str(outside))
    assert json.loads((tmp_path / "r.json").read_text())["regenerate-from"] == note  # what render prints
    assert "module importable" in regenerate_from("mypkg.studies:MINE")


@pytest.mark.parametrize("where", ["[base]\ndata-seed = 3\n", "[axes.seed]\na = { train-seed = 1 }\n"])
def test_a_study_cannot_set_the_seeds_its_seeds_set(tmp_path, where):
    path = tmp_path / "seeded.toml"
    path.write_text(f"seeds = [0, 1]\n[axes.rule]\nf = {{ strategy = 'mifa' }}\n{where}")
    with pytest.raises(StudyError, match=r"which the study's seeds set: each seed s of `seeds` runs with data-seed"):
        load_study(str(path))
