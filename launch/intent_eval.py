"""The `mmpt-intent-eval` command as a file, for a checkout: see `mmpt/commands/intent_eval.py`."""

import sys

from mmpt.commands.intent_eval import run

if __name__ == "__main__":
    sys.exit(run())
