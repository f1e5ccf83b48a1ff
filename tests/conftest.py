import os

# one BLAS thread: on 2 shared cores, multi-threaded products collapse (measured 100x slower)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
from pathlib import Path

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("FLCHURN_DATA_DIR", ROOT.parent / "shared" / "data"))


# The files that take longest (CI's durations, minutes each: deployments, flwr run, Ray), heaviest
# first. With `-n 2 --dist loadfile` a file runs on one worker; xdist would send the files with the
# most tests first (its loadscope reorder, off in pyproject.toml), which left these few-test,
# long files for the end, one worker busy with them while the other idled. Started first, the
# many short files fill the other worker's time around them (longest processing time first).
LONGEST_FIRST = ("test_deploy.py", "test_runner.py", "test_multihost.py", "test_chaos.py", "test_stragglers.py",
                 "test_deploy_app.py", "test_ray_cluster.py", "test_busy_host.py", "test_example_advanced.py",
                 "test_example_app.py", "test_async.py", "test_studyfile.py", "test_worker.py", "test_extending.py",
                 "test_report.py", "test_engines.py", "test_sweep.py")


def pytest_collection_modifyitems(config, items):
    """The files of :data:`LONGEST_FIRST` first, in that order, then every other file with a
    ``slow`` test, then the rest (each file's own order kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    slow_files = {item.path.name for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank) + (item.path.name not in slow_files)))


@pytest.fixture(autouse=True, scope="session")
def _task_identity():
    """Building a flwr Message needs the process-global task identity the runtime sets."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = 1


def extra_deploy(what: str, covered_by: str) -> pytest.MarkDecorator:
    """Skip unless ``FLCHURN_EXTRA_DEPLOY_TESTS=1``: ``what`` costs CI's 30-minute budget more than it
    adds beside ``covered_by``, which runs the same path in CI (run by hand before a release)."""
    return pytest.mark.skipif(not os.environ.get("FLCHURN_EXTRA_DEPLOY_TESTS"),
                              reason=f"{what}: opt-in with FLCHURN_EXTRA_DEPLOY_TESTS=1 (CI's 30-minute budget; "
                                     f"in CI the same path runs in {covered_by})")
