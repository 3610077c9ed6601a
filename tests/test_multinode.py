"""Several nodes on one machine: each node is its own launcher process (torchrun, or the deepspeed
launcher with `--no_ssh --node_rank i`), all meeting at 127.0.0.1, so LOCAL_RANK, the ranks per node
(LOCAL_WORLD_SIZE / LOCAL_SIZE) and the node rank (GROUP_RANK / CROSS_RANK) are the launchers' own.

One run directory goes through four launches of a tiny M²-Encoder whose GBA-ITC loss gathers in
`group_size: auto` groups, two steps each:

    torchrun 2 nodes x 2 -> deepspeed 1 node x 2 -> deepspeed 2 nodes x 1 -> deepspeed 2 nodes x 2

so both launchers train on 2 nodes x 2 ranks, and the run resumes from 2 nodes on 1 (4 ranks to 2, through
DeepSpeed's universal checkpoint) and from 1 node on 2 (exactly), then grows back to 4 ranks.
Every rank records its first loss call and the weights it started from (tests/multinode_train.py):
the loss is checked against a per-node loss computed here from the recorded features, the weights
against those the launch before ended with.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from multinode_train import LAUNCHER_VARIABLES
from safetensors.torch import load_file

from conftest import (
    REPO,
    adam_state,
    free_port,
    launcher_env,
    read_metrics,
    run_on_gloo_ranks,
    tiny_config,
    tiny_m2_arch,
    write_config,
)

pytestmark = pytest.mark.distributed

WORKER = REPO / "tests/multinode_train.py"
PER_RANK_BATCH, STEPS_PER_LAUNCH = 4, 2
ARCH = tiny_m2_arch()
# (launcher, nodes, ranks per node), in the order they continue one run
LAUNCHES = [("torchrun", 2, 2), ("deepspeed", 1, 2), ("deepspeed", 2, 1), ("deepspeed", 2, 2)]
LAUNCH_TIMEOUT = 600  # seconds; a launch takes under a minute on an idle 2-core machine
STALE_LAUNCHER_VARIABLES = (*LAUNCHER_VARIABLES, "MASTER_ADDR", "MASTER_PORT")  # none may leak from this process


def m2_config(digits_root: Path, run_dir: Path) -> dict:
    cfg = tiny_config(digits_root, run_dir, train={"save_every": STEPS_PER_LAUNCH, "keep_last": 2, "log_every": 1})
    cfg["method"] = {
        "name": "m2_encoder",
        "model": "m2-encoder-demo",
        "arch": ARCH,
        "tokenizer": str(digits_root / "tokenizer.json"),
        "loss": {"group_size": "auto"},
        "augment": {"hflip": False, "randaugment": False},
    }
    cfg["data"]["train"]["batch_size"] = PER_RANK_BATCH
    return cfg


def node_commands(launcher: str, nodes: int, per_node: int, folder: Path, script_args: list[str]) -> list[list[str]]:
    """One launcher command per node, all on this machine; rank 0's node listens on a free port."""
    port = str(free_port())
    meet = ["--master_addr", "127.0.0.1", "--master_port", port, *script_args]  # every node at rank 0's port
    if launcher == "torchrun":
        return [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--node_rank",
                str(node),
                "--nproc_per_node",
                str(per_node),
                *meet,
            ]
            for node in range(nodes)
        ]
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    if nodes == 1:  # the everyday single-machine command: no hostfile
        return [[deepspeed, "--num_gpus", str(per_node), "--master_port", port, *script_args]]
    # Without a hostfile the deepspeed runner knows one host only (and refuses --num_nodes 2); its names are
    # just keys here, as --no_ssh starts nothing remotely.
    hostfile = folder / "hostfile"
    hostfile.write_text("".join(f"node{n} slots={per_node}\n" for n in range(nodes)))
    return [
        [
            deepspeed,
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            "--node_rank",
            str(node),
            "--num_nodes",
            str(nodes),
            "--num_gpus",
            str(per_node),
            *meet,
        ]
        for node in range(nodes)
    ]


