"""The suite's stages. Each takes a `Context` and returns its raw figures; an `errors` list in the result
marks the stage failed while keeping what it measured. Nothing here writes a report.

Every figure is measured: step times come from the trainers' own logs, memory from
torch.cuda.max_memory_allocated in the measured process, FLOPs from FlopCounterMode, the bf16 peak
from a matrix product timed here. The only number not measured is the nominal dense bf16 peak of
the H100/H200 SXM (989 TFLOP/s), reported beside the measured one.
"""

from __future__ import annotations

import copy
import io
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import corpora
import torch
import torch.distributed as dist
import torch.nn.functional as F
from training import REPO, Runner, benchmark_settings, deep_update, mmpt_run, open_clip_run

if str(REPO) not in sys.path:  # the other benchmarks (benchmarks.train_throughput, ...) as modules
    sys.path.append(str(REPO))

NOMINAL_NOTE = "nominal dense bf16 peak of the H100/H200 SXM data sheet"
WORLD_ONE_NOTE = "world 1 only: multi-rank NCCL needs a multi-GPU machine"
SKIPPED_ON_GLOO = "skipped: NCCL only"
# VICTOR base names bert-base-chinese's tokenizer; the suite tokenizes with the corpus' own WordPiece
# (ids below 1000) but keeps the text tower at bert-base-chinese's vocabulary size.
BERT_BASE_CHINESE_VOCAB = 21128
PROFILED_STEPS = 2  # of the clip_profile stage, after the warm-up steps


@dataclass(frozen=True)
class Profile:
    """Sizes of one kind of run: the GPU suite, or the CPU dry run that checks it end to end in a minute."""

    dry_run: bool
    device: str
    precision: str
    workers: int
    steps: int  # of a throughput run
    warmup: int  # first steps not timed
    search_steps: int  # of a batch-size trial
    clip_model: str
    clip_batch: int
    matmul_size: int
    m2_batch: int
    m2_batch_cap: int
    m2_tile: int
    m2_settings: tuple[tuple[int, int], ...]  # (ZeRO stage, grad_accum) of each M²-Encoder setting, in order
    m2_search_min_s: float  # a batch-size search starts only with this much of the stage left
    loss_batch: int
    loss_batch_cap: int
    victor_batch: int | None  # None: the config's
    space2_batch: int | None
    compile_backend: str  # torch.compile's, for the clip_compile stage
    loader_images: int  # generated JPEGs the data_loader stage reads (resampled)
    loader_image_sizes: tuple[int, int]  # shortest and longest side of a generated JPEG
    loader_batch: int
    loader_workers: tuple[int, ...]  # worker counts, each at most the machine's cores (at least 1)
    loader_seconds: float  # timed per worker count, after the warm-up batches
    m2_overrides: dict = field(default_factory=dict)
    victor_overrides: dict = field(default_factory=dict)
    space2_overrides: dict = field(default_factory=dict)


GPU = Profile(
    dry_run=False,
    device="cuda",
    precision="bf16",
    workers=12,
    steps=15,
    warmup=5,
    search_steps=3,
    clip_model="ViT-B-16",
    clip_batch=256,
    matmul_size=8192,
    m2_batch=256,
    m2_batch_cap=4096,
    m2_tile=1024,
    # Both ZeRO stages at the shipped config's accumulation: what one command's time holds at the 0.4B size.
    m2_settings=((2, 4), (3, 4)),
    m2_search_min_s=45.0,  # a 0.4B run took ~30 s to reach its first step on an H100
    loss_batch=4096,
    loss_batch_cap=2**22,
    victor_batch=None,
    space2_batch=None,
    compile_backend="inductor",
    loader_images=512,
    loader_image_sizes=(240, 800),
    loader_batch=256,
    loader_workers=(1, 4, 8, 16),
    loader_seconds=6.0,
    victor_overrides={"method": {"text": {"vocab_size": BERT_BASE_CHINESE_VOCAB}}},
)

DRY = Profile(
    dry_run=True,
    device="cpu",
    precision="bf16",
    workers=0,
    steps=2,
    warmup=1,
    search_steps=1,
    clip_model=str(REPO / "benchmarks/configs/bench-vit-tiny.json"),
    clip_batch=4,
    matmul_size=256,
    m2_batch=2,
    m2_batch_cap=4,
    m2_tile=6,
    m2_settings=((2, 1), (2, 4), (3, 1), (3, 4)),
    m2_search_min_s=0.0,
    loss_batch=64,
    loss_batch_cap=128,
    victor_batch=2,
    space2_batch=4,
    compile_backend="aot_eager",  # the dynamo capture and autograd split without inductor's code generation
    loader_images=4,
    loader_image_sizes=(48, 96),
    loader_batch=4,
    loader_workers=(1, 2),
    loader_seconds=1.0,
    # The shapes of tests/test_config_matrix.py's shrunk configs: the same code paths, tiny.
    m2_overrides={
        "method": {
            "arch": {
                "vocab_size": None,
                "width": 32,
                "heads": 2,
                "lower_layers": 1,
                "shared_layers": 1,
                "output_dim": 16,
                "image_size": 32,
                "patch_size": 8,
                "text_positions": 32,
                "context_length": 24,
                "position_init_std": 0.02,
            },
            "augment": {"randaugment": False},
        }
    },
    victor_overrides={
        "method": {
            "video": {"backbone": "resnet10t", "image_size": 32, "num_frames": 4, "width": 32, "layers": 1, "heads": 2},
            "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 24},
            "embed_dim": 16,
            "cross_layers": 1,
            "queue_size": 16,
            "frame_queue_size": 32,
        }
    },
    space2_overrides={"method": {"max_len": 64, "max_turns": 4, "max_utt_len": 16}},
)


