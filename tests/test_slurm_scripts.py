"""launch/slurm/*.sbatch run as Slurm would run them, with stand-ins for srun, scontrol and the
launchers on PATH: the command each node gets (parsed by the real launchers' own argument parsers),
the hostfile, and when the job requeues itself."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

SCRIPTS = REPO / "launch/slurm"
HOSTS = ["gpu07", "gpu08"]
JOB_ID = 4242

FAKE_SRUN = """#!/bin/bash
# srun: the task once per node, each with its SLURM_NODEID; the highest exit code, as srun returns
echo "$*" >> "$FAKE_LOG/srun"
while [[ $1 == -* ]]; do shift; done
highest=0
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node "$@"
    code=$?
    ((code > highest)) && highest=$code
done
exit $highest
"""
FAKE_SCONTROL = """#!/bin/bash
case $1 in
    show) [[ $2 == hostnames && $3 == "$SLURM_JOB_NODELIST" ]] && printf "%s\\n" $FAKE_HOSTS ;;
    requeue) echo "$2" >> "$FAKE_LOG/requeue" ;;
    requeuehold | update | release) echo "$*" >> "$FAKE_LOG/held" ;;
esac
"""
FAKE_LAUNCHER = """#!/bin/bash
# a launcher: its arguments, one a line, and the exit code this node is told to give
printf "%s\\n" "$@" > "$FAKE_LOG/$(basename "$0").$SLURM_NODEID"
echo "$NCCL_DEBUG $TORCH_NCCL_ASYNC_ERROR_HANDLING" > "$FAKE_LOG/env.$SLURM_NODEID"
code=FAKE_EXIT_$SLURM_NODEID
[[ -n ${FAKE_UNHEALTHY:-} ]] && printf "%s" "$FAKE_UNHEALTHY" > "$RUN_DIR/unhealthy.json"  # the run named a node
exit ${!code:-0}
"""


def submit(
    tmp_path: Path, script: str, exits=(0, 0), restarts: int = 0, unhealthy: dict | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the batch script as the batch step of a 2-node job with 4 GPUs per node."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(exist_ok=True)
    log.mkdir(exist_ok=True)
    for name, text in [
        ("srun", FAKE_SRUN),
        ("scontrol", FAKE_SCONTROL),
        ("torchrun", FAKE_LAUNCHER),
        ("deepspeed", FAKE_LAUNCHER),
    ]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "FAKE_HOSTS": " ".join(HOSTS),
        "SLURM_JOB_ID": str(JOB_ID),
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_CPUS_ON_NODE": "64",
        "SLURM_RESTART_COUNT": str(restarts),
        "RUN_DIR": str(tmp_path / "run"),
        **{f"FAKE_EXIT_{n}": str(code) for n, code in enumerate(exits)},
        **({"FAKE_UNHEALTHY": json.dumps(unhealthy)} if unhealthy else {}),
    }
    result = subprocess.run(
        ["bash", str(SCRIPTS / script), "configs/clip/demo.yaml", "train.max_steps=7"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result, log


def training_command(tmp_path: Path) -> list[str]:
    """What each node's launcher is to start for `submit`'s job: the training script, the config, the override given
    to the batch script and those the script adds (its run folder, resuming)."""
    run_dir = tmp_path / "run"
    return [
        "launch/train.py",
        "--config",
        "configs/clip/demo.yaml",
        "train.max_steps=7",
        f"run.output_dir={run_dir}",
        "run.resume=auto",
    ]


def node_arguments(log: Path, launcher: str) -> list[list[str]]:
    return [(log / f"{launcher}.{node}").read_text().splitlines() for node in range(len(HOSTS))]


@pytest.mark.parametrize("script", ["torchrun.sbatch", "deepspeed.sbatch", "common.sh"])
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_torchrun_script_starts_one_torchrun_per_node_with_its_node_rank(tmp_path):
    from torch.distributed.run import get_args_parser

    result, log = submit(tmp_path, "torchrun.sbatch")
    assert result.returncode == 0, result.stdout + result.stderr
    for node, arguments in enumerate(node_arguments(log, "torchrun")):
        args = get_args_parser().parse_args(arguments)
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", node, "4")
        assert (args.master_addr, args.master_port, args.rdzv_backend) == (HOSTS[0], 20000 + JOB_ID, "static")
        assert [args.training_script, *args.training_script_args] == training_command(tmp_path)
    assert (log / "env.1").read_text().split() == ["WARN", "1"]
    srun_options = set((log / "srun").read_text().split())
    assert {"--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=64"} <= srun_options
    assert not (log / "requeue").exists()


def test_deepspeed_script_writes_the_hostfile_and_starts_one_launcher_per_node(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile, parse_args

    result, log = submit(tmp_path, "deepspeed.sbatch")
    assert result.returncode == 0, result.stdout + result.stderr
    for node, arguments in enumerate(node_arguments(log, "deepspeed")):
        args = parse_args(arguments)
        assert (args.no_ssh, args.node_rank, args.master_addr, args.master_port) == (
            True,
            node,
            HOSTS[0],
            20000 + JOB_ID,
        )
        assert dict(fetch_hostfile(args.hostfile)) == dict.fromkeys(HOSTS, 4)  # in node order
        assert [args.user_script, *args.user_args] == training_command(tmp_path)


@pytest.mark.parametrize(
    "script, exits, restarts, requeued, code",
    [
        ("deepspeed.sbatch", (75, 1), 0, True, 0),  # the watchdog stopped a hang: restart
        ("deepspeed.sbatch", (0, 1), 0, True, 0),  # a rank crashed or its node went away: restart
        ("deepspeed.sbatch", (1, 3), 0, False, 3),  # a data error stops the same way again: end
        ("deepspeed.sbatch", (2, 2), 0, False, 2),  # so does a config error
        ("deepspeed.sbatch", (75, 1), 3, False, 1),  # MAX_REQUEUES (3) restarts already
        ("torchrun.sbatch", (1, 1), 0, True, 0),  # torchrun says 1 for any failure: restart
        ("torchrun.sbatch", (1, 1), 3, False, 1),
    ],
)
def test_job_requeues_itself_only_when_a_restart_can_help(tmp_path, script, exits, restarts, requeued, code):
    result, log = submit(tmp_path, script, exits=exits, restarts=restarts)
    assert result.returncode == code, result.stdout + result.stderr
    assert (log / "requeue").exists() == requeued, result.stdout
    if requeued:
        assert (log / "requeue").read_text().split() == [str(JOB_ID)]


@pytest.mark.parametrize("script, exits", [("deepspeed.sbatch", (0, 76)), ("torchrun.sbatch", (1, 1))])
def test_a_stop_on_an_unhealthy_rank_requeues_the_job_without_its_node(tmp_path, script, exits):
    report = {"step": 5, "action": "stop", "nodes": ["gpu08"], "ranks": [{"rank": 5, "node": "gpu08"}]}
    result, log = submit(tmp_path, script, exits=exits, unhealthy=report)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "without node(s) gpu08" in result.stdout
    assert (log / "held").read_text().splitlines() == [
        f"requeuehold {JOB_ID}",
        f"update JobId={JOB_ID} ExcNodeList=gpu08",
        f"release {JOB_ID}",
    ]
    assert not (log / "requeue").exists()
    archived = tmp_path / f"run/slurm/unhealthy-{JOB_ID}-0.json"
    assert json.loads(archived.read_text()) == report and not (tmp_path / "run/unhealthy.json").exists()
    # the next stop names another node: both stay excluded
    result, log = submit(tmp_path, script, exits=exits, restarts=1, unhealthy={**report, "nodes": ["gpu07"]})
    assert f"update JobId={JOB_ID} ExcNodeList=gpu07,gpu08" in (log / "held").read_text()


def test_a_report_that_only_warned_requeues_as_before(tmp_path):
    report = {"step": 5, "action": "warn", "nodes": ["gpu08"], "ranks": []}
    result, log = submit(tmp_path, "deepspeed.sbatch", exits=(0, 1), unhealthy=report)
    assert result.returncode == 0 and (log / "requeue").exists() and not (log / "held").exists(), result.stdout
