"""gpu.md from the suite's record (gpu.json): the machine at the top, then one section and table per stage.

Built from whatever stage records there are, after every stage: a stage may be `running` (the command ended
while it ran), `timed_out` with what it measured before its cap, or have partial results."""

from __future__ import annotations

from typing import Any

TITLES = {
    "clip_vitb16": "open_clip ViT-B/16, bf16, 1 GPU: mmpt vs open_clip_train",
    "m2_encoder": "M²-Encoder 0.4B, GBA-ITC (tiled), bf16",
    "loss_memory": "Contrastive loss alone: GBA-ITC vs open_clip ClipLoss, world 1",
    "victor": "VICTOR base, bf16",
    "space2": "SPACE-2 base, bf16",
    "nccl": "NCCL collectives",
    "clip_compile": "torch.compile on and off: a ViT-B/16 CLIP training step",
    "clip_profile": "Where a ViT-B/16 step's time goes: mmpt's trainer under torch.profiler",
    "data_loader": "mmpt's loader on the machine's CPU cores: generated JPEG shards",
}
STATUS_NOTES = {
    "running": "did not finish: the command ended while this stage ran",
    "timed_out": "stopped at its cap",
}


def fmt(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value * scale:.{digits}f}"
    return str(value)


def sig(value: float | None) -> str:
    """Three significant digits: TFLOP figures span a CPU's fractions to a GPU's hundreds."""
    return "n/a" if value is None else f"{value:.3g}"


def gib(mib: float | None) -> str:
    return fmt(None if mib is None else mib / 1024, 2)


def peak(run: dict) -> str:
    """Peak allocated GiB, with the phase of the step it came in where the probe recorded phases."""
    phases = run.get("peak_allocated_mib_by_phase")
    where = f" ({max(phases, key=phases.__getitem__)})" if phases else ""
    return gib(run.get("peak_allocated_mib")) + where


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def header(record: dict) -> list[str]:
    env = record["environment"]
    gpu = env.get("gpu") or {}
    versions = env.get("versions", {})
    machine = (
        f"{gpu.get('name')} ({gpu.get('memory_total')}, driver {gpu.get('driver')})"
        if gpu
        else f"no GPU ({env.get('cpu_count')} CPU cores)"
    )
    lines = [
        "# GPU benchmarks",
        "",
        f"{env['date']} · {machine} · torch {versions.get('torch')} · CUDA {versions.get('cuda')} · "
        f"cuDNN {versions.get('cudnn')} · NCCL {versions.get('nccl')} · deepspeed {versions.get('deepspeed')} · "
        f"open_clip {versions.get('open_clip_torch')} · Python {versions.get('python')}",
        "",
        "Produced by `bash benchmarks/gpu/run.sh` (`benchmarks/gpu/suite.py`); every raw figure is in gpu.json.",
    ]
    if record.get("dry_run"):
        lines.append("**Dry run** on CPU with tiny shapes: it checks the suite, its figures say nothing about a GPU.")
    if record.get("machines"):
        lines.append("Stages ran on: " + ", ".join(f"{k}: {v}" for k, v in record["machines"].items()) + ".")
    rows = [
        [
            name,
            stage["status"],
            fmt(stage.get("group")),
            fmt(stage.get("seconds"), 0),
            fmt(stage.get("cap_s"), 0),
            fmt(stage.get("finished") or stage.get("started")),
        ]
        for name, stage in record["stages"].items()
    ]
    return [*lines, "", *table(["stage", "status", "command", "seconds", "cap s", "recorded"], rows), ""]


def syncs(run: dict) -> str:
    """Sync warnings of a run as `in steps / all`, or what kept the count off."""
    if run.get("sync_debug") is None:
        return "n/a"
    if run["sync_debug"] != "warn":
        return "off"
    return f"{run.get('sync_warnings_in_steps', 'n/a')} / {run['sync_warnings']}"


