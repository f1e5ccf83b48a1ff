"""Real deployment: SuperLink + N SuperNodes as processes on loopback, and the churn driver that
stops and starts them so the connected nodes follow the availability schedule.

- :class:`deploy.launch.Deployment`: owns the processes (context manager; nothing outlives it);
- :func:`deploy.launch.run_deployment`: one run end to end (nodes, ``flwr run``, churn, wait);
- :class:`deploy.churn.RoundChurn` / :class:`deploy.churn.WallClockChurn`: the churn drivers.

CLI: ``python -m deploy launch --num-nodes 4 --run-config "..." [--churn] [--churn-mode term|kill]
[--resume-from CKPT|RUN_DIR] [--keep-workdir]``; after the run it compares participation with the
schedule and exits 1 when it departs beyond the timing slack.
"""

from .launch import COMPLETED, DeployError, Deployment, Outcome, run_deployment

__all__ = ["COMPLETED", "DeployError", "Deployment", "Outcome", "run_deployment"]
