"""Faults injected into real 2-rank runs (deepspeed launcher, CPU): kills, hangs, stragglers, bad input."""

import io
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    REPO,
    adam_state,
    deepspeed_command,
    launcher_env,
    run_deepspeed,
    tiny_config,
    train_in_process,
    write_config,
)
from mmpt.config_loader import load_config
from pool import scenario

pytestmark = pytest.mark.distributed
STEPS = dict(zero_stage=2, max_steps=12, save_every=4, keep_last=5, log_every=1)


KILLED = {**STEPS, "max_steps": 20}


@scenario("faults-reference", first=True)  # the supervised run below starts fresh processes
def uninterrupted(corpora, run_dir):
    return tiny_config(corpora["digits"], run_dir, train=KILLED), [], "train"


@pytest.fixture
def reference(rank_pool):
    """An uninterrupted run's final weights (trained in the shared pool of ranks)."""
    return load_file(str(rank_pool.run_dir("faults-reference") / "model.safetensors"))


def supervised(config, faults_text: str, restarts: int) -> subprocess.CompletedProcess:
    env = dict(launcher_env(), **faults.environment(faults_text))
    command = [
        sys.executable,
        str(REPO / "launch/supervise.py"),
        "--max-restarts",
        str(restarts),
        "--delay",
        "0",
        "--",
        *deepspeed_command(config),
        *faults.ARGS,
    ]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)


# (fault, the checkpoint the restart after it resumes from: the newest complete one), in the order they fire
KILLS = [
    ("kill@forward,step=6,rank=1", 4),  # a rank dies mid-training
    ("kill@save:after_engine,step=8,rank=1", 4),  # ... while DeepSpeed writes the checkpoint
    ("kill@save:after_rank_state,step=12,rank=0", 8),  # ... after its own part, before the others finished
    ("kill@save:before_latest,step=16,rank=0", 16),  # ... after the checkpoint completed, before `latest` moved
]


