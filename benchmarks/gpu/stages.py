"""The suite's stages: runs of mmpt's own trainer (`launch/train.py`), open_clip's trainer beside it, and the loss
alone. Each stage takes a `Context` and returns its raw figures; an `errors` list in the result marks the stage
failed while keeping what it measured. Nothing here writes a report.

Every figure is measured: an mmpt run's step, data and forward times, its peak GPU memory and, where the trainer
logs them, its TFLOP/s and MFU (`perf/tflops`, `perf/mfu`) come from its `metrics.jsonl`; open_clip's step times
from its `out.log`, its peak memory from `open_clip_main.py`; the loss's memory from the allocator.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path += [str(REPO), str(REPO / "benchmarks")]  # benchmarks.contrastive_loss as a module, and what it imports
TRAIN = REPO / "launch" / "train.py"
OPEN_CLIP_MAIN = Path(__file__).with_name("open_clip_main.py")
# Rendezvous variables of the suite must not leak into a run's: each run is a world of its own.
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# open_clip's trainer reads shards with webdataset 0.2 (mmpt with 1.x): run.sh installs it in a folder of its own
# and names it here; elsewhere (the dry run) it is installed once into OPEN_CLIP_DEPS.
OPEN_CLIP_PATH_VARIABLE = "MMPT_OPEN_CLIP_TRAIN_PATH"
OPEN_CLIP_DEPS = Path(tempfile.gettempdir()) / "mmpt-open_clip_train-deps"
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
LR, WD, WARMUP_LR_STEPS = 1e-4, 0.1, 10  # the comparison's recipe, the same for both trainers
# VICTOR base names bert-base-chinese's tokenizer; the suite tokenizes with the corpus' own WordPiece (ids below
# 1000) but keeps the text tower at bert-base-chinese's vocabulary size.
BERT_BASE_CHINESE_VOCAB = 21128


@dataclass(frozen=True)
class Profile:
    """Sizes of one kind of run: the GPU suite (the defaults), or the CPU dry run that checks it end to end."""

    dry_run: bool = False
    device: str = "cuda"
    precision: str = "bf16"
    workers: int = 12
    steps: int = 15  # of a training run
    warmup: int = 5  # first logged steps not counted
    clip_model: str = "ViT-B-16"
    clip_batch: int = 256
    m2_batch: int = 256
    m2_tile: int = 1024
    m2_settings: tuple[tuple[int, int], ...] = ((2, 4), (3, 4))  # (ZeRO stage, grad_accum) of each M²-Encoder run
    loss_batch: int = 4096
    loss_batch_cap: int = 2**22
    victor_batch: int | None = None  # None: the config's
    space2_batch: int | None = None


GPU = Profile()
# The dry run's models are its methods' `tiny_overrides` (mmpt_run); these are its batches and step counts.
DRY = Profile(
    dry_run=True,
    device="cpu",
    workers=0,
    steps=2,
    warmup=1,
    clip_model=str(REPO / "mmpt/models/bench-vit-tiny.json"),
    clip_batch=4,
    m2_batch=2,
    m2_settings=((2, 2), (3, 2)),
    loss_batch=64,
    loss_batch_cap=128,
    victor_batch=2,
    space2_batch=4,
)


@dataclass
class Context:
    profile: Profile
    work: Path
    deadline: float  # time.monotonic() by which the stage must be done
    progress: Callable[[dict[str, Any]], None] = lambda partial: None  # the suite keeps what is measured so far
    partial: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def data(self) -> Path:
        return self.work / "data"

    def keep(self, key: str, record: dict[str, Any]) -> None:
        """`record` appended to the stage's partial result under `key`, which the suite writes out at once."""
        self.partial.setdefault(key, []).append(record)
        self.progress(self.partial)


# ----------------------------------------------------------------------------- training runs


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