@dataclass
class Context:
    profile: Profile
    work: Path
    deadline: float  # time.monotonic() by which the stage must be done
    runner: Runner
    partial: dict[str, Any] = field(default_factory=dict)  # what the stage measured so far: kept if it is stopped

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def data(self) -> Path:
        return self.work / "data"


# ----------------------------------------------------------------------------- shared measurements


def search_batch(
    trial: Callable[[int], dict],
    start: int,
    cap: int,
    deadline: float,
    growth: float = 2.0,
    known_fit: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """The largest batch that fits: halve from `start` while trials run out of memory, double while they fit,
    up to `cap`, stopping when the next trial (estimated at `growth` x the last one's wall time) would
    pass `deadline`. `known_fit`: a smaller batch already seen to fit (no halving below `start` then).
    `trial(batch)` returns a probe record: status ok, oom, timeout or error."""
    trials: list[dict] = []
    fits, fails, batch, stop = known_fit, None, start, "cap"
    while batch <= cap:
        if trials and clock() + growth * trials[-1].get("wall_s", 0.0) > deadline:
            stop = "time"
            break
        result = {"batch": batch, **trial(batch)}
        trials.append(result)
        if result["status"] == "ok":
            fits = max(fits or 0, batch)
        elif result["status"] == "oom":
            fails = min(fails or batch, batch)
        else:
            stop = "time" if result["status"] == "timeout" else "error"
            break
        if fits and fails:
            stop = "oom"
            break
        if not fits:
            batch //= 2
            if batch < 1:
                stop = "nothing fits"
                break
        else:
            batch *= 2
    return {"largest_fit": fits, "first_oom": fails, "stopped_by": stop, "trials": trials}


def matmul_peak(device: str, size: int, repeats: int = 50) -> dict[str, Any]:
    """Dense bf16 matrix product throughput measured here (random data, after the clocks ramp up on warm-up
    products): the denominator of the measured MFU."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(10):
        torch.mm(a, b)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    synchronize(device)
    seconds = (time.perf_counter() - started) / repeats
    return {
        "size": size,
        "dtype": "bfloat16",
        "repeats": repeats,
        "seconds": seconds,
        "tflops": 2 * size**3 / seconds / 1e12,
    }


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def count_step_flops(model_name: str, batch: int, device: str) -> int:
    """FLOPs of one training step's forward + backward (model and loss; the optimizer's are negligible)
    on mmpt's open_clip model in bf16 autocast, counted by torch.utils.flop_counter.FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    from mmpt.losses import ContrastiveLoss
    from mmpt.models.open_clip_model import OpenClipModel

    model = OpenClipModel(model_name).to(device)
    images, tokens = clip_batch(model_name, batch, device)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            image_features, text_features, scale = model(images, tokens)
            loss = ContrastiveLoss()(image_features.float(), text_features.float(), scale)
        loss.backward()
    del model, images, tokens, loss
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return counter.get_total_flops()


