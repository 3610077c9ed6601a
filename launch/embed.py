"""The `mmpt-embed` command as a file, for a checkout: see `mmpt/commands/embed.py`."""

import sys

from mmpt.commands.embed import run

if __name__ == "__main__":
    sys.exit(run())