def mmpt_run(ctx: Context, name: str, config: dict, global_batch: int, share: float, **facts: Any) -> dict:
    """`config` (a mapping; `extends` may name a shipped config) trained by launch/train.py for the profile's steps,
    logging every step and saving nothing, in `share` seconds at most: its logged steps summarised. The dry run
    shrinks it with its method's `tiny_overrides` (the tests' sizes), evaluating nothing."""
    p = ctx.profile
    run_dir = ctx.work / "runs" / slug(name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run directory left from before would be resumed
    path = ctx.work / "configs" / f"{slug(name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    train = {**config.get("train", {}), "max_steps": p.steps, "log_every": 1, "save_every": 0, "watchdog_timeout": 0}
    run = {"output_dir": str(run_dir), "resume": "none", "tensorboard": False, "progress_bar": False}
    path.write_text(yaml.safe_dump({**config, "train": train, "run": run}, allow_unicode=True, sort_keys=False))
    command = [str(TRAIN), "--config", str(path)]
    if p.dry_run:
        from mmpt.config_loader import load_config
        from mmpt.methods import get_method

        corpora = {"digits": "digits", "video": "moving_digits", "dialogs": "dialogs", "bert": "bert-tiny"}
        paths = {key: str(ctx.data / folder) for key, folder in corpora.items()} | {"repo": str(REPO)}
        tiny = get_method(load_config(path).method_name).tiny_overrides
        command += [*(override.format(**paths) for override in tiny), "data.eval=[]"]
    record = launch(ctx, name, command, share, {})
    steps = mmpt_steps(run_dir / "metrics.jsonl")
    return finish_run({"name": name, "trainer": "mmpt", "global_batch": global_batch, **facts, **record}, steps, p)


def open_clip_run(ctx: Context, name: str, args: list[str], global_batch: int, share: float) -> dict:
    """open_clip's own trainer (through open_clip_main.py), its webdataset 0.2 first on its path."""
    logs = ctx.work / "open_clip_logs"
    shutil.rmtree(logs / slug(name), ignore_errors=True)  # open_clip refuses an existing experiment
    peak_file = ctx.work / "logs" / f"{slug(name)}.peak.json"
    peak_file.unlink(missing_ok=True)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [open_clip_train_path(), os.environ.get("PYTHONPATH")]))}
    env["MMPT_PEAK_FILE"] = str(peak_file)
    command = [str(OPEN_CLIP_MAIN), *args, "--logs", str(logs), "--name", slug(name)]
    record = {"name": name, "trainer": "open_clip_train", "global_batch": global_batch}
    record.update(launch(ctx, name, command, share, env))
    if peak_file.is_file():
        record["peak_gib"] = json.loads(peak_file.read_text())["peak_allocated_gib"]
    log = logs / slug(name) / "out.log"
    text = log.read_text() if log.is_file() else ""
    steps = [
        {"step_s": float(b), "data_s": float(d)}
        for d, b in re.findall(r"Data \(t\): ([0-9.]+) Batch \(t\): ([0-9.]+)", text)
    ]
    return finish_run(record, steps, ctx.profile)


def launch(ctx: Context, name: str, command: list[str], share: float, env: dict[str, str]) -> dict[str, Any]:
    """`python COMMAND` in a process of its own (an out-of-memory or a hang ends that run only), killed after
    `share` seconds: status ok, timeout, oom or error, and the wall time."""
    log = ctx.work / "logs" / f"{slug(name)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS}, "PYTHONUNBUFFERED": "1", **env}
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, *command], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=max(1.0, share))
        except BaseException as exc:  # its share of the time is up, or the suite is stopping the stage
            kill_tree(process)
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            return {"status": "timeout", "wall_s": share, "error": f"stopped after its share of {share:.0f} s"}
    wall = time.monotonic() - started
    if code == 0:
        return {"status": "ok", "wall_s": wall}
    text = log.read_text(errors="replace")
    tail = " / ".join(line.strip() for line in text.splitlines()[-6:] if line.strip())[-800:]
    status = "oom" if any(marker in text for marker in OOM_MARKERS) else "error"
    return {"status": status, "wall_s": wall, "error": f"exited with {code}: {tail}"}


def kill_tree(process: subprocess.Popen) -> None:
    """Kill a process and every process under it (loader workers, a stage's runs), then reap it."""
    import psutil

    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for member in tree:  # all listed before any is killed: an orphan would leave the tree
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def open_clip_train_path() -> str:
    if os.environ.get(OPEN_CLIP_PATH_VARIABLE):
        return os.environ[OPEN_CLIP_PATH_VARIABLE]
    if not (OPEN_CLIP_DEPS / "webdataset").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(OPEN_CLIP_DEPS)]
        subprocess.run([*pip, "webdataset==0.2.86"], check=True)
    return str(OPEN_CLIP_DEPS)