def clip_batch(model_name: str, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and tokens of the shapes the open_clip model `model_name` takes."""
    import open_clip

    from mmpt.models.open_clip_model import register_model_config

    config = open_clip.get_model_config(register_model_config(model_name))
    if config is None:
        raise ValueError(f"open_clip has no model config {model_name}")
    size, text = config["vision_cfg"]["image_size"], config["text_cfg"]
    images = torch.randn(batch, 3, size, size, device=device)
    tokens = torch.randint(1, text.get("vocab_size", 49408), (batch, text.get("context_length", 77)), device=device)
    return images, tokens


def nominal_peak_tflops(device_name: str) -> float | None:
    from benchmarks.gpu_step import PEAK_BF16_TFLOPS

    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in ("H100", "H200") and k in device_name), None)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def failures(records: list[dict]) -> list[str]:
    return [f"{r['name']}: {r['status']}: {r.get('error')}" for r in records if r["status"] != "ok"]


def run_share(ctx: Context, runs_left: int) -> float:
    """This run's time: an equal share of what is left of the stage."""
    return max(1.0, ctx.left() / max(1, runs_left))


# ----------------------------------------------------------------------------- stages


def clip_vitb16(ctx: Context) -> dict[str, Any]:
    """open_clip ViT-B/16 in bf16 on one GPU: mmpt at ZeRO-0 and ZeRO-2 against open_clip's trainer on the same
    shards, batch and precision; step-time breakdown, peak memory and MFU."""
    p = ctx.profile
    digits = corpora.digits(ctx.data, p.dry_run)
    runs = [
        mmpt_run(
            f"mmpt ZeRO-{zero}",
            ctx.work,
            clip_config(p, digits, zero),
            p.steps,
            p.clip_batch,
            trainer="mmpt",
            zero_stage=zero,
        )
        for zero in (0, 2)
    ]
    runs.append(
        open_clip_run(
            "open_clip_train",
            ctx.work,
            open_clip_args(p, digits),
            p.clip_batch,
            trainer="open_clip_train",
            zero_stage=None,
        )
    )
    records = ctx.partial.setdefault("runs", [])
    for index, run in enumerate(runs):
        records.append(ctx.runner.run(run, run_share(ctx, len(runs) - index + 1), p.warmup))
    flops = count_step_flops(p.clip_model, p.clip_batch, p.device)
    peak = matmul_peak(p.device, p.matmul_size)
    name = device_name(p.device)
    nominal = nominal_peak_tflops(name)
    for record in records:
        if record.get("step_s"):
            achieved = flops / record["step_s"] / 1e12
            record.update(
                achieved_tflops=achieved,
                mfu_measured_peak=achieved / peak["tflops"],
                mfu_nominal_peak=None if nominal is None else achieved / nominal,
            )
    return {
        "model": Path(p.clip_model).stem,
        "batch": p.clip_batch,
        "precision": p.precision,
        "open_clip_precision": "amp_bf16",
        "steps": p.steps,
        "warmup_steps": p.warmup,
        "loader_workers": p.workers,
        "flops_per_step": flops,
        "matmul": peak,
        "nominal_peak_tflops": nominal,
        "nominal_note": NOMINAL_NOTE,
        "runs": records,
        "errors": failures(records),
    }


def clip_profile(ctx: Context) -> dict[str, Any]:
    """The ViT-B/16 step of `clip_vitb16` under torch.profiler, at ZeRO-0 and ZeRO-2: where the step's time goes
    (device busy against wall time, kernels and copies per step, the operators with the most device time).
    Logging only after the profiled steps, as training logs every few dozen steps rather than every step."""
    p = ctx.profile
    digits = corpora.digits(ctx.data, p.dry_run)
    first, count = p.warmup + 1, PROFILED_STEPS
    steps = first + count  # the profiler stops where the step after the profiled ones starts
    records = ctx.partial.setdefault("runs", [])
    for index, zero in enumerate((0, 2)):
        config = clip_config(p, digits, zero)
        logged_once = {"train": {"log_every": steps}}
        run = mmpt_run(f"profile ZeRO-{zero}", ctx.work, config, steps, p.clip_batch, logged_once, zero_stage=zero)
        records.append(ctx.runner.run(replace(run, profile=(first, count)), run_share(ctx, 2 - index), None))
    return {
        "model": Path(p.clip_model).stem,
        "batch": p.clip_batch,
        "precision": p.precision,
        "profiled_steps": f"{first}-{first + count - 1}",
        "runs": records,
        "errors": failures(records),
    }


def clip_config(p: Profile, digits: Path, zero: int) -> dict:
    """mmpt's `open_clip` method with benchmarks/train_throughput.py's recipe (no clipping, its AdamW settings)."""
    from benchmarks.train_throughput import LR, WARMUP_LR_STEPS, WD

    return {
        "method": {"name": "open_clip", "model": p.clip_model, "zeroshot": {"dataset": None}},
        "data": {
            "train": {
                "sources": [{"shards": str(digits / "train/en-*.tar")}],
                "mode": "resampled",
                "batch_size": p.clip_batch,
                "num_workers": p.workers,
                "shuffle_buffer": 1000,
            }
        },
        "optim": {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.98], "eps": 1e-6, "warmup_steps": WARMUP_LR_STEPS},
        "train": {"grad_clip": 0.0, "precision": p.precision, "zero_stage": zero, "seed": 0},
    }


def open_clip_args(p: Profile, digits: Path) -> list[str]:
    """open_clip's trainer as benchmarks/train_throughput.py drives it, in bf16 autocast (its mixed precision)."""
    from benchmarks.train_throughput import LR, WARMUP_LR_STEPS, WD

    shards = sorted((digits / "train").glob("en-*.tar"))
    pattern = f"{digits / 'train'}/en-{{{shards[0].stem[3:]}..{shards[-1].stem[3:]}}}.tar"
    return [
        "--train-data",
        pattern,
        "--dataset-type",
        "webdataset",
        "--dataset-resampled",
        "--train-num-samples",
        str(p.steps * p.clip_batch),
        "--epochs",
        "1",
        "--batch-size",
        str(p.clip_batch),
        "--workers",
        str(p.workers),
        "--model",
        Path(p.clip_model).stem,
        "--lr",
        str(LR),
        "--wd",
        str(WD),
        "--beta1",
        "0.9",
        "--beta2",
        "0.98",
        "--eps",
        "1e-6",
        "--warmup",
        str(WARMUP_LR_STEPS),
        "--precision",
        "amp_bf16",
        "--device",
        p.device,
        "--local-loss",
        "--gather-with-grad",
        "--log-every-n-steps",
        "1",
        "--save-frequency",
        "0",
        "--report-to",
        "",
        "--seed",
        "0",
    ]


