"""gpu.md from the suite's record (gpu.json): the machine at the top, then one table per stage.

Built from whatever stage records there are, after every stage: a stage may be `running` (the command ended while
it ran) or `timed_out` with what it measured before its cap; a run stopped at its share of the time shows the steps
it logged (marked partial)."""

from __future__ import annotations

from typing import Any

TITLES = {
    "clip_vitb16": "open_clip ViT-B/16, bf16, 1 GPU: mmpt vs open_clip_train",
    "m2_encoder": "M²-Encoder 0.4B, GBA-ITC (tiled), bf16",
    "loss_memory": "Contrastive loss alone: GBA-ITC vs open_clip ClipLoss, world 1",
    "space2": "SPACE-2 base, bf16",
    "victor": "VICTOR base, bf16",
    "clip_compile": "ViT-B/16 in mmpt's trainer with `train.compile: true`",
}
RUN_COLUMNS = [
    "run",
    "status",
    "global batch",
    "samples/s",
    "step s",
    "data s",
    "forward s",
    "TFLOP/s",
    "MFU",
    "peak GiB",
    "wall s",
]


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def run_row(run: dict) -> list[str]:
    status = run["status"] + (" (partial)" if run.get("partial") else "")
    mfu = run.get("mfu")
    return [
        run["name"],
        status,
        fmt(run.get("global_batch")),
        fmt(run.get("samples_per_s")),
        fmt(run.get("step_s"), 3),
        fmt(run.get("data_s"), 3),
        fmt(run.get("forward_s"), 3),
        fmt(run.get("tflops"), 0),
        "n/a" if mfu is None else f"{100 * mfu:.1f}%",
        fmt(run.get("peak_gib"), 2),
        fmt(run.get("wall_s"), 0),
    ]


def loss_lines(r: dict) -> list[str]:
    lines = [
        f"D = {r.get('dim', 512)}, float32, tile {r.get('tile_size')} columns; memory: {r.get('memory')}. The batch "
        "doubles until out of memory or until the next trial would not finish in time.",
        "",
        *table(
            ["loss", "largest b that fits", "first OOM", "stopped by"],
            [[v["variant"], fmt(v["largest_fit"]), fmt(v["first_oom"]), v["stopped_by"]] for v in r["variants"]],
        ),
        "",
    ]
    rows = [
        [v["variant"], str(t["batch"]), t["status"], fmt(t.get("peak_mib")), fmt(1000 * t["wall_s"], 1)]
        for v in r["variants"]
        for t in v["trials"]
    ]
    return [*lines, *table(["loss", "b", "status", "peak MiB", "time ms"], rows)]


def markdown(record: dict) -> str:
    env = record.get("environment") or {}
    gpu, versions = env.get("gpu"), env.get("versions", {})
    machine = f"{gpu['name']} ({gpu['memory_total']}, driver {gpu['driver']})" if gpu else "no GPU"
    lines = [
        "# GPU benchmarks",
        "",
        f"{env.get('date')} · {machine} · {env.get('cpu_count')} CPU cores · "
        + " · ".join(f"{name} {version}" for name, version in versions.items() if version),
        "",
        "Produced by `bash benchmarks/gpu/run.sh` (`benchmarks/gpu/suite.py`); every raw figure is in gpu.json. mmpt's "
        "figures are what its trainer logs in metrics.jsonl (rank 0, medians of the steps after the warm-up; TFLOP/s "
        "and MFU where the trainer logs them), open_clip_train's what its log says (data and whole-step time).",
    ]
    if record.get("dry_run"):
        lines.append("**Dry run** on CPU with tiny shapes: it checks the suite, its figures say nothing about a GPU.")
    rows = [
        [name, s["status"], fmt(s.get("seconds"), 0), fmt(s.get("cap_s"), 0), s.get("error") or ""]
        for name, s in record["stages"].items()
    ]
    lines += ["", *table(["stage", "status", "seconds", "cap s", "error"], rows)]
    for name, stage in record["stages"].items():
        results = stage.get("results")
        if not results:
            continue
        lines += ["", f"## {TITLES.get(name, name)} (`{name}`)", ""]
        if name == "loss_memory":
            lines += loss_lines(results) if results.get("variants") else []
        else:
            lines += table(RUN_COLUMNS, [run_row(run) for run in results.get("runs", [])])
    return "\n".join(lines) + "\n"