def mmpt_steps(path: Path) -> list[dict[str, Any]]:
    """Rank 0's figures per logged step of an mmpt run (every step is logged); a torn last line is skipped."""
    steps = []
    lines = path.read_text().splitlines() if path.is_file() else []
    for index, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1:  # a run killed while writing its last line
                break
            raise
        if "step_time_per_rank" in record:
            peaks = record.get("gpu_peak_allocated_gib_per_rank")
            steps.append(
                {
                    "step_s": record["step_time_per_rank"][0],
                    "data_s": record["data_time_per_rank"][0],
                    "forward_s": record["forward_time_per_rank"][0],
                    "peak_gib": max(peaks) if peaks else None,
                    "tflops": record.get("perf/tflops"),
                    "mfu": record.get("perf/mfu"),
                }
            )
    return steps


def finish_run(record: dict[str, Any], steps: list[dict[str, Any]], p: Profile) -> dict[str, Any]:
    """The medians of the steps after the warm-up (the last step if there are no more): a run stopped at its share
    of the time keeps the steps it logged (`partial`); a run that logged nothing is an error."""
    record["steps_logged"] = len(steps)
    if record["status"] == "ok" and not steps:
        record.update(status="error", error="no step was logged")
    if not steps or (record["status"] != "ok" and len(steps) <= p.warmup):
        return record
    timed = steps[p.warmup :] or steps[-1:]

    def median(key: str) -> float | None:
        values = [s[key] for s in timed if s.get(key) is not None]
        return statistics.median(values) if values else None

    step = median("step_s")
    peaks = [s["peak_gib"] for s in steps if s.get("peak_gib") is not None]
    record.update(
        steps_timed=len(timed),
        step_s=step,
        data_s=median("data_s"),
        forward_s=median("forward_s"),
        samples_per_s=record["global_batch"] / step if step else None,
        tflops=median("tflops"),
        mfu=median("mfu"),
        partial=record["status"] != "ok",
    )
    if peaks:
        record["peak_gib"] = max(peaks)
    return record


def run_all(ctx: Context, runs: list[Callable[[float], dict]]) -> list[dict]:
    """Each run in an equal share of what is left of the stage, kept as it ends."""
    for index, run in enumerate(runs):
        ctx.keep("runs", run(max(1.0, ctx.left() / (len(runs) - index))))
    return ctx.partial.get("runs", [])


def failures(records: list[dict]) -> list[str]:
    return [f"{r['name']}: {r['status']}: {r.get('error')}" for r in records if r["status"] != "ok"]


# ----------------------------------------------------------------------------- corpora (built on the machine)


def digits(ctx: Context) -> Path:
    from mmpt.demo.digits import build_digits

    if ctx.profile.dry_run:  # what the tests build: fewer captions, smaller shards
        return build_digits(ctx.data / "digits", captions_per_image=2, shard_size=400)
    return build_digits(ctx.data / "digits")


def bert_checkpoint(directory: Path, corpus: Path, dry_run: bool) -> Path:
    """A random BERT (bert-base's shape, or 2 x 32 for the dry run) with a WordPiece vocabulary laid out like BERT's
    (the `[unusedN]` slots SPACE-2 puts its role tokens on), from the dialog corpus' words."""
    import string
    from collections import Counter

    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    if (directory / "config.json").is_file():
        return directory
    counts: Counter[str] = Counter()
    for path in sorted(corpus.rglob("*.json*")):
        counts.update(re.findall(r"[a-z]+", path.read_text(encoding="utf-8").lower()))
    characters = list(string.ascii_lowercase + string.digits + string.punctuation)
    head = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = [*head, *characters, *(f"##{c}" for c in characters)]
    if dry_run:
        size = None
        small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    else:
        size, small = BertConfig().vocab_size, {}  # bert-base-uncased's shape: 12 x 768, 30,522 tokens
    words = sorted(counts, key=lambda w: (-counts[w], w))
    known = set(vocab)
    vocab += [w for w in words if w not in known][: None if size is None else size - len(vocab)]
    if size is not None:
        vocab += [f"[unused{i}]" for i in range(99, 99 + size - len(vocab))]
    config = BertConfig(vocab_size=len(vocab), max_position_embeddings=128 if dry_run else 512, **small)
    staging = directory.with_name(directory.name + ".building")
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True).save_pretrained(staging)
    BertForMaskedLM(config).save_pretrained(staging)
    staging.rename(directory)
    return directory


