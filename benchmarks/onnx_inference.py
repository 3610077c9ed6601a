"""CPU inference time per tower: mmpt (torch, fp32, eager) against onnxruntime on the ONNX export.

Models: each method's demo config at its own size (random weights: time does not depend on them), and
the official-size M²-Encoder 0.4B (`configs/m2_encoder/0.4b.yaml` without its initial weights). Each
tower is exported as `launch/export.py --format onnx` exports it (`mmpt.export.to_onnx.export_tower`),
then both run the same inputs: images at the tower's size, text and dialogs at their full length
(what the tokenizers pad to), batch 1 and 8. A measurement is the mean time of as many calls as fill
about `--seconds` (at least one), after `--warmup` calls; torch (`torch.inference_mode`) and
onnxruntime (CPUExecutionProvider, default graph optimisations) alternate, `--repeats` measurements
each. Both run on `--threads` threads (default 1: on a shared machine a multi-threaded run stalls at
every parallel region whenever another process holds one of its cores, and measures the neighbours more
than the model; `--threads 0` leaves both at their defaults, every core). The largest
|onnxruntime - torch| of the features is reported too. The text towers of the demo configs use
the digits tokenizer's vocabulary (VICTOR's demo has the moving-digits one: a lookup table of another
size, the same cost).

The machine may be shared: the load average before and after is written with the results.
Results: benchmarks/results/onnx_inference.{json,md}.

    python benchmarks/onnx_inference.py                # ~10 minutes on 2 cores, the 0.4B model most of it
    python benchmarks/onnx_inference.py --no-large     # the demo-sized models only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BATCHES = (1, 8)


def models(digits: Path, large: bool) -> list[tuple[str, str, list[str]]]:
    """(label, config file, overrides) of each model measured."""
    tokenizer = f"method.tokenizer={digits}/tokenizer.json"
    found = [
        ("clip demo", "configs/clip/demo.yaml", [tokenizer]),
        ("open_clip demo", "configs/open_clip/demo.yaml", [f"method.model={REPO}/mmpt/models/bench-vit-tiny.json"]),
        ("m2_encoder demo", "configs/m2_encoder/demo.yaml", [tokenizer]),
        ("victor demo", "configs/victor/demo.yaml", [tokenizer]),
        ("space2 demo", "configs/space2/demo.yaml", []),
    ]
    if large:
        found.append(("m2_encoder 0.4B", "configs/m2_encoder/0.4b.yaml", ["method.init_from=null", tokenizer]))
    return found


def build(config: str, overrides: list[str], files: Path):
    from mmpt.config_loader import load_config
    from mmpt.methods import get_method

    cfg = load_config(REPO / config, [*overrides, "data.prepare=null"])
    method = get_method(cfg.method_name)
    files.mkdir(parents=True, exist_ok=True)
    method.prepare(cfg, files)
    torch.manual_seed(0)
    return method.build_model(cfg, files).eval(), cfg


def measure(run, seconds: float, warmup: int) -> tuple[float, int]:
    """(mean seconds per call, calls) over about `seconds` of calls."""
    for _ in range(warmup):
        run()
    started = time.perf_counter()
    run()
    single = time.perf_counter() - started
    calls = max(1, int(seconds / max(single, 1e-6)))
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls, calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="time filled by one measurement's calls")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-large", dest="large", action="store_false", help="leave out the 0.4B M2-Encoder")
    parser.add_argument("--threads", type=int, default=1, help="threads of each runtime; 0: their defaults")
    args = parser.parse_args()

    import onnxruntime

    from mmpt.demo.digits import build_digits
    from mmpt.export.to_onnx import export_tower
    from mmpt.export.towers import towers

    options = onnxruntime.SessionOptions()
    if args.threads:
        torch.set_num_threads(args.threads)
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
    load_before = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="mmpt-onnx-bench-"))
    digits = build_digits(scratch / "digits")
    rows = []
    for label, config, overrides in models(digits, args.large):
        model, cfg = build(config, overrides, scratch / label.replace(" ", "-") / "files")
        parameters = sum(p.numel() for p in model.parameters())
        for tower in towers(model, cfg):
            path = scratch / label.replace(" ", "-") / tower.file
            started = time.perf_counter()
            export_tower(tower, path)
            export_seconds = time.perf_counter() - started
            session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            for batch in BATCHES:
                inputs = tower.example(batch, tower.max_sequence, seed=batch)
                feeds = {spec.name: x.numpy() for spec, x in zip(tower.inputs, inputs)}

                def run_torch(inputs=inputs, module=tower.module):
                    with torch.inference_mode():
                        return module(*inputs)

                def run_onnx(feeds=feeds, session=session):
                    return session.run(None, feeds)[0]

                error = float(abs(run_onnx() - run_torch().numpy()).max())
                times: dict[str, list[float]] = {"torch": [], "onnxruntime": []}
                calls: dict[str, list[int]] = {"torch": [], "onnxruntime": []}
                for _ in range(args.repeats):  # alternating
                    for name, run in (("torch", run_torch), ("onnxruntime", run_onnx)):
                        seconds, count = measure(run, args.seconds, args.warmup)
                        times[name].append(seconds * 1000)
                        calls[name].append(count)
                shape = [
                    batch if d == "batch" else tower.max_sequence if d == "sequence" else d
                    for d in tower.inputs[0].shape
                ]
                row = {
                    "model": label,
                    "parameters": parameters,
                    "tower": tower.name,
                    "batch": batch,
                    "input": f"{tower.inputs[0].name} {tower.inputs[0].dtype} {shape}",
                    "export_seconds": round(export_seconds, 1),
                    "max_abs_difference": error,
                    "ms": {name: [round(t, 3) for t in values] for name, values in times.items()},
                    "calls_per_measurement": calls,
                }
                rows.append(row)
                torch_ms, ort_ms = (statistics.median(times[n]) for n in ("torch", "onnxruntime"))
                print(
                    f"{label} {tower.name} batch {batch}: torch {torch_ms:.2f} ms, onnxruntime {ort_ms:.2f} ms "
                    f"({torch_ms / ort_ms:.2f}x), max |diff| {error:.1e}",
                    flush=True,
                )
            del session
            path.unlink()
            data = path.with_name(path.name + ".data")
            if data.exists():
                data.unlink()
        del model
    load_after = os.getloadavg()

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "threads": {"torch": torch.get_num_threads(), "onnxruntime": args.threads or "default (one per core)"},
        "load_average_1_5_15_min": {"before": list(load_before), "after": list(load_after)},
        "setup": {
            "repeats": args.repeats,
            "seconds_per_measurement": args.seconds,
            "warmup_calls": args.warmup,
            "batches": list(BATCHES),
        },
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "onnx_inference.json").write_text(json.dumps(record, indent=1) + "\n")
    (RESULTS / "onnx_inference.md").write_text(markdown(record))
    print(f"wrote {RESULTS / 'onnx_inference.md'}")
    return 0


def markdown(record: dict) -> str:
    before = ", ".join(f"{v:.2f}" for v in record["load_average_1_5_15_min"]["before"])
    after = ", ".join(f"{v:.2f}" for v in record["load_average_1_5_15_min"]["after"])
    versions = record["versions"]
    setup = record["setup"]
    lines = [
        "# ONNX inference: mmpt (torch) vs onnxruntime, CPU",
        "",
        f"{record['date']}, {record['machine']}; python {versions['python']}, torch {versions['torch']}, "
        f"onnxruntime {versions['onnxruntime']}; threads: torch {record['threads']['torch']}, onnxruntime "
        f"{record['threads']['onnxruntime']}. fp32, random weights; {setup['repeats']} measurements each (alternating), each the mean of as "
        f"many calls as fill {setup['seconds_per_measurement']} s after {setup['warmup_calls']} warm-up calls. "
        f"Load average (1, 5, 15 min) before: {before}; after: {after} (a shared machine). "
        "Produced by `benchmarks/onnx_inference.py`.",
        "",
        "| model | tower | batch | input | torch ms/call min / median / max | onnxruntime ms/call min / median / max "
        "| torch / onnxruntime | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        t, o = row["ms"]["torch"], row["ms"]["onnxruntime"]
        ratio = statistics.median(t) / statistics.median(o)
        lines.append(
            f"| {row['model']} ({row['parameters'] / 1e6:.1f}M) | {row['tower']} | {row['batch']} | `{row['input']}` | "
            f"{min(t):.2f} / {statistics.median(t):.2f} / {max(t):.2f} | "
            f"{min(o):.2f} / {statistics.median(o):.2f} / {max(o):.2f} | {ratio:.2f}x | {row['max_abs_difference']:.1e} |"
        )
    lines += [
        "",
        "torch / onnxruntime above 1: onnxruntime is faster. Inputs at full length: text at the tokenizer's "
        "context length, dialogs at `max_len`. The max abs diff compares the L2-normalised features of both on "
        "the measured batch.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
