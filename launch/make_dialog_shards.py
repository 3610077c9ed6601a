"""The `mmpt-make-dialog-shards` command as a file, for a checkout: see `mmpt/commands/make_dialog_shards.py`."""

import sys

from mmpt.commands.make_dialog_shards import run

if __name__ == "__main__":
    sys.exit(run())