def m2_encoder(ctx: Context) -> dict[str, Any]:
    """M²-Encoder 0.4B with tiled GBA-ITC at each (ZeRO stage, grad_accum) of the profile: samples/s and peak memory at
    a fixed micro-batch for every setting first, then, with the time left, the largest micro-batch that fits
    (doubling until out of memory, within the time)."""
    p = ctx.profile
    digits = corpora.digits(ctx.data, p.dry_run)
    settings = list(p.m2_settings)
    results: list[dict] = ctx.partial.setdefault("settings", [])
    errors: list[str] = []

    def trial(zero: int, accum: int, batch: int, search: bool, share_end: float) -> dict:
        steps = p.search_steps if search else p.steps
        config = m2_config(p, digits, batch, zero, accum, search)
        run = mmpt_run(
            f"m2 ZeRO-{zero} accum{accum} b{batch}{' search' if search else ''}",
            ctx.work,
            config,
            steps,
            batch * accum,
            zero_stage=zero,
            grad_accum=accum,
        )
        return ctx.runner.run(run, max(1.0, share_end - time.monotonic()), p.warmup)

    # Throughput first: an equal share each, half a share kept for the batch searches (a ZeRO-3 run of the 0.4B at
    # grad_accum 4 was stopped at 83 s on an H100 after 10 of its 15 steps, 31 s of it starting).
    for index, (zero, accum) in enumerate(settings):
        share_end = time.monotonic() + ctx.left() / (len(settings) - index + 0.5)
        measured = search_batch(
            lambda b, z=zero, a=accum, end=share_end: trial(z, a, b, False, end), p.m2_batch, p.m2_batch, share_end
        )
        fit = measured["largest_fit"]
        throughput = next((t for t in measured["trials"] if t["batch"] == fit), None) or next(
            (t for t in measured["trials"] if t.get("partial")),
            None,  # stopped early: the steps it logged
        )
        results.append(
            {
                "zero_stage": zero,
                "grad_accum": accum,
                "throughput": throughput,
                "throughput_trials": measured["trials"],
                "largest_fit": fit,
                "first_oom": measured["first_oom"],
                "stopped_by": measured["stopped_by"] if not fit else "not searched",
                "search_trials": [],
            }
        )
        if throughput is None or throughput.get("partial"):
            errors.append(f"ZeRO-{zero} accum {accum}: no throughput run completed ({measured['stopped_by']})")
    searched = [r for r in results if r["largest_fit"]]
    for index, result in enumerate(searched):  # the largest micro-batch, with what is left
        if ctx.left() < p.m2_search_min_s:
            result["stopped_by"] = "time"
            continue
        share_end = time.monotonic() + ctx.left() / (len(searched) - index)
        zero, accum, fit = result["zero_stage"], result["grad_accum"], result["largest_fit"]
        search = search_batch(
            lambda b, z=zero, a=accum, end=share_end: trial(z, a, b, True, end),
            2 * fit,
            p.m2_batch_cap,
            share_end,
            known_fit=fit,
        )
        result.update(
            largest_fit=search["largest_fit"],
            first_oom=search["first_oom"] or result["first_oom"],
            stopped_by=search["stopped_by"],
            search_trials=search["trials"],
        )
    errors += [
        f"ZeRO-{r['zero_stage']} accum {r['grad_accum']}: {t['status']}: {t.get('error')}"
        for r in results
        for t in r["throughput_trials"] + r["search_trials"]
        if t["status"] == "error"
    ]
    return {
        "config": "configs/m2_encoder/0.4b.yaml",
        "precision": p.precision,
        "loss": "gba_itc",
        "tile_size": p.m2_tile,
        "steps": p.steps,
        "warmup_steps": p.warmup,
        "search_steps": p.search_steps,
        "batch_cap": p.m2_batch_cap,
        "loader_workers": p.workers,
        "settings": results,
        "errors": errors,
    }


def m2_config(p: Profile, digits: Path, batch: int, zero: int, accum: int, search: bool) -> dict:
    """The shipped 0.4B config on the digits shards; batch-size trials leave RandAugment out (memory only)."""
    config = {
        "extends": str(REPO / "configs/m2_encoder/0.4b.yaml"),
        "method": {
            "tokenizer": str(digits / "tokenizer.json"),
            "init_from": None,
            "zeroshot": {"dataset": None},
            "loss": {"accumulation_steps": None, "tile_size": p.m2_tile},
        },
        "data": {
            "train": {
                "sources": [{"shards": str(digits / f"train/{lang}-*.tar")} for lang in ("en", "zh")],
                "batch_size": batch,
                "num_workers": p.workers,
                "shuffle_buffer": 1000,
            }
        },
        "train": {"zero_stage": zero, "grad_accum": accum, "precision": p.precision},
    }
    deep_update(config, p.m2_overrides)
    if search:
        deep_update(config, {"method": {"augment": {"randaugment": False}}})
    return config


def training_configs(p: Profile, data: Path) -> dict[str, dict]:
    """Every config a profile trains (whether or not its corpora exist yet), by run name: for checking them."""
    digits = data / "digits"
    configs = {f"clip ZeRO-{zero}": clip_config(p, digits, zero) for zero in (0, 2)}
    configs.update(
        {
            f"m2 ZeRO-{zero} accum{accum}{' search' if search else ''}": m2_config(
                p, digits, p.m2_batch, zero, accum, search
            )
            for zero, accum in p.m2_settings
            for search in (False, True)
        }
    )
    configs["victor"] = victor_config(p, data / "moving_digits", "pyav")
    configs["space2"] = space2_config(p, data / "dialogs", data / "bert")
    return configs


