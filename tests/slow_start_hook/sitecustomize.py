"""TEST-ONLY: a ClientApp that starts slowly, as on a machine too busy to import it in time.

Python imports ``sitecustomize`` at start-up from the first PYTHONPATH entry that has one; the
deployment tests put this folder on the PYTHONPATH of chosen SuperNodes only (``node_env``), so
it loads in their processes and nowhere else. It sleeps ``FLCHURN_TEST_CLIENTAPP_DELAY`` seconds
before Flower's ``flwr-clientapp`` runs: in a started ``flwr-clientapp`` process at once, and in a
tuned SuperNode (``deploy.tuning supernode``) in each ``flwr-clientapp`` its forker forks
(``deploy.prefork``: the entry point it looks up is wrapped). The ClientApp's first heartbeat
comes that much later after its task was claimed (what a starved import does).
"""

import os
import time

DELAY = float(os.environ.get("FLCHURN_TEST_CLIENTAPP_DELAY", "0"))
_argv = open("/proc/self/cmdline", "rb").read().split(b"\0")

if os.path.basename(_argv[1] if len(_argv) > 1 else b"") == b"flwr-clientapp":
    time.sleep(DELAY)
elif _argv[1:4] == [b"-m", b"deploy.tuning", b"supernode"]:
    import flowerlink

    _entry_point = flowerlink.flower_entry_point

    def _slow_entry_point(command):
        entry = _entry_point(command)
        if command != "flwr-clientapp":
            return entry

        def slow():
            time.sleep(DELAY)
            return entry()

        return slow

    flowerlink.flower_entry_point = _slow_entry_point