def clip_section(r: dict) -> list[str]:
    matmul = r["matmul"]
    lines = [
        f"Batch {r['batch']}, {r['steps']} steps of which the first {r['warmup_steps']} are not timed (medians), "
        f"{r['loader_workers']} loader workers, model `{r['model']}`. mmpt ZeRO-0: autocast over fp32 weights "
        "(open_clip's amp_bf16); mmpt ZeRO-2: DeepSpeed bf16 (bf16 weights, fp32 master copy); open_clip_train: "
        f"`--precision {r['open_clip_precision']}` (autocast). Step times are "
        "what each trainer logs, timed on the host: mmpt's forward time has no device synchronisation, so "
        "kernels still running when it returns count in backward + optimizer; open_clip logs data and whole-step "
        "time only, and its log reads the loss after its step timer stops, so its data time holds the wait for "
        "the previous step's kernels (compare whole steps). "
        'Sync warnings: `torch.cuda.set_sync_debug_mode("warn")` was on in every run; counted while '
        "the steps ran / in all (setup included).",
        f"FLOPs per step (FlopCounterMode, forward + backward): {sig(r['flops_per_step'] / 1e12)} TFLOP. "
        f"Measured dense bf16 matmul ({matmul['size']}³): **{sig(matmul['tflops'])} TFLOP/s**. "
        f"Nominal: {fmt(r['nominal_peak_tflops'], 0)} TFLOP/s ({r['nominal_note']}).",
        "",
    ]
    rows = []
    for run in r["runs"]:
        if run["status"] != "ok":
            rows.append([run["name"], fmt(run.get("zero_stage")), run["status"], *["n/a"] * 12])
            continue
        rows.append(
            [
                run["name"],
                fmt(run.get("zero_stage")),
                "ok",
                fmt(run["samples_per_s"]),
                fmt(run["step_s"], 3),
                fmt(run["data_s"], 3),
                fmt(run["compute_s"], 3),
                fmt(run["forward_s"], 3),
                fmt(run["backward_optimizer_s"], 3),
                peak(run),
                gib(run.get("peak_reserved_mib")),
                sig(run.get("achieved_tflops")),
                pct(run.get("mfu_measured_peak")),
                pct(run.get("mfu_nominal_peak")),
                syncs(run),
            ]
        )
    return [
        *lines,
        *table(
            [
                "trainer",
                "ZeRO",
                "status",
                "samples/s",
                "step s",
                "data s",
                "fwd+bwd+opt s",
                "forward s",
                "bwd+opt s",
                "peak alloc GiB",
                "peak reserved GiB",
                "TFLOP/s",
                "MFU (measured peak)",
                "MFU (nominal)",
                "sync warnings (steps / all)",
            ],
            rows,
        ),
    ]


def m2_section(r: dict) -> list[str]:
    lines = [
        f"`{r['config']}` on the digits shards, tile {r['tile_size']} columns, {r['loader_workers']} loader "
        f"workers. samples/s at the fixed micro-batch ({r['steps']} steps, first {r['warmup_steps']} not timed); "
        f"then the micro-batch doubles ({r['search_steps']}-step trials, RandAugment off) until it runs out of "
        f"memory, reaches {r['batch_cap']}, or the stage's time is up.",
        "",
    ]
    rows = []
    for s in r["settings"]:
        t = s.get("throughput") or {}
        rows.append(
            [
                str(s["zero_stage"]),
                str(s["grad_accum"]),
                fmt(t.get("batch")),
                fmt(t.get("samples_per_s"))
                + (f" (stopped after {t['steps_logged']} steps)" if t.get("partial") else ""),
                fmt(t.get("step_s"), 3),
                fmt(t.get("data_s"), 3),
                peak(t),
                fmt(s["largest_fit"]),
                fmt(s["first_oom"]),
                s["stopped_by"],
                syncs(t),
            ]
        )
    lines += table(
        [
            "ZeRO",
            "grad_accum",
            "micro-batch",
            "samples/s",
            "step s",
            "data s",
            "peak alloc GiB",
            "largest micro-batch that fits",
            "first OOM",
            "search stopped by",
            "sync warnings (steps / all)",
        ],
        rows,
    )
    trials = [
        [
            str(s["zero_stage"]),
            str(s["grad_accum"]),
            str(t["batch"]),
            t["status"],
            gib(t.get("peak_allocated_mib")),
            fmt(t.get("wall_s"), 0),
        ]
        for s in r["settings"]
        for t in s["throughput_trials"] + s["search_trials"]
    ]
    return [
        *lines,
        "",
        "Trials:",
        "",
        *table(["ZeRO", "grad_accum", "micro-batch", "status", "peak alloc GiB", "wall s"], trials),
    ]


