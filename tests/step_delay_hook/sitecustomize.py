"""TEST-ONLY slowed node for deployment tests: never on the import path of a real run.

Python imports ``sitecustomize`` at start-up from the first PYTHONPATH entry that has one; the
straggler test puts this folder on the PYTHONPATH of one SuperNode only (``node_env``, with
``FLCHURN_TEST_STEP_DELAY`` = seconds), so its processes (the ClientApp's and the node's
long-lived worker, which inherit the environment) load it. When such a process imports
``workloads.solvers``, every local step (``solver_step``) first sleeps that long: a device that
trains slower than the others, without root (no CPU cgroup). Without the variable it does nothing.
"""

import importlib.abc
import os
import sys
import time

DELAY = float(os.environ.get("FLCHURN_TEST_STEP_DELAY", "0") or 0)


class _SlowSteps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "workloads.solvers":
            return None
        for finder in sys.meta_path:
            if finder is not self and (spec := finder.find_spec(name, path, target)) is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            step = module.solver_step

            def slow_step(*args, **kwargs):
                time.sleep(DELAY)
                return step(*args, **kwargs)

            module.solver_step = slow_step
            print(f"step-delay hook: {DELAY} s per local step", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


if DELAY > 0:
    sys.meta_path.insert(0, _SlowSteps())
