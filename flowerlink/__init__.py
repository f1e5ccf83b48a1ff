"""Every touch of Flower's internals, in one place (:mod:`flowerlink.internals`).

The project uses Flower's public API (``flwr.app``, ``flwr.serverapp``, ``flwr.clientapp``) everywhere
else. What Flower does not offer publicly, and the project needs, goes through the functions of
:mod:`flowerlink.internals`, each checked by ``tests/test_flower_internals.py`` against the
installed Flower (a change in Flower fails that test loudly, naming the touch), and each listed
in ``docs/flower-versions.md``. Imports nothing of ours.
"""

from .internals import (
    TOUCHES,
    cap_supernode_sleeps,
    control_client,
    flower_entry_point,
    guard_ray_actor_pool,
    is_http_grid,
    ray_actor_node,
    recorddict_from_bytes,
    recorddict_to_bytes,
    run_flower_superlink,
    run_flower_supernode,
    set_message_id,
    set_task_heartbeat_window,
    set_task_identity,
    task_identity,
    unavailable_node_reply,
    wrap_http_grid_object_pulls,
)

__all__ = ["TOUCHES", "cap_supernode_sleeps", "control_client", "flower_entry_point", "guard_ray_actor_pool",
           "is_http_grid", "ray_actor_node", "recorddict_from_bytes", "recorddict_to_bytes",
           "run_flower_superlink", "run_flower_supernode", "set_message_id", "set_task_heartbeat_window",
           "set_task_identity", "task_identity", "unavailable_node_reply", "wrap_http_grid_object_pulls"]
