"""mmpt-supervise with a stand-in training command: restarts, and restarts without an unhealthy node."""

import json
import sys

import pytest

from mmpt.commands import supervise

FAKE_RUN = """
import json, os, sys
from pathlib import Path
run_dir, codes = Path(sys.argv[1]), sys.argv[2].split(",")
attempts = run_dir / "attempts"
with attempts.open("a") as out:
    out.write(json.dumps({"argv": sys.argv[3:], "excluded": os.environ.get("MMPT_EXCLUDED_NODES")}) + "\\n")
code = int(codes[len(attempts.read_text().splitlines()) - 1])
if code == 76:  # a stop on an unhealthy rank names its node, as mmpt.engine.resilience.health writes it
    node = "gpu0" + str(len(attempts.read_text().splitlines()))
    report = {"step": 5, "action": "stop", "nodes": [node], "ranks": [{"line": "slow collectives: rank 3 on " + node}]}
    (run_dir / "unhealthy.json").write_text(json.dumps(report))
sys.exit(code)
"""


def supervised(tmp_path, codes: str, *extra: str) -> tuple[int, list[dict]]:
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    command = [sys.executable, str(script), str(tmp_path), codes, *extra]
    code = supervise.main(["--max-restarts", "3", "--delay", "0", "--run-dir", str(tmp_path), "--", *command])
    attempts = [json.loads(line) for line in (tmp_path / "attempts").read_text().splitlines()]
    return code, attempts


@pytest.mark.launches  # supervise starts the stand-in command
def test_unhealthy_nodes_are_left_out_of_every_restart(tmp_path, capsys):
    code, attempts = supervised(tmp_path, "76,76,1,0")
    assert code == 0
    assert [a["excluded"] for a in attempts] == [None, "gpu01", "gpu01,gpu02", "gpu01,gpu02"]
    assert "unhealthy rank: slow collectives: rank 3 on gpu01" in capsys.readouterr().err
    assert (tmp_path / "unhealthy-0.json").exists() and not (tmp_path / "unhealthy.json").exists()


@pytest.mark.launches
def test_a_config_error_is_not_retried_and_a_warning_report_excludes_nothing(tmp_path):
    (tmp_path / "unhealthy.json").write_text(json.dumps({"action": "warn", "nodes": ["gpu09"], "ranks": []}))
    code, attempts = supervised(tmp_path, "1,2")
    assert code == 2 and [a["excluded"] for a in attempts] == [None, None]


@pytest.mark.parametrize(
    "command, expected",
    [
        (["deepspeed", "--hostfile", "h", "t.py"], ["deepspeed", "--exclude=a@b", "--hostfile", "h", "t.py"]),
        (["deepspeed", "--num_gpus", "2", "t.py"], ["deepspeed", "--num_gpus", "2", "t.py"]),  # one host: no hostfile
        (["torchrun", "t.py"], ["torchrun", "t.py"]),
    ],
)
def test_a_deepspeed_launcher_with_a_hostfile_is_told_to_exclude_the_nodes(command, expected):
    assert supervise.without_nodes(command, ["a", "b"]) == expected
