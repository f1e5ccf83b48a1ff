"""TEST-ONLY: a ClientApp that starts slowly, as on a machine too busy to import it in time.

Python imports ``sitecustomize`` at start-up from the first PYTHONPATH entry that has one; the
deployment tests put this folder on the PYTHONPATH of chosen SuperNodes only (``node_env``), so
it loads in their ``flwr-clientapp`` processes and nowhere else. There it sleeps
``FLCHURN_TEST_CLIENTAPP_DELAY`` seconds before Flower runs: the ClientApp's first heartbeat comes
that much later after its task was claimed (what a starved import does).
"""

import os
import sys
import time

if os.path.basename(sys.argv[0] if sys.argv else "") == "flwr-clientapp":
    time.sleep(float(os.environ.get("FLCHURN_TEST_CLIENTAPP_DELAY", "0")))