@pytest.mark.pool("faults-reference")
def test_killed_run_restarts_and_ends_with_the_uninterrupted_weights(tmp_path, digits_root, reference):
    """One supervised run killed at four points, each once (a marker file each): every restart resumes from the
    newest complete checkpoint, and the run ends with the weights of one that was never killed."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, run_dir, train=KILLED))
    spec = ";".join(f"{fault},once={tmp_path / f'fired{i}'}" for i, (fault, _) in enumerate(KILLS))
    result = supervised(config, spec, restarts=len(KILLS))
    output = result.stderr + result.stdout
    assert result.returncode == 0, result.stderr[-3000:]
    assert all((tmp_path / f"fired{i}").exists() for i in range(len(KILLS)))
    assert f"restart {len(KILLS)} of {len(KILLS)}" in result.stderr
    resumed = re.findall(r"resumed from \S+/checkpoints/step_0*(\d+)", output)
    assert [int(step) for step in resumed] == [step for _, step in KILLS], resumed
    final = load_file(str(run_dir / "model.safetensors"))
    assert final.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(final[key], value), key


@scenario("faults-failed-write", fault="fail@save:after_engine,step=8,rank=1")
def failed_write(corpora, run_dir):
    return tiny_config(corpora["digits"], run_dir, train=STEPS), [], "train"


@pytest.mark.pool("faults-failed-write")
def test_a_rank_that_cannot_write_its_checkpoint_stops_every_rank(rank_pool):
    stops = rank_pool.record("faults-failed-write")["stops"]
    assert [code for _, code in stops] == [5, 5], stops  # the documented exit code of a checkpoint stop
    assert stops[0][0].startswith("checkpoint error: ") and "rank(s) [1] could not write their files" in stops[0][0]
    assert stops[1][0].startswith("rank 1: checkpoint error: ") and "OSError: injected write failure" in stops[1][0]
    checkpoints = rank_pool.run_dir("faults-failed-write") / "checkpoints"
    assert not (checkpoints / "step_000000008" / "complete.json").exists()
    assert (checkpoints / "latest").read_text() == "step_000000004"


def test_watchdog_names_the_sleeping_rank_and_exits(tmp_path, digits_root):
    config = write_config(
        tmp_path / "cfg.yaml",
        tiny_config(digits_root, tmp_path / "run", train={**STEPS, "watchdog_timeout": 5, "save_every": 0}),
    )
    env = dict(launcher_env(), **faults.environment("sleep=600@data,step=3,rank=1"))
    process = subprocess.Popen(
        deepspeed_command(config) + faults.ARGS,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = ""
    started = None
    for line in process.stdout:
        output += line
        if started is None and "step 2 " in line:  # logged just before rank 1 falls asleep
            started = time.monotonic()
    process.wait(timeout=300)
    assert process.returncode != 0
    assert started is not None and time.monotonic() - started < 5 + 25, "the watchdog took too long"
    # rank 0 says it, once: the other ranks wait longer, and the launcher ends them when rank 0 exits
    assert [line for line in output.splitlines() if "watchdog:" in line and "made no progress" in line] == [
        next(line for line in output.splitlines() if line.startswith("mmpt: watchdog: rank 0 made no progress"))
    ]
    assert "lagging rank(s): 1" in output and "Traceback" not in output
    assert "rank 1: step 3 data" in output and "rank 0: step 3 forward" in output


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/mmpt-payload-ran",))


def test_shard_with_a_pickle_payload_is_not_unpickled(tmp_path):
    from mmpt.data import BatchStream, ShardSetWriter, Source, StatefulLoader, StreamSpec
    from mmpt.data.image_text import decode_image

    with ShardSetWriter(tmp_path / "evil", max_samples=10) as writer:
        for i in range(4):
            buffer = io.BytesIO()
            from PIL import Image

            Image.new("RGB", (4, 4)).save(buffer, format="PNG")
            writer.write({"__key__": f"{i}", "png": buffer.getvalue(), "pyd": pickle.dumps(Payload()), "txt": "x"})
    spec = StreamSpec(
        [Source.from_pattern(str(tmp_path / "evil-*.tar"))], batch_size=2, mode="epoch", shuffle_buffer=0, max_epochs=1
    )
    batches = list(
        StatefulLoader(
            BatchStream(
                spec,
                lambda s: {
                    "n": torch.tensor(decode_image(s["png"]).size[0]),
                    "payload_is_bytes": torch.tensor(isinstance(s["pyd"], bytes)),
                },
            )
        )
    )
    assert sum(len(b["n"]) for b in batches) == 4 and all(b["payload_is_bytes"].all() for b in batches)
    assert not os.path.exists("/tmp/mmpt-payload-ran")


def test_config_cannot_execute_code(tmp_path, digits_root):
    from mmpt.config import ConfigError
    from mmpt.config_loader import load_config

    cfg = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, tmp_path / "run"))
    text = cfg.read_text() + "\nextra: !!python/object/apply:os.system ['touch /tmp/mmpt-yaml-ran']\n"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(cfg)
    assert not os.path.exists("/tmp/mmpt-yaml-ran")


def nan_scenario(stage: int) -> str:
    name = f"faults-nan-on-rank-1-zero{stage}"

    @scenario(name, fault="nan@backward,step=3,rank=1")
    def build(corpora, run_dir):
        train = {**STEPS, "zero_stage": stage, "max_steps": 6, "save_every": 0}
        return tiny_config(corpora["digits"], run_dir, train=train), [], "train"

    return name


NAN_SCENARIOS = {stage: nan_scenario(stage) for stage in (0, 2)}


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.pool(n)) for s, n in NAN_SCENARIOS.items()])
def test_nan_loss_on_one_rank_skips_the_step_on_all_ranks(rank_pool, stage):
    from conftest import read_metrics

    name = NAN_SCENARIOS[stage]
    run_dir, record = rank_pool.run_dir(name), rank_pool.record(name)
    assert record["stops"] == [None, None]  # the run went on to its end
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss/total" in r}
    assert [records[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    skipped = "1 step(s) skipped up to step 3: non-finite loss or gradients (1 in a row"
    assert any(line.startswith(skipped) for line in record["said"]), record["said"]
    assert all(torch.isfinite(value).all() for value in load_file(str(run_dir / "model.safetensors")).values())


@scenario("faults-non-finite-in-a-row", fault="nan@backward,rank=0")
def non_finite_in_a_row(corpora, run_dir):
    train = {**STEPS, "max_steps": 10, "save_every": 0, "max_bad_steps": 3}
    return tiny_config(corpora["digits"], run_dir, train=train), [], "train"


@pytest.mark.pool("faults-non-finite-in-a-row")
def test_non_finite_steps_in_a_row_stop_the_run(rank_pool):
    stops = rank_pool.record("faults-non-finite-in-a-row")["stops"]
    assert [code for _, code in stops] == [4, 4]  # the documented exit code of a non-finite stop
    assert stops[0][0].startswith(
        "non-finite training: stopping at step 3: 3 optimizer steps in a row had a non-finite loss or gradient"
    ), stops
    assert stops[1][0] == "rank 1: stopped on the non-finite training that rank 0 reports"


ELASTIC = {2: "elastic-reference", 3: "elastic-zero3"}  # ZeRO stage -> a 2-rank run of 16 steps, checkpoint 8 kept


@scenario(ELASTIC[2])
def elastic_reference(corpora, run_dir):
    return tiny_config(corpora["digits"], run_dir, train={**STEPS, "max_steps": 16}), [], "train"


@scenario(ELASTIC[3])
def elastic_zero3(corpora, run_dir):
    return tiny_config(corpora["digits"], run_dir, train={**STEPS, "max_steps": 16, "zero_stage": 3}), [], "train"


def batch_norm_counts(run_dir, step):
    """Every BatchNorm's `num_batches_tracked` in the model file of rank 0 saved at `step`."""
    path = sorted((run_dir / f"checkpoints/step_{step:09d}").glob("*model_states.pt"))[0]
    module = torch.load(path, map_location="cpu", weights_only=False)["module"]
    counts = {name: int(value) for name, value in module.items() if name.endswith("num_batches_tracked")}
    assert counts, "the model has no BatchNorm"
    return counts