def loss_memory(ctx: Context) -> dict[str, Any]:
    """Peak memory and time of the loss's forward + backward alone, given embeddings (D = 512, fp32), world 1:
    GBA-ITC untiled and tiled against open_clip's ClipLoss, the batch doubling until out of memory."""

    from benchmarks.contrastive_loss import DIM, variants

    p = ctx.profile
    ensure_process_group(p.device)
    losses = variants(1, p.loss_batch)
    results = []
    for index, (name, _, loss) in enumerate(losses):
        loss_trial(loss, p.loss_batch, p.device)  # warm the kernels once, at the first trial's shapes
        share_end = time.monotonic() + ctx.left() / (len(losses) - index)
        found = search_batch(
            lambda rows, loss=loss: loss_trial(loss, rows, p.device),
            p.loss_batch,
            p.loss_batch_cap,
            share_end,
            growth=4.0,
        )  # time grows with b^2
        results.append({"variant": name, **found})
    if p.device.startswith("cuda"):
        torch.cuda.empty_cache()
    errors = [
        f"{r['variant']} b={t['batch']}: {t.get('error')}"
        for r in results
        for t in r["trials"]
        if t["status"] == "error"
    ]
    return {
        "dim": DIM,
        "dtype": "float32",
        "tile_size": tile_of(losses),
        "world_size": 1,
        "memory": "torch.cuda.max_memory_allocated above the features"
        if p.device.startswith("cuda")
        else "resident set above the features (CPU)",
        "variants": results,
        "errors": errors,
    }


def tile_of(losses: list) -> int | None:
    return next((getattr(loss, "tile_size", 0) for _, _, loss in losses if getattr(loss, "tile_size", 0)), None)


def loss_trial(loss, rows: int, device: str) -> dict[str, Any]:
    """One forward + backward of `loss` on random unit features: its time and peak memory above the features."""
    from probe import is_oom

    from benchmarks.contrastive_loss import DIM, PeakMemory

    image = text = scale = None
    try:
        image = F.normalize(torch.randn(rows, DIM, device=device), dim=-1).requires_grad_()
        text = F.normalize(torch.randn(rows, DIM, device=device), dim=-1).requires_grad_()
        scale = torch.tensor([14.0], device=device, requires_grad=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            started = time.perf_counter()
            loss(image, text, scale).backward()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            with PeakMemory() as memory:
                started = time.perf_counter()
                loss(image, text, scale).backward()
                seconds = time.perf_counter() - started
            peak = memory.extra_mb
        return {"status": "ok", "peak_mib": peak, "wall_s": seconds}
    except RuntimeError as exc:  # torch.OutOfMemoryError, or cuBLAS failing to allocate its workspace
        if not is_oom(exc):
            raise
        return {"status": "oom", "error": " ".join(str(exc).split())[:300], "wall_s": 0.0}
    finally:
        del image, text, scale
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def victor(ctx: Context) -> dict[str, Any]:
    """VICTOR base (configs/victor/base.yaml) in bf16, a few steps: samples/s and peak memory at the config's
    batch, halved while it does not fit."""
    p = ctx.profile
    clips = corpora.moving_digits(ctx.data, p.dry_run)
    backend = video_backend()
    return {
        **one_method(ctx, "victor", victor_config(p, clips, backend), p.victor_batch),
        "config": "configs/victor/base.yaml",
        "video_backend": backend,
    }


def victor_config(p: Profile, clips: Path, backend: str) -> dict:
    config = {
        "extends": str(REPO / "configs/victor/base.yaml"),
        "method": {
            "tokenizer": str(clips / "tokenizer.json"),
            "video": {"backbone_weights": None},
            "retrieval": {"dataset": None},
            "backend": backend,
        },
        "data": {
            "train": {
                "sources": [{"shards": str(clips / f"train/{lang}-*.tar")} for lang in ("en", "zh")],
                "num_workers": p.workers,
                "shuffle_buffer": 200,
            }
        },
        "train": {"precision": p.precision},
    }
    return deep_update(config, p.victor_overrides)


def video_backend() -> str:
    """decord where it is installed (VICTOR's default on x86_64), else PyAV (on the GPU unless decord is carried)."""
    from mmpt.data.video import default_backend

    return default_backend()


def space2(ctx: Context) -> dict[str, Any]:
    """SPACE-2 base (configs/space2/base.yaml: a BERT-base encoder) in bf16, a few steps: samples/s and peak memory."""
    p = ctx.profile
    dialogs = corpora.dialogs(ctx.data)
    encoder = corpora.bert_checkpoint(ctx.data / ("bert-tiny" if p.dry_run else "bert-base"), dialogs, p.dry_run)
    return {
        **one_method(ctx, "space2", space2_config(p, dialogs, encoder), p.space2_batch),
        "config": "configs/space2/base.yaml",
        "encoder": "random BERT, bert-base shape" if not p.dry_run else "random BERT, 2 x 32",
    }


def space2_config(p: Profile, dialogs: Path, encoder: Path) -> dict:
    config = {
        "extends": str(REPO / "configs/space2/base.yaml"),
        "method": {"encoder": str(encoder), "intent_eval": {"dataset": None}},
        "data": {
            "train": {
                "sources": [
                    {"name": kind, "shards": str(dialogs / f"shards/{kind}-*.tar")}
                    for kind in ("labelled", "unlabelled")
                ],
                "num_workers": p.workers,
                "shuffle_buffer": 1000,
            }
        },
        "train": {"precision": p.precision},
    }
    return deep_update(config, p.space2_overrides)


def one_method(ctx: Context, name: str, config: dict, batch: int | None) -> dict[str, Any]:
    """A few steps of a config at its batch (or `batch`), halving the batch while it runs out of memory."""
    from mmpt.config_loader import load_config

    p = ctx.profile
    config_batch = load_config(config["extends"]).data.train.batch_size  # validating reads no data
    start = batch or config_batch

    def trial(b: int) -> dict:
        sized = deep_update(copy.deepcopy(config), {"data": {"train": {"batch_size": b}}})  # config stays as given
        return ctx.runner.run(mmpt_run(f"{name} b{b}", ctx.work, sized, p.steps, b), max(1.0, ctx.left()), p.warmup)

    found = search_batch(trial, start, start, ctx.deadline)
    measured = next((t for t in found["trials"] if t["batch"] == found["largest_fit"]), None)
    errors = [f"b={t['batch']}: {t['status']}: {t.get('error')}" for t in found["trials"] if t["status"] == "error"]
    if measured is None:
        errors.append(f"no run completed ({found['stopped_by']})")
    return {
        "precision": p.precision,
        "config_batch": config_batch,
        "start_batch": start,
        "batch": found["largest_fit"],
        "steps": p.steps,
        "warmup_steps": p.warmup,
        "loader_workers": p.workers,
        "run": measured,
        "trials": found["trials"],
        "errors": errors,
    }


def ensure_process_group(device: str) -> str:
    """A process group of one (NCCL on the GPU, gloo on CPU), or the one this process already has."""
    from mmpt import distributed as mdist

    if not dist.is_initialized():
        mdist.ensure_rendezvous_env()
        if device.startswith("cuda"):
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)
    return dist.get_backend()


