"""Edge emulation (opt-in, root for the limits): SuperNodes run under the CPU, memory and
network limits of device classes. Nothing outside this package imports it unless a site has
device classes (``ProcessSite(devices=...)``, ``python -m deploy launch --devices``, ``python -m
deploy devices | compose-devices``). Arrows point down the list and out to :mod:`deploy`'s
lower modules (``errors``, ``procs``, ``tuning``), never to the deployed round:

- ``devices``: device classes from TOML or a FedScale-style trace (:class:`devices.DevicePlan`),
  the host check;
- ``cgroups``, ``netns``: one node's CPU/memory cgroup, its network namespace + veth + tbf;
- ``relay``: a TCP relay that adds RTT and loss where netem is missing;
- ``sysctls``: the host's IP forwarding, read at setup and restored at close;
- ``limits``: :class:`limits.EdgeLimits`, all nodes' limits (made, entered before exec, removed);
- ``calibrate``: seconds per local step, run under a class's limits;
- ``figures``: :class:`figures.DeviceFigures`, calibration, per-round cgroup samples, ``devices.csv``;
- for the compose stack: ``composedevices`` (the override, ``python -m deploy compose-devices``)
  and ``edgenode`` (the in-container entrypoint, ``python -m deploy.edge.edgenode``).
"""
