"""The `mmpt-supervise` command as a file, for a checkout: see `mmpt/commands/supervise.py`."""

import sys

from mmpt.commands.supervise import main

if __name__ == "__main__":
    sys.exit(main())