def run_nodes(commands: list[list[str]], env: dict, logs: Path, timeout: float = LAUNCH_TIMEOUT) -> list[str]:
    """Start every node's launcher, wait for all; if one fails or time runs out, stop them all and fail
    with each node's output tail. Returns each node's output."""
    logs.mkdir(parents=True, exist_ok=True)
    paths = [logs / f"node{n}.log" for n in range(len(commands))]
    processes = []
    for command, path in zip(commands, paths):
        with path.open("w") as out:
            processes.append(
                subprocess.Popen(
                    command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p in processes):
            if any(p.returncode not in (None, 0) for p in processes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        for process in processes:
            if process.poll() is None:
                stop_tree(process)
    outputs = [path.read_text(errors="replace") for path in paths]
    codes = [p.returncode for p in processes]
    if timed_out or any(codes):
        tails = "\n".join(
            f"--- node {n} (exit {code}) ---\n{out[-3000:]}" for n, (code, out) in enumerate(zip(codes, outputs))
        )
        reason = f"timed out after {timeout} s" if timed_out else "a node failed"
        pytest.fail(f"{reason}: {commands}\n{tails}")
    return outputs


def stop_tree(process: subprocess.Popen) -> None:
    """TERM the launcher's process group (launchers pass it on to their workers), then KILL what is left,
    workers included: torchrun starts them in sessions of their own."""
    try:
        workers = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)
    for worker in workers:
        try:
            worker.kill()  # psutil makes sure the pid still names the same process
        except psutil.NoSuchProcess:
            pass


def node_env(record_dir: Path) -> dict:
    env = launcher_env()
    for name in STALE_LAUNCHER_VARIABLES:
        env.pop(name, None)
    record_dir.mkdir(parents=True)
    env["MMPT_RECORD_DIR"] = str(record_dir)
    return env


@pytest.fixture(scope="module")
def launches(module_tmp, digits_root):
    """The launches of one run: [(launcher, nodes, ranks per node, records by rank, output)], run dir."""
    folder = module_tmp("multinode")
    run_dir = folder / "run"
    config = write_config(folder / "cfg.yaml", m2_config(digits_root, run_dir))
    done = []
    for index, (launcher, nodes, per_node) in enumerate(LAUNCHES):
        step = STEPS_PER_LAUNCH * (index + 1)
        here = folder / f"launch{index}"
        args = [str(WORKER), "--config", str(config), f"train.max_steps={step}"]
        here.mkdir()
        outputs = run_nodes(
            node_commands(launcher, nodes, per_node, here, args), node_env(here / "records"), here / "logs"
        )
        records = [torch.load(here / f"records/rank{r}.pt", weights_only=True) for r in range(nodes * per_node)]
        records[0]["final_weights"] = load_file(str(run_dir / "model.safetensors"))  # the next launch replaces it
        done.append((launcher, nodes, per_node, records, "\n".join(outputs)))
    return done, run_dir


def test_each_node_launcher_gives_its_ranks_the_node_layout(launches):
    """Ranks are numbered node after node; LOCAL_RANK, the ranks per node and the node rank are the launcher's."""
    for launcher, nodes, per_node, records, _ in launches[0]:
        for rank, record in enumerate(records):
            env, node = record["env"], rank // per_node
            assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (
                str(rank),
                str(nodes * per_node),
                str(rank % per_node),
            ), (launcher, env)
            if launcher == "torchrun":
                assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (str(per_node), str(node)), env
            else:
                assert (env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == (
                    str(per_node),
                    str(node),
                    str(nodes),
                ), env
        identities = [r["node"] for r in records]  # what the node-layout check sees: one per node
        by_node = [set(identities[n * per_node : (n + 1) * per_node]) for n in range(nodes)]
        assert all(len(one) == 1 for one in by_node) and len(set(identities)) == nodes, (launcher, identities)


def per_node_losses(records: list[dict], per_node: int) -> list[float]:
    """Each rank's GBA-ITC loss with features gathered over its node only, written out from the definition:
    the node's rows in rank order, a full logit matrix, cross-entropy both ways, averaged."""
    losses = []
    for first in range(0, len(records), per_node):
        members = records[first : first + per_node]
        images = torch.cat([r["image"] for r in members]).double()
        texts = torch.cat([r["text"] for r in members]).double()
        logits = members[0]["scale"].double() * images @ texts.T
        for offset, record in enumerate(members):
            rows = torch.arange(len(record["image"])) + offset * len(record["image"])
            losses.append(0.5 * (F.cross_entropy(logits[rows], rows) + F.cross_entropy(logits.T[rows], rows)).item())
    return losses


def test_auto_groups_are_the_nodes_and_the_loss_is_per_node(launches):
    for launcher, nodes, per_node, records, _ in launches[0]:
        world = nodes * per_node
        assert [r["group"] for r in records] == [
            list(range(r - r % per_node, r - r % per_node + per_node)) for r in range(world)
        ], (launcher, nodes, per_node)
        assert len({float(r["scale"]) for r in records}) == 1  # one logit scale, as the reference assumes
        expected = per_node_losses(records, per_node)
        got = [r["loss"] for r in records]
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), (launcher, nodes, per_node)
        if nodes > 1 and per_node > 1:  # the check tells node groups from a single world group
            everyone = per_node_losses(records, world)
            assert max(abs(a - b) for a, b in zip(everyone, got)) > 0.05, (everyone, got)


def test_the_run_resumes_across_node_counts_and_ends_at_max_steps(launches):
    done, run_dir = launches
    records = [r for r in read_metrics(run_dir) if "loss/total" in r]
    last_step = STEPS_PER_LAUNCH * len(LAUNCHES)
    # Each launch logged only its own steps: a resume that restarted from 0 or skipped ahead shows here.
    assert [r["step"] for r in records] == list(range(1, last_step + 1))
    # Samples consumed keep adding up over every layout (per-rank batch x ranks per step), so the data
    # position and its counts came through each resume, the re-sharded ones included.
    expected_seen, seen = [], 0
    for _, nodes, per_node, _, _ in done:
        for _ in range(STEPS_PER_LAUNCH):
            seen += PER_RANK_BATCH * nodes * per_node
            expected_seen.append(seen)
    assert [r["data/seen"] for r in records] == expected_seen
    assert all(
        len(r["step_time_per_rank"]) == n * k
        for r, (_, n, k, _, _) in zip(records, [launch for launch in done for _ in range(STEPS_PER_LAUNCH)])
    )
    for index, (launcher, nodes, per_node, _, output) in enumerate(done[1:], start=1):
        previous = done[index - 1]
        resumed = f"at step {STEPS_PER_LAUNCH * index}"
        assert resumed in output, (launcher, output[-3000:])
        if previous[1] * previous[2] != nodes * per_node:  # another world size: universal checkpoint, re-sharded
            assert f"saved by {previous[1] * previous[2]} ranks x 1 workers, on {nodes * per_node} x 1" in output
            assert (run_dir / f"checkpoints_universal/step_{STEPS_PER_LAUNCH * index:09d}").is_dir()
    # Each launch started from the weights the one before ended with (an un-loaded model would start from
    # the seeded initial weights instead), through the universal checkpoint too.
    for (launcher, _, _, records, _), (_, _, _, before, _) in zip(done[1:], done):
        start, end = records[0]["weights"], before[0]["final_weights"]
        assert start and set(start) <= set(end)
        moved = max((start[name] - end[name]).abs().max().item() for name in start)
        assert moved < 1e-6, (launcher, moved)
    first = done[0][3][0]
    assert max((first["weights"][n] - first["final_weights"][n]).abs().max().item() for n in first["weights"]) > 1e-4
    # Adam's state went through every resume: one count per optimizer step since the start.
    assert adam_state(run_dir, last_step)[0] == last_step
    assert (run_dir / "checkpoints/latest").read_text() == f"step_{last_step:09d}"


# The node-layout check, on spawned gloo ranks that pretend to run on the nodes their variables say.


def check_groups_for_a_pretended_layout(rank, node_ranks, per_node, explicit_size):
    from mmpt import distributed as mdist
    from mmpt.distributed import NodeLayoutError

    os.environ.update(GROUP_RANK=str(node_ranks[rank]), LOCAL_WORLD_SIZE=str(per_node))
    os.environ.pop("CROSS_RANK", None)
    if explicit_size:  # a size the user chose may span nodes: no check
        group = mdist.contiguous_group(explicit_size)
        assert group is None or torch.distributed.get_process_group_ranks(group) == [0, 1]
        return
    try:
        mdist.contiguous_group(mdist.local_world_size())
    except NodeLayoutError as error:
        assert "ranks numbered node after node" in str(error), error
        assert "/node0: ranks 0; " in str(error) and "/node1: ranks 1;" in str(error), error
        return
    raise AssertionError(f"per-node groups of {per_node} formed over ranks on nodes {node_ranks}")


def check_per_node_groups_on_one_rank_nodes(rank):
    from mmpt import distributed as mdist

    os.environ.update(GROUP_RANK=str(rank), LOCAL_WORLD_SIZE="1")
    group = mdist.contiguous_group(mdist.local_world_size())
    assert torch.distributed.get_process_group_ranks(group) == [rank]


def test_per_node_groups_that_would_span_nodes_are_refused():
    """Two ranks on two nodes that claim 2 ranks per node: `auto` would gather across nodes, so it stops;
    an explicit group size spanning the nodes and true one-rank nodes pass."""
    run_on_gloo_ranks(
        __name__,
        [
            ("check_groups_for_a_pretended_layout", ([0, 1], 2, None)),
            ("check_groups_for_a_pretended_layout", ([0, 1], 2, 2)),
            ("check_per_node_groups_on_one_rank_nodes", ()),
        ],
        world=2,
    )


@pytest.mark.parametrize(
    "nodes, per_node, layout, error",
    [
        (["a", "a", "b", "b"], [2] * 4, "a: ranks 0-1; b: ranks 2-3", None),
        (["a"] * 4, [4] * 4, "a: ranks 0-3", None),
        (["a", "b", "a", "b"], [2] * 4, "a: ranks 0,2; b: ranks 1,3", "ranks numbered node after node"),  # round-robin
        (["a", "a", "b", "b"], [1] * 4, "a: ranks 0-1; b: ranks 2-3", "ranks numbered node after node"),  # too small
        (["a", "a", "b", "b"], [4] * 4, "a: ranks 0-1; b: ranks 2-3", "ranks numbered node after node"),  # world size
        (["a", "a", "a", "b"], [3, 3, 3, 1], "a: ranks 0-2; b: ranks 3", "ranks report [1, 3] ranks on their node"),
    ],
)
def test_node_major_check(nodes, per_node, layout, error):
    """The layout is named either way; an error when a node's ranks are not one block of the common size."""
    from mmpt.distributed import NodeLayoutError, check_node_major

    if error is None:
        assert check_node_major(list(zip(nodes, per_node))) == layout
    else:
        with pytest.raises(NodeLayoutError, match=re.escape(error)) as raised:
            check_node_major(list(zip(nodes, per_node)))
        assert layout in str(raised.value)