# ----------------------------------------------------------------------------- configs


def clip_config(p: Profile, shards: Path, zero: int) -> dict:
    """mmpt's `open_clip` method with the comparison's recipe (no clipping, open_clip's AdamW settings)."""
    return {
        "method": {"name": "open_clip", "model": p.clip_model},
        "data": {
            "train": {
                "sources": [{"shards": str(shards / "train/en-*.tar")}],
                "mode": "resampled",
                "batch_size": p.clip_batch,
                "num_workers": p.workers,
                "shuffle_buffer": 1000,
            }
        },
        "optim": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.98], "eps": 1e-6, "warmup_steps": WARMUP_LR_STEPS},
        "train": {"grad_clip": 0.0, "precision": p.precision, "zero_stage": zero, "seed": 0},
    }


def open_clip_args(p: Profile, shards: Path) -> list[str]:
    """open_clip_train with the same shards, batch, recipe and bf16 autocast (its mixed precision)."""
    found = sorted((shards / "train").glob("en-*.tar"))
    pattern = f"{shards / 'train'}/en-{{{found[0].stem[3:]}..{found[-1].stem[3:]}}}.tar"
    options = {
        "train-data": pattern,
        "dataset-type": "webdataset",
        "train-num-samples": p.steps * p.clip_batch,
        "epochs": 1,
        "batch-size": p.clip_batch,
        "workers": p.workers,
        "model": Path(p.clip_model).stem,
        "lr": LR,
        "wd": WD,
        "beta1": 0.9,
        "beta2": 0.98,
        "eps": 1e-6,
        "warmup": WARMUP_LR_STEPS,
        "precision": "amp_bf16",
        "device": p.device,
        "log-every-n-steps": 1,
        "save-frequency": 0,
        "report-to": "",
        "seed": 0,
    }
    args = [item for key, value in options.items() for item in (f"--{key}", str(value))]
    return [*args, "--dataset-resampled", "--local-loss", "--gather-with-grad"]


def shipped(p: Profile, name: str, method: dict, sources: list[dict], batch: int | None, shuffle: int = 1000) -> dict:
    """A shipped config (configs/<name>.yaml) in the profile's precision on the suite's corpora: no pretrained
    weights, no evaluation data."""
    train = {"sources": sources, "num_workers": p.workers, "shuffle_buffer": shuffle}
    if batch:
        train["batch_size"] = batch
    data = {"train": train}
    return {
        "extends": str(REPO / f"configs/{name}.yaml"),
        "method": method,
        "data": data,
        "train": {"precision": p.precision},
    }


def language_shards(folder: Path) -> list[dict]:
    return [{"shards": str(folder / f"train/{language}-*.tar")} for language in ("en", "zh")]


def m2_config(p: Profile, shards: Path, zero: int, accum: int) -> dict:
    method = {"tokenizer": str(shards / "tokenizer.json"), "init_from": None}
    method["loss"] = {"accumulation_steps": None, "tile_size": p.m2_tile}
    config = shipped(p, "m2_encoder/0.4b", method, language_shards(shards), p.m2_batch)
    config["train"].update(zero_stage=zero, grad_accum=accum)
    return config


def victor_config(p: Profile, clips: Path) -> dict:
    from mmpt.data.video import default_backend  # decord where installed, else PyAV

    method = {
        "tokenizer": str(clips / "tokenizer.json"),
        "video": {"backbone_weights": None},
        "text": {"vocab_size": BERT_BASE_CHINESE_VOCAB},
        "retrieval": {"dataset": None},
        "backend": default_backend(),
    }
    return shipped(p, "victor/base", method, language_shards(clips), p.victor_batch, shuffle=200)


