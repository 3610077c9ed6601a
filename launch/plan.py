"""The `mmpt-plan` command as a file, for a checkout: see `mmpt/commands/plan.py`."""

import sys

from mmpt.commands.plan import run

if __name__ == "__main__":
    sys.exit(run())
