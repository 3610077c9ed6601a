"""The process group's timeout follows the hang watchdog, so the watchdog, not a collective, reports a hang."""

import json
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from conftest import REPO, launcher_env
from mmpt.distributed import UNWATCHED_GROUP_TIMEOUT, group_timeout
from mmpt.engine.watchdog import Watchdog

# A world of one started by the engine with a 5 s watchdog; prints the timeouts of the world group and of a group
# created after it without a timeout, as DeepSpeed creates its data-parallel copy of the world.
START = textwrap.dedent(
    """
    import importlib, json, torch, torch.distributed as dist
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no C++ build for one rank
    from mmpt.engine.run import start_process_group
    start_process_group(5.0)
    def seconds(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    print(json.dumps({"world": seconds(dist.group.WORLD), "later": seconds(dist.new_group([0]))}))
    """
)


def test_started_groups_wait_past_a_short_watchdog():
    env = {k: v for k, v in launcher_env().items() if k not in ("MASTER_PORT", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, "-c", START], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    timeouts = json.loads(result.stdout.strip().splitlines()[-1])
    expected = group_timeout(5.0).total_seconds()
    assert timeouts == {"world": expected, "later": expected}  # not torch's 30 minutes nor DeepSpeed's 10


@pytest.mark.parametrize("seconds", [1.0, 5.0, 60.0, 1800.0, 7200.0])
def test_group_timeout_outlasts_every_rank_s_watchdog(tmp_path, seconds):
    patience = [Watchdog(tmp_path, rank, 2, seconds) for rank in (0, 1)]
    for watchdog in patience:
        watchdog.close()
    longest = max(w.patience for w in patience)
    assert group_timeout(seconds) > timedelta(seconds=longest + 30)  # the watchdog's report has time to land


def test_unwatched_runs_keep_a_long_bound():
    assert group_timeout(0.0) == UNWATCHED_GROUP_TIMEOUT >= timedelta(hours=1)
