"""The `mmpt-zeroshot` command as a file, for a checkout: see `mmpt/commands/zeroshot.py`."""

import sys

from mmpt.commands.zeroshot import run

if __name__ == "__main__":
    sys.exit(run())
