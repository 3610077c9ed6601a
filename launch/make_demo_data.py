"""The `mmpt-make-demo-data` command as a file, for a checkout: see `mmpt/commands/make_demo_data.py`."""

import sys

from mmpt.commands.make_demo_data import main

if __name__ == "__main__":
    sys.exit(main())
