"""The `mmpt-export` command as a file, for a checkout: see `mmpt/commands/export.py`."""

import sys

from mmpt.commands.export import run

if __name__ == "__main__":
    sys.exit(run())
