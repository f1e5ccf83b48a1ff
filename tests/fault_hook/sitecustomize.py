"""TEST-ONLY fault injection for deployment tests: never on the import path of a real run.

Python imports ``sitecustomize`` at start-up from the first PYTHONPATH entry that has one; the
deployment tests put this folder on the PYTHONPATH of chosen SuperNodes only (``node_env``), so
it loads in their ``flwr-clientapp`` processes and nowhere else. There it reads the node-config
key ``test-fault`` (set with ``ProcessSite(node_config_extra={i: {"test-fault": "KIND@ROUND"}})``)
and corrupts that node's TRAIN reply of server round ROUND:

- ``nan@R``: every array value NaN (same keys and shapes);
- ``huge@R``: every array value 1e20 (finite in float32, an absurd update norm).

Without this folder on the PYTHONPATH the key is inert: the ClientApp never reads it.
"""

import os
import sys


def _runs_clientapps() -> bool:
    """A ``flwr-clientapp`` process, or a tuned SuperNode, whose forks are its ClientApps (deploy.prefork)."""
    argv = open("/proc/self/cmdline", "rb").read().split(b"\0")
    clientapp = os.path.basename(argv[1] if len(argv) > 1 else b"") == b"flwr-clientapp"
    return clientapp or argv[1:4] == [b"-m", b"deploy.tuning", b"supernode"]


if _runs_clientapps():
    import numpy as np
    from flwr.app import Array, ArrayRecord
    from flwr.clientapp import ClientApp

    FILL = {"nan": np.nan, "huge": 1e20}
    _call = ClientApp.__call__

    def __call__(self, message, context):
        reply = _call(self, message, context)
        try:
            kind, _, rnd = str(context.node_config.get("test-fault", "")).partition("@")
            cfg = message.content.config_records.get("config", {})
            if (kind in FILL and message.metadata.message_type == "train" and reply.has_content()
                    and int(cfg.get("server-round", -1)) == int(rnd)):
                arrays = reply.content["arrays"]  # same keys and shapes, corrupted values
                reply.content["arrays"] = ArrayRecord(
                    {k: Array(np.full_like(v.numpy(), FILL[kind])) for k, v in arrays.items()})
                print(f"test-fault: {kind} reply in round {rnd}", file=sys.stderr)
        except Exception as err:  # never break the node because of the test hook
            print("test-fault hook failed:", err, file=sys.stderr)
        return reply

    ClientApp.__call__ = __call__