def batch_for(ranks: int) -> str:  # the same global batch (32) whatever the number of ranks
    return f"data.train.batch_size={32 // ranks}"


EVERY_STEP = ["train.save_every=1", "train.keep_last=9"]  # the optimizer state after each step (and step 8's)


def resumed_on_two_ranks(tmp_path, digits_root) -> tuple[Path, Path, str]:
    """A 1-rank run (in this process) stopped by a failure right after its checkpoint 8, resumed by the launcher
    on 2 ranks."""
    from mmpt.engine.hooks import observing

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, run_dir, train={**STEPS, "max_steps": 16}))
    injector = faults.FaultInjector(faults.parse("fail@data,step=9"), rank=0)
    with observing(injector.reached), pytest.raises(OSError, match="injected"):
        train_in_process(load_config(config, [batch_for(1)]))
    assert (run_dir / "checkpoints/step_000000008/complete.json").exists()
    second = run_deepspeed(config, batch_for(2), *EVERY_STEP, ranks=2)
    return run_dir, run_dir, second.stderr + second.stdout


def resumed_on_one_rank(saved: Path, run_dir: Path, caplog) -> tuple[Path, Path, str]:
    """The pool's 2-rank run's checkpoint 8 resumed in this process, on one rank, into `run_dir`."""
    resume = f"run.resume={saved / 'checkpoints/step_000000008'}"
    cfg = load_config(saved / "config.yaml", [batch_for(1), *EVERY_STEP, f"run.output_dir={run_dir}", resume])
    with caplog.at_level("WARNING", logger="mmpt"):
        train_in_process(cfg)
    return saved, run_dir, "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "before, after, stage",
    [
        pytest.param(2, 1, 2, marks=pytest.mark.pool(ELASTIC[2])),
        pytest.param(1, 2, 2, marks=pytest.mark.pool(ELASTIC[2])),
        pytest.param(2, 1, 3, marks=pytest.mark.pool(ELASTIC[2], ELASTIC[3])),
    ],
)
def test_resume_on_another_number_of_ranks_joins_the_loss_curve(
    tmp_path, digits_root, rank_pool, process_group_of_one, caplog, before, after, stage
):
    """Checkpoint 8 of a 16-step run saved by `before` ranks, resumed on `after`: the 2-rank sides train in the
    shared pool or through the launcher, the 1-rank ones in this process."""
    from conftest import step_losses

    if before == 2:
        saved_dir, run_dir, said = resumed_on_one_rank(rank_pool.run_dir(ELASTIC[stage]), tmp_path / "run", caplog)
    else:
        saved_dir, run_dir, said = resumed_on_two_ranks(tmp_path, digits_root)
    assert f"saved by {before} ranks x 1 workers, on {after} x 1" in said, said[-3000:]
    reference_losses = step_losses(rank_pool.run_dir(ELASTIC[2]))
    losses = step_losses(run_dir)
    after_resume = [losses[s] for s in range(9, 17)]
    reference = [reference_losses[s] for s in range(9, 17)]
    # The data readers restart on the new layout, so the batches after step 8 differ from the reference's:
    # the curves agree to batch noise (about 0.1 here), not exactly.
    assert sum(abs(a - b) for a, b in zip(after_resume, reference)) / 8 < 0.2, (after_resume, reference)
    # It continued rather than started over: after resuming it is nearer the level it left than the start.
    start = (reference_losses[1] + reference_losses[2]) / 2
    left = (reference_losses[7] + reference_losses[8]) / 2
    assert sum(after_resume[:4]) / 4 < (start + left) / 2, (after_resume, reference)
    # The optimizer state came along, which the loss over 8 steps barely shows. Adam's second moment after
    # step 9 is beta2 * (the restored one) + (1 - beta2) * g^2, so its norm is at least beta2 times that of
    # the checkpoint it resumed from, whatever the batch (a restarted state holds (1 - beta2) * g^2 alone:
    # a small fraction); and Adam counts one step per step from the saved count (a restarted one from 1).
    beta2 = load_config(run_dir / "config.yaml").optim.betas[1]
    saved_count, saved_moment = adam_state(saved_dir, 8)
    count, second_moment = adam_state(run_dir, 9)
    assert (saved_count, count) == (8, 9)
    assert second_moment >= beta2 * saved_moment * (1 - 1e-6), (second_moment, saved_moment)
    assert adam_state(run_dir, 16)[0] == 16
    # Buffers came along too: every BatchNorm counts one batch per step from the count it had saved (buffers
    # started again would count from 0), so its running statistics go on from the saved ones.
    saved, resumed = batch_norm_counts(saved_dir, 8), batch_norm_counts(run_dir, 9)
    assert resumed == {name: count + count // 8 for name, count in saved.items()}, (saved, resumed)
