"""``python -m deploy ...``: the commands of :mod:`deploy.cli`."""

import sys

from deploy.cli import main

if __name__ == "__main__":
    sys.exit(main())
