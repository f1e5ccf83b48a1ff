"""``python -m deploy launch --app``'s path for a Flower app that is not the project's: Flower's
advanced-pytorch example (examples/advanced-pytorch-flchurn) deployed as a SuperLink and 4
SuperNode processes, its SuperNodes stopped and restarted by the schedule, the rounds known from
the example's own wrapper (server_app.dropin), realised participation = the schedule."""

import os
import shutil

import pytest
from conftest import DATA_DIR, ROOT, extra_deploy

from availability import build_schedule

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="no flower-superlink on PATH"),
              pytest.mark.skipif(not (DATA_DIR / "fashion-mnist").is_dir(), reason="no offline Fashion-MNIST")]
EXAMPLE = ROOT / "examples" / "advanced-pytorch-flchurn"
ROUNDS, SPEC, SEED = 3, "bernoulli:p=0.5", 3  # seed 3: clients on 1111, 0011, 1011


@extra_deploy("Flower's advanced-pytorch example deployed as processes under churn (~185 s on an idle 2-core "
              "machine, 259-347 s in full suites: a ClientApp process per message, each importing torch)",
              "tests/test_example_advanced.py (the same example and wrapper under flwr run) and the process "
              "deployments under churn of tests/test_deploy.py and tests/test_multihost.py")
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


SECURE = ROOT / "examples" / "flower-secure-aggregation-flchurn"


@pytest.mark.skipif(not (DATA_DIR / "cifar10").is_dir(), reason="no offline CIFAR-10")
@pytest.mark.skipif(not os.environ.get("FLCHURN_EXTRA_DEPLOY_TESTS"), reason="a 4-10 minute SecAgg+ deployment: "
                    "opt-in with FLCHURN_EXTRA_DEPLOY_TESTS=1 (CI's time budget; SecAgg+ under churn is tested in "
                    "simulation by tests/test_churn_workflows.py and under flwr run by test_example_churn_apps.py)")
def test_secagg_deployed_with_churn_completes_the_rounds_above_threshold(tmp_path):
    """Flower's SecAgg+ example (DefaultWorkflow + SecAggPlusWorkflow, a client_fn app) deployed with
    churn, 5 SuperNodes, seed 7 (4, 1 and 3 clients online): rounds 1 and 3 complete with exactly
    the online clients; round 2 (one client, below SecAgg+'s 2) is recorded with no participants,
    and the participation report says so (a failed round, not completed work)."""
    from deploy.app import app_run
    from deploy.local import ProcessSite
    from deploy.run import run_deployment

    spec, seed = "bernoulli:p=0.6", 7
    overrides = {"num-server-rounds": ROUNDS, "is-demo": False, "availability": spec, "schedule-seed": seed,
                 "data-dir": str(DATA_DIR), "results-dir": str(tmp_path / "results"), "max-examples": 500}
    plan = app_run(SECURE, overrides, 5, spec, seed, tmp_path)
    with ProcessSite(5, tmp_path / "work", project=SECURE, server_env=plan.server_env()) as site:
        site.start_superlink()
        out = run_deployment(site, overrides, churn="rounds", app=plan, timeout=1200)
    assert out.completed, out.status
    schedule = build_schedule(spec, 5, seed).matrix(ROUNDS)
    online = [[c for c in range(5) if row[c]] for row in schedule]
    assert [r["participants"] for r in out.rows] == [online[0], [], online[2]]
    assert out.report is not None and [r.round for r in out.report.failures] == [2], out.report.failure_text()