def space2_config(p: Profile, dialogs: Path, encoder: Path) -> dict:
    method = {"encoder": str(encoder), "intent_eval": {"dataset": None}}
    kinds = [{"name": kind, "shards": str(dialogs / f"shards/{kind}-*.tar")} for kind in ("labelled", "unlabelled")]
    return shipped(p, "space2/base", method, kinds, p.space2_batch)


def config_batch(config: dict) -> int:
    from mmpt.config_loader import load_config

    return config["data"]["train"].get("batch_size") or load_config(config["extends"]).data.train.batch_size


# ----------------------------------------------------------------------------- stages


def clip_vitb16(ctx: Context) -> dict[str, Any]:
    """open_clip ViT-B/16 in bf16 on one GPU: mmpt at ZeRO-0 and ZeRO-2 against open_clip_train on the same shards,
    batch, recipe and precision."""
    p = ctx.profile
    shards = digits(ctx)
    runs: list[Callable[[float], dict]] = [
        lambda share, z=zero: mmpt_run(ctx, f"mmpt ZeRO-{z}", clip_config(p, shards, z), p.clip_batch, share)
        for zero in (0, 2)
    ]
    runs.append(lambda share: open_clip_run(ctx, "open_clip_train", open_clip_args(p, shards), p.clip_batch, share))
    records = run_all(ctx, runs)
    return {"model": Path(p.clip_model).stem, "batch": p.clip_batch, "runs": records, "errors": failures(records)}


def clip_compile(ctx: Context) -> dict[str, Any]:
    """The ViT-B/16 run of `clip_vitb16` at ZeRO-0 with `train.compile: true`: the first steps hold the compilation."""
    p = ctx.profile
    config = clip_config(p, digits(ctx), 0)
    config["train"]["compile"] = True
    records = run_all(ctx, [lambda share: mmpt_run(ctx, "mmpt ZeRO-0 compiled", config, p.clip_batch, share)])
    return {"model": Path(p.clip_model).stem, "batch": p.clip_batch, "runs": records, "errors": failures(records)}


def m2_encoder(ctx: Context) -> dict[str, Any]:
    """M²-Encoder 0.4B (configs/m2_encoder/0.4b.yaml) with tiled GBA-ITC at each (ZeRO stage, grad_accum)."""
    p = ctx.profile
    shards = digits(ctx)
    runs: list[Callable[[float], dict]] = [
        lambda share, z=zero, a=accum: mmpt_run(
            ctx, f"m2 ZeRO-{z} accum{a}", m2_config(p, shards, z, a), p.m2_batch * a, share, zero_stage=z, grad_accum=a
        )
        for zero, accum in p.m2_settings
    ]
    records = run_all(ctx, runs)
    return {"micro_batch": p.m2_batch, "tile_size": p.m2_tile, "runs": records, "errors": failures(records)}


def victor(ctx: Context) -> dict[str, Any]:
    """VICTOR base (configs/victor/base.yaml) on moving-digits clips at the config's batch."""
    from mmpt.demo.moving_digits import build_moving_digits

    p = ctx.profile
    clips = build_moving_digits(
        ctx.data / "moving_digits",
        clips_per_kind=12 if p.dry_run else 96,
        test_clips_per_kind=6,
        shard_size=8 if p.dry_run else 64,
    )
    config = victor_config(p, clips)
    batch = config_batch(config)
    records = run_all(ctx, [lambda share: mmpt_run(ctx, f"victor b{batch}", config, batch, share)])
    return {"runs": records, "errors": failures(records)}


def space2(ctx: Context) -> dict[str, Any]:
    """SPACE-2 base (configs/space2/base.yaml) on generated dialogs, its encoder a random BERT of bert-base's shape."""
    from mmpt.demo.dialogs import build_dialog_shards

    p = ctx.profile
    dialogs = build_dialog_shards(ctx.data / "dialogs")
    encoder = bert_checkpoint(ctx.data / ("bert-tiny" if p.dry_run else "bert-base"), dialogs, p.dry_run)
    config = space2_config(p, dialogs, encoder)
    batch = config_batch(config)
    records = run_all(ctx, [lambda share: mmpt_run(ctx, f"space2 b{batch}", config, batch, share)])
    return {"runs": records, "errors": failures(records)}