def loss_section(r: dict) -> list[str]:
    lines = [
        f"Forward + backward of the loss alone on given features: D = {r['dim']}, {r['dtype']}, tile "
        f"{r['tile_size']} columns, world {r['world_size']}; memory is {r['memory']}. The batch doubles until "
        "out of memory or the next trial would not finish in time (time grows as b²).",
        "",
    ]
    summary = [[v["variant"], fmt(v["largest_fit"]), fmt(v["first_oom"]), v["stopped_by"]] for v in r["variants"]]
    lines += table(["loss", "largest b that fits", "first OOM", "stopped by"], summary)
    rows = [
        [v["variant"], str(t["batch"]), t["status"], fmt(t.get("peak_mib"), 1), fmt(t.get("wall_s"), 1, 1000)]
        for v in r["variants"]
        for t in v["trials"]
    ]
    return [*lines, "", *table(["loss", "b", "status", "peak MiB", "time ms"], rows)]


def method_section(r: dict) -> list[str]:
    run = r.get("run") or {}
    extra = {"video decoder": r.get("video_backend"), "encoder": r.get("encoder")}
    notes = ", ".join(f"{k}: {v}" for k, v in extra.items() if v)
    lines = [
        f"`{r['config']}` ({notes}), {r['steps']} steps, the first {r['warmup_steps']} not timed, "
        f"{r['loader_workers']} loader workers; the batch starts at {r['start_batch']} (the config's: "
        f"{r['config_batch']}) and halves while it does not fit.",
        "",
    ]
    row = [
        fmt(r["batch"]),
        fmt(run.get("samples_per_s")),
        fmt(run.get("step_s"), 3),
        fmt(run.get("data_s"), 3),
        fmt(run.get("forward_s"), 3),
        peak(run),
        gib(run.get("peak_reserved_mib")),
        syncs(run),
    ]
    header = ["batch", "samples/s", "step s", "data s", "forward s", "peak alloc GiB", "peak reserved GiB"]
    return [*lines, *table([*header, "sync warnings (steps / all)"], [row])]


def nccl_section(r: dict) -> list[str]:
    rows = [[name, status, fmt(r["seconds"].get(name), 4)] for name, status in r["collectives"].items()]
    return [
        f"Backend {r['backend']} (NCCL {fmt(r['nccl_version'])}), world size {r['world_size']}. **{r['note']}.**",
        "",
        *table(["collective", "result", "seconds"], rows),
    ]


def compile_section(r: dict) -> list[str]:
    lines = [
        f"`{r['model']}`, batch {r['batch']}, {r['precision']}, AdamW, one fixed random batch; compiled: "
        f"{r['compiled']} (backend `{r['backend']}`). {r['steps']} steps timed after {r['warmup_steps']} (the first "
        f"compiled ones compile; their time is the warm-up column). Speedup (eager / compiled step time): "
        f"**{fmt(r.get('speedup'), 2)}x**.",
        "",
    ]
    rows = [
        [
            mode,
            fmt(m.get("samples_per_s")),
            fmt(m.get("step_s"), 4),
            fmt(m.get("first_step_s"), 1),
            fmt(m.get("warmup_s"), 1),
            gib(m.get("peak_allocated_mib")),
            syncs(m),
            m.get("error") or "",
        ]
        for mode, m in r["modes"].items()
    ]
    header = ["mode", "samples/s", "step s", "first step s", "warm-up s", "peak alloc GiB", "sync warnings", "note"]
    return [*lines, *table(header, rows)]