def nccl(ctx: Context) -> dict[str, Any]:
    """Every collective the losses, mmpt.distributed and ZeRO call, once each on a world of one, results checked."""
    from mmpt import distributed as mdist

    device = ctx.profile.device
    backend = ensure_process_group(device)
    x = torch.arange(12, dtype=torch.float32, device=device).reshape(4, 3)

    def gather_with_grad() -> bool:
        # mmpt.distributed.all_gather_with_grad returns its input on one rank: call its autograd Function directly,
        # so the all_gather forward and the reduce-scatter backward both run.
        leaf = x.clone().requires_grad_()
        out = mdist._GatherWithGrad.apply(leaf, None, (leaf.shape[0],))
        out.backward(torch.ones_like(out))
        return leaf.grad is not None and torch.equal(out, x) and torch.equal(leaf.grad, torch.ones_like(x))

    def all_gather() -> bool:
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x)
        return torch.equal(parts[0], x)

    def all_gather_into_tensor() -> bool:
        out = torch.empty_like(x)
        dist.all_gather_into_tensor(out, x)
        return torch.equal(out, x)

    def reduce_scatter_tensor() -> bool:
        out = torch.empty_like(x)
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM)
        return torch.equal(out, x)

    def all_reduce() -> bool:
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return torch.equal(y, x)

    def broadcast() -> bool:
        y = x.clone()
        dist.broadcast(y, src=0)
        return torch.equal(y, x)

    def all_gather_object() -> bool:  # variable-size payloads: SPACE-2's labels
        labels = [{"DEFAULT_DOMAIN": {"intent": {"slot": ["value"] * 3}}}, {}]
        parts: list = [None]
        dist.all_gather_object(parts, labels)
        return parts[0] == labels

    def subgroup_all_gather() -> bool:  # GBA-ITC's gathering groups
        group = dist.new_group([0])
        if not isinstance(group, dist.ProcessGroup):
            return False  # this rank is not in the group it made
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x, group=group)
        return torch.equal(parts[0], x)

    def reduce_scatter_rows() -> bool:
        return torch.equal(mdist.reduce_scatter_rows(x.clone(), None), x)

    def barrier() -> bool:
        dist.barrier()
        return True

    checks = {
        "all_gather_with_grad (all_gather + reduce-scatter backward)": gather_with_grad,
        "all_gather": all_gather,
        "all_gather_into_tensor": all_gather_into_tensor,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "reduce_scatter_rows": reduce_scatter_rows,
        "all_reduce (sum)": all_reduce,
        "broadcast": broadcast,
        "all_gather_object (variable size)": all_gather_object,
        "new_group + all_gather": subgroup_all_gather,
        "barrier": barrier,
    }
    nccl_only = {"reduce_scatter_tensor"}  # gloo has none; mmpt emulates it there with scatters
    statuses: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name, check in checks.items():
        if backend != "nccl" and name in nccl_only:
            statuses[name] = SKIPPED_ON_GLOO
            continue
        try:
            started = time.perf_counter()
            ok = check()
            synchronize(device)
            seconds[name] = time.perf_counter() - started
            statuses[name] = "ok" if ok else "wrong result"
        except Exception as exc:  # reported per collective
            statuses[name] = f"error: {type(exc).__name__}: {exc}"[:300]
    errors = [f"{k}: {v}" for k, v in statuses.items() if v not in ("ok", SKIPPED_ON_GLOO)]
    return {
        "backend": backend,
        "nccl_version": nccl_version() if backend == "nccl" else None,
        "world_size": dist.get_world_size(),
        "note": WORLD_ONE_NOTE,
        "collectives": statuses,
        "seconds": seconds,
        "errors": errors,
    }


