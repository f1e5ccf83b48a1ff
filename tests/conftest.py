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