def profile_section(r: dict) -> list[str]:
    lines = [
        f"`{r['model']}`, batch {r['batch']}, {r['precision']}: steps {r['profiled_steps']} of mmpt's trainer under "
        "torch.profiler, logging only after them. Device busy: the sum of kernel times per step; idle: the "
        "share of the wall step the device ran no kernel.",
        "",
    ]
    rows, tops = [], []
    for run in r["runs"]:
        prof = run.get("profile") or {}
        copies = prof.get("memcpy_per_step") or {}
        rows.append(
            [
                run["name"],
                run["status"],
                fmt(prof.get("wall_s_per_step"), 4),
                fmt(prof.get("device_busy_s_per_step"), 4),
                pct(prof.get("device_idle_share")),
                fmt(prof.get("kernels_per_step"), 0),
                " / ".join(f"{fmt(copies.get(kind), 0)}" for kind in ("HtoD", "DtoH", "DtoD")) if copies else "n/a",
                run.get("error") or "",
            ]
        )
        for op in prof.get("top_ops", [])[:10]:
            tops.append([run["name"], f"`{op['name']}`", fmt(op["calls_per_step"], 0), fmt(op["ms_per_step"], 2)])
    header = [
        "run",
        "status",
        "wall s/step",
        "device busy s/step",
        "device idle",
        "kernels/step",
        "copies/step HtoD / DtoH / DtoD",
        "error",
    ]
    measure = next((op["measure"] for run in r["runs"] for op in (run.get("profile") or {}).get("top_ops", [])), "")
    return [
        *lines,
        *table(header, rows),
        "",
        f"Operators with the most {measure or 'time'} per step:",
        "",
        *table(["run", "operator", "calls/step", "ms/step"], tops),
    ]


def loader_section(r: dict) -> list[str]:
    lines = [
        f"The open_clip method's training loader for `{r['model']}` (StatefulLoader over BatchStream: JPEG decode, "
        f"open_clip's training transform, tokenizer, uint8 batches of {r['batch']}) on {r['cores']} CPU cores, "
        f"reading about {r['images']} generated JPEGs (`{r['images_from']}`) resampled; "
        f"each worker count timed for {fmt(r['timed_s'], 0)} s after two batches.",
        "",
    ]
    rows = [
        [
            str(run["workers"]),
            fmt(run.get("samples_per_s")),
            fmt(run.get("samples_per_s_per_worker")),
            fmt(run.get("first_batch_s"), 1),
            fmt(run.get("batches_timed")),
            run.get("error") or "",
        ]
        for run in r["runs"]
    ]
    return [*lines, *table(["workers", "samples/s", "per worker", "first batch s", "batches", "error"], rows)]


SECTIONS = {
    "clip_vitb16": clip_section,
    "m2_encoder": m2_section,
    "loss_memory": loss_section,
    "victor": method_section,
    "space2": method_section,
    "nccl": nccl_section,
    "clip_compile": compile_section,
    "clip_profile": profile_section,
    "data_loader": loader_section,
}


def markdown(record: dict) -> str:
    lines = header(record)
    for name, stage in record["stages"].items():
        lines += [f"## {TITLES.get(name, name)} (`{name}`)", ""]
        if stage["status"] != "ok":
            note = stage.get("error") or STATUS_NOTES.get(stage["status"], "")
            lines += [f"**{stage['status']}**: {note}", ""]
        if stage.get("results"):
            try:
                lines += SECTIONS[name](stage["results"])
            except (KeyError, TypeError, ZeroDivisionError) as exc:  # partial results of a failed stage
                lines.append(f"(incomplete results: {type(exc).__name__}: {exc})")
        lines.append("")
    return "\n".join(lines)