# ----------------------------------------------------------------------------- torch.compile


def clip_compile(ctx: Context) -> dict[str, Any]:
    """One ViT-B/16 CLIP training step (bf16 autocast, the contrastive loss, AdamW) eager and with both towers
    under plain torch.compile: step time, the first compiled steps (the compilation), peak memory, sync warnings."""
    from probe import SyncWarnings

    p = ctx.profile
    modes: dict[str, dict[str, Any]] = ctx.partial.setdefault("modes", {})
    for index, mode in enumerate(("eager", "compiled")):
        share_end = time.monotonic() + ctx.left() / (2 - index)
        with SyncWarnings() as syncs:
            modes[mode] = compile_trial(p, mode == "compiled", share_end)
        modes[mode].update(syncs.record())
    eager, compiled = modes["eager"].get("step_s"), modes["compiled"].get("step_s")
    return {
        "model": Path(p.clip_model).stem,
        "batch": p.clip_batch,
        "precision": "bf16 autocast",
        "backend": p.compile_backend,
        "compiled": "model.clip.encode_image and model.clip.encode_text, each through torch.compile",
        "steps": p.steps,
        "warmup_steps": p.warmup,
        "modes": modes,
        "speedup": eager / compiled if eager and compiled else None,
        "errors": [f"{mode}: {r['error']}" for mode, r in modes.items() if r.get("error")],
    }


