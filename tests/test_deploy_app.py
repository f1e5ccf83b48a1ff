"""``python -m deploy launch --app``'s path for a Flower app that is not the project's: Flower's
advanced-pytorch example (examples/advanced-pytorch-flchurn) deployed as a SuperLink and 4
SuperNode processes, its SuperNodes stopped and restarted by the schedule, the rounds known from
the example's own wrapper (server_app.dropin), realised participation = the schedule."""

import shutil

import pytest
from conftest import DATA_DIR, ROOT

from availability import build_schedule

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="no flower-superlink on PATH"),
              pytest.mark.skipif(not (DATA_DIR / "fashion-mnist").is_dir(), reason="no offline Fashion-MNIST")]
EXAMPLE = ROOT / "examples" / "advanced-pytorch-flchurn"
ROUNDS, SPEC, SEED = 3, "bernoulli:p=0.5", 3  # seed 3: clients on 1111, 0011, 1011


def test_a_foreign_app_deployed_with_churn_follows_the_schedule(tmp_path):
    from deploy.app import app_run
    from deploy.local import ProcessSite
    from deploy.run import run_deployment

    overrides = {"num-server-rounds": ROUNDS, "strategy": "fedau", "availability": SPEC, "schedule-seed": SEED,
                 "data-dir": str(DATA_DIR), "results-dir": str(tmp_path / "results"), "max-examples": 1000}
    plan = app_run(EXAMPLE, overrides, 4, SPEC, SEED, tmp_path)
    with ProcessSite(4, tmp_path / "work", project=EXAMPLE, server_env=plan.server_env()) as site:
        site.start_superlink()
        out = run_deployment(site, overrides, churn="rounds", app=plan, timeout=1200)
    assert out.completed, out.status
    schedule = build_schedule(SPEC, 4, SEED).matrix(ROUNDS)
    assert [r["participants"] for r in out.rows] == [[c for c in range(4) if row[c]] for row in schedule]
    assert out.report is not None and not out.report.failures, out.report.failure_text()