def search_batch(trial: Callable[[int], dict], start: int, cap: int, deadline: float, growth: float = 4.0) -> dict:
    """The largest batch that fits: doubling from `start` while trials fit, up to `cap`, stopping when the next trial
    (estimated at `growth` x the last one's wall time) would pass `deadline`. `trial(batch)` returns status ok or
    oom, and wall_s."""
    trials: list[dict] = []
    fits = fails = None
    batch, stop = start, "cap"
    while batch <= cap:
        if trials and time.monotonic() + growth * trials[-1]["wall_s"] > deadline:
            stop = "time"
            break
        trials.append({"batch": batch, **trial(batch)})
        if trials[-1]["status"] != "ok":
            fails, stop = batch, "oom"
            break
        fits, batch = batch, batch * 2
    return {"largest_fit": fits, "first_oom": fails, "stopped_by": stop, "trials": trials}


def loss_memory(ctx: Context) -> dict[str, Any]:
    """Peak memory and time of the loss's forward + backward alone on given features (D = 512, fp32, world 1):
    GBA-ITC untiled and tiled against open_clip's ClipLoss, the batch doubling until out of memory (time grows
    as b²)."""
    import torch.distributed as dist

    from benchmarks.contrastive_loss import DIM, variants
    from mmpt import distributed as mdist

    p = ctx.profile
    if not dist.is_initialized():
        mdist.ensure_rendezvous_env()
        dist.init_process_group("nccl" if p.device == "cuda" else "gloo", rank=0, world_size=1)
    losses = variants(1, p.loss_batch)
    for index, (name, _, loss) in enumerate(losses):
        loss_trial(loss, p.loss_batch, p.device)  # the kernels warmed once, at the first trial's shapes
        share_end = time.monotonic() + ctx.left() / (len(losses) - index)
        found = search_batch(
            lambda rows, loss=loss: loss_trial(loss, rows, p.device), p.loss_batch, p.loss_batch_cap, share_end
        )
        ctx.keep("variants", {"variant": name, **found})
    tile = next((getattr(loss, "tile_size", 0) for _, _, loss in losses if getattr(loss, "tile_size", 0)), None)
    memory = "allocator peak above the features" if p.device == "cuda" else "resident set above the features (CPU)"
    return {"dim": DIM, "tile_size": tile, "memory": memory, "variants": ctx.partial["variants"], "errors": []}


def loss_trial(loss, rows: int, device: str) -> dict[str, Any]:
    """One forward + backward of `loss` on random unit features: its time and peak memory above the features."""
    import torch
    import torch.nn.functional as F

    from benchmarks.contrastive_loss import DIM, PeakMemory

    image = text = scale = None
    try:
        image = F.normalize(torch.randn(rows, DIM, device=device), dim=-1).requires_grad_()
        text = F.normalize(torch.randn(rows, DIM, device=device), dim=-1).requires_grad_()
        scale = torch.tensor([14.0], device=device, requires_grad=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            started = time.perf_counter()
            loss(image, text, scale).backward()
            torch.cuda.synchronize()
            seconds, peak = time.perf_counter() - started, (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            with PeakMemory() as memory:
                started = time.perf_counter()
                loss(image, text, scale).backward()
                seconds = time.perf_counter() - started
            peak = memory.extra_mb
        return {"status": "ok", "peak_mib": peak, "wall_s": seconds}
    except RuntimeError as exc:  # torch.OutOfMemoryError, or cuBLAS failing to allocate its workspace
        if not any(marker in str(exc) for marker in OOM_MARKERS):
            raise
        return {"status": "oom", "error": " ".join(str(exc).split())[:300], "wall_s": 0.0}
    finally:
        del image, text, scale
        if device == "cuda":
            torch.cuda.empty_cache()


STAGES: dict[str, Callable[[Context], dict[str, Any]]] = {
    "clip_vitb16": clip_vitb16,
    "m2_encoder": m2_encoder,
    "loss_memory": loss_memory,
    "space2": space2,
    "victor": victor,
    "clip_compile": clip_compile,
}