def compile_trial(p: Profile, compiled: bool, deadline: float) -> dict[str, Any]:
    """Steps of the CLIP model on one fixed random batch until `p.warmup + p.steps` or `deadline`."""
    from mmpt.losses import ContrastiveLoss
    from mmpt.models.open_clip_model import OpenClipModel

    torch.manual_seed(0)
    model = OpenClipModel(p.clip_model).to(p.device)
    if compiled:
        model.clip.encode_image = torch.compile(model.clip.encode_image, backend=p.compile_backend)
        model.clip.encode_text = torch.compile(model.clip.encode_text, backend=p.compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    loss_fn = ContrastiveLoss()
    images, tokens = clip_batch(p.clip_model, p.clip_batch, p.device)
    if p.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seconds: list[float] = []
    record: dict[str, Any] = {"error": None}
    try:
        while len(seconds) < p.warmup + p.steps:
            if seconds and time.monotonic() + max(seconds[-1], 0.0) > deadline:
                record["error"] = f"out of time after {len(seconds)} steps"
                break
            started = time.perf_counter()
            with torch.autocast(torch.device(p.device).type, dtype=torch.bfloat16):
                image_features, text_features, scale = model(images, tokens)
                loss = loss_fn(image_features.float(), text_features.float(), scale)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(p.device)
            seconds.append(time.perf_counter() - started)
    finally:
        del model, optimizer, images, tokens
        if p.device.startswith("cuda"):
            record["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.empty_cache()
    timed = seconds[p.warmup :]
    step = statistics.median(timed) if timed else None
    return {
        **record,
        "steps_run": len(seconds),
        "first_step_s": seconds[0] if seconds else None,
        "warmup_s": sum(seconds[: p.warmup]),
        "step_s": step,
        "samples_per_s": p.clip_batch / step if step else None,
    }


# ----------------------------------------------------------------------------- the data loader


def data_loader(ctx: Context) -> dict[str, Any]:
    """samples/s of mmpt's training loader (the open_clip method's: JPEG decode, open_clip's training transform
    at the model's size, tokenizer, uint8 batches through StatefulLoader) on this machine's CPU cores, for a few
    worker counts up to one per core, on generated web-like JPEG shards."""
    p = ctx.profile
    cores = os.cpu_count() or 1
    counts = sorted({max(1, min(w, cores)) for w in (*p.loader_workers, cores)})
    shards, generator = loader_corpus(ctx.data / "web_jpeg", p.loader_images, p.loader_image_sizes)
    runs: list[dict[str, Any]] = ctx.partial.setdefault("runs", [])
    for index, workers in enumerate(counts):
        share = ctx.left() / (len(counts) - index)
        runs.append(loader_trial(ctx, shards, workers, share))
    return {
        "model": Path(p.clip_model).stem,
        "cores": cores,
        "batch": p.loader_batch,
        "images": p.loader_images,
        "images_from": generator,
        "timed_s": p.loader_seconds,
        "runs": runs,
        "errors": [f"{r['workers']} workers: {r['error']}" for r in runs if r.get("error")],
    }


def loader_trial(ctx: Context, shards: str, workers: int, share: float) -> dict[str, Any]:
    """Batches through the loader a training run builds: two to warm up (worker start, first shards), then as
    many as `p.loader_seconds` (or what is left of `share`) take."""
    import gc

    import yaml

    from mmpt.config_loader import load_config
    from mmpt.data import StatefulLoader
    from mmpt.methods import get_method

    p = ctx.profile
    run_dir = ctx.work / "runs" / f"loader-w{workers}"
    loader = {"sources": [{"shards": shards}], "batch_size": p.loader_batch}
    config = deep_update(clip_config(p, ctx.data, 0), {"data": {"train": {**loader, "num_workers": workers}}})
    path = ctx.work / "configs" / f"loader-w{workers}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(deep_update(config, benchmark_settings(run_dir, 1)), sort_keys=False))
    cfg = load_config(path)
    method = get_method(cfg.method_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    method.prepare(cfg, run_dir)
    end = time.monotonic() + share
    started = time.perf_counter()
    batches = iter(StatefulLoader(method.train_data(cfg, run_dir, rank=0, world_size=1)))
    record: dict[str, Any] = {"workers": workers, "error": None}
    try:
        next(batches)
        record["first_batch_s"] = time.perf_counter() - started
        next(batches)
        timed_from, count, batch = time.perf_counter(), 0, {}
        stop = min(time.monotonic() + p.loader_seconds, end)
        while time.monotonic() < stop or count == 0:
            batch = next(batches)
            count += 1
        seconds = time.perf_counter() - timed_from
        record.update(
            batches_timed=count,
            seconds=seconds,
            samples_per_s=count * p.loader_batch / seconds,
            samples_per_s_per_worker=count * p.loader_batch / seconds / workers,
            image_shape=list(batch["image"].shape),
            image_dtype=str(batch["image"].dtype),
        )
    except Exception as exc:  # recorded per worker count
        record["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    finally:
        del batches  # its DataLoader's workers end with it
        gc.collect()
    return record


def loader_corpus(folder: Path, count: int, sides: tuple[int, int]) -> tuple[str, str]:
    """(shard pattern, what made it): benchmarks/web_images.py's photo-like corpus where it is, one shard per
    core written in parallel (`count` images, or at least one per shard); else the simpler JPEGs below."""
    try:
        from benchmarks.web_images import write_shard
    except ImportError:
        return str(web_jpeg_shards(folder, count, sides) / "train/web-*.tar"), "stages.web_jpeg_shards"
    from concurrent.futures import ProcessPoolExecutor

    shards = max(1, min(os.cpu_count() or 1, count))
    per_shard = max(1, count // shards)
    done = folder / "web_images" / "complete"
    if not done.is_file():
        done.parent.mkdir(parents=True, exist_ok=True)
        with ProcessPoolExecutor(shards) as pool:
            list(pool.map(write_shard, [done.parent] * shards, range(shards), [per_shard] * shards, [0] * shards))
        done.write_text(str(shards * per_shard))
    return str(done.parent / "*.tar"), "benchmarks/web_images.py"


def web_jpeg_shards(folder: Path, count: int, sides: tuple[int, int]) -> Path:
    """`count` JPEGs of varied size and aspect (sides in `sides`), quality 70-95, smooth gradients under shapes
    and sensor-like noise (what photos on the web cost to decode, unlike flat test images), with captions, in
    tar shards of 64. Built once per folder."""
    import numpy as np
    from PIL import Image, ImageDraw

    from mmpt.data.shards import ShardSetWriter

    done = folder / "train" / "complete"
    if done.is_file():
        return folder
    rng, noise = random.Random(0), np.random.default_rng(0)
    colours = ["red", "green", "blue", "yellow", "white", "black", "orange", "purple"]
    with ShardSetWriter(folder / "train" / "web", max_samples=64) as writer:
        for index in range(count):
            width, height = rng.randint(*sides), rng.randint(*sides)
            y, x = np.mgrid[0:height, 0:width].astype(np.float32)
            base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * rng.uniform(120, 255)
            pixels = np.clip(base + noise.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
            image = Image.fromarray(pixels)
            draw = ImageDraw.Draw(image)
            shapes = []
            for _ in range(rng.randint(2, 6)):
                colour = rng.choice(colours)
                box = sorted(rng.sample(range(width), 2)), sorted(rng.sample(range(height), 2))
                (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(
                    [box[0][0], box[1][0], box[0][1], box[1][1]], fill=colour
                )
                shapes.append(colour)
            encoded = io.BytesIO()
            image.save(encoded, "JPEG", quality=rng.randint(70, 95))
            caption = f"a photo with {', '.join(shapes)} shapes on a gradient"
            writer.write({"__key__": f"{index:06d}", "jpg": encoded.getvalue(), "txt": caption})
    done.write_text(str(count))
    return folder


def nccl_version() -> str | None:
    """torch's NCCL version as a string (torch reports a tuple, older releases an int)."""
    if not torch.cuda.is_available():
        return None
    from torch.cuda import nccl as cuda_nccl

    version = cuda_nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


STAGES: dict[str, Callable[[Context], dict[str, Any]]] = {  # in the order of plan.py's commands
    "clip_vitb16": clip_vitb16,
    "clip_profile": clip_profile,
    "m2_encoder": m2_encoder,
    "loss_memory": loss_memory,
    "space2": space2,
    "victor": victor,
    "clip_compile": clip_compile,
    "nccl": nccl,
    "data_loader": data_loader,
}
