"""Real deployment: SuperLink + N SuperNodes (processes on loopback, or the compose stack's
containers), and the churn driver that stops and starts them so that the connected nodes follow
the availability schedule. One job per module; arrows point down the list, never back:

- ``errors``: :class:`DeployError`;
- ``procs``: free ports, tagged processes, children, kill; :class:`procs.Spawner` leaves nothing behind;
- ``flwr_cli``: the ``flwr`` CLI (``config.toml``, submit, status, log, Flower's JSON);
- ``tuning``: round-latency settings applied to every SuperNode, the host's CPUs;
- ``warmstart``: a returning node's client worker started with the node, before its Flower imports;
- ``submission``: the submitted run config, its folder, its schedule, resume and latest checkpoint;
- ``follow``: tails the run folder (``config.json``, ``metrics.jsonl``);
- ``auth``: Flower's ``401 task-token authentication failed`` (a lost reply) counted from the logs and named;
- ``nodes``: the :class:`nodes.Nodes` protocol (start/stop/signal/running/registered id) and
  :class:`nodes.Site` (nodes + their SuperLink);
- ``local`` (processes: :class:`local.ProcessSite`) and ``containers`` (Docker: ``DockerNodes``,
  ``ComposeSite``): the two implementations;
- across hosts: ``hosts`` (the hosts file, parsed and checked), ``identity`` (the CA, the SuperLink's
  certificate, one key per client, never in the checkout), ``hostengine`` (the :class:`hostengine.HostEngine`
  protocol one host's engine implements), its engines ``processengine`` (processes in a host's network
  namespace), ``dockerengine`` (a host's Docker engine, over ``dockerapi``) and ``k8sengine`` (a
  Kubernetes cluster's Deployments), and ``multihost`` (:class:`multihost.MultiHostSite`: the SuperLink
  here, TLS and authentication, a worker and a probe a host); ``k8s`` (``python -m deploy k8s``: the
  manifests);
- ``churn``: :class:`churn.RoundChurn` / :class:`churn.WallClockChurn`, typed against ``Nodes``;
  ``async_churn``: :class:`async_churn.AggregationChurn`, round churn for asynchronous rules (aggregations);
- ``participation``: the participation report (pure); ``realised``: per-client statuses and
  the realised trace (pure);
- ``run``: :func:`run.run_deployment`, one run on any ``Site``;
- ``record``: :func:`record.run_recorded`, a process run plus its per-client files
  (``clients.jsonl``, ``realised-trace.csv``);
- ``launch`` (``python -m deploy launch``) and ``churn_service`` (``python -m deploy churn``, the
  compose stack's churn service); ``cli``: every command's arguments (``python -m deploy``);
- ``edge/``: edge emulation (device classes, cgroups, namespaces, relay, calibration, the
  compose override and the in-container entrypoint), imported only with device classes.

A deployed round: ``launch`` starts a :class:`ProcessSite` and calls :func:`record.run_recorded`
and so :func:`run.run_deployment`, which builds the run config (``submission``), lets ``churn``
start the round-1 nodes, submits through ``flwr_cli``, then steps the driver as ``follow`` sees
each round's line in ``metrics.jsonl`` (stopping the nodes off in the next round, starting the
returning ones), and at the end compares who replied with the schedule (``participation``).
``churn_service`` does the same on containers.

The package imports nothing itself: every SuperNode starts as ``python -m deploy.tuning``, which
imports this package first, and must stay light (no torch). Import the modules:
``from deploy.local import ProcessSite``, ``from deploy.run import run_deployment``.

CLI: ``python -m deploy launch --num-nodes 4 | --hosts hosts.toml --run-config "..." [--churn]
[--churn-mode term|kill] [--resume-from CKPT|RUN_DIR] [--keep-workdir]``; after the run it compares participation with the
schedule and exits 1 when it departs beyond the timing slack.
"""
