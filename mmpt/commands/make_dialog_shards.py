"""Write SPACE-2 training shards from dialog corpora, with a report of everything skipped.

    python launch/make_dialog_shards.py --out shards/space2 \
        --labelled data/AnPreDial/*/train.json --intent data/banking77/train.csv \
        --unlabelled data/UnPreDial/*.jsonl

--labelled: SPACE-2 json files ({dialog id: {"turns": [{role, text, label}]}}, label
{domain: {intent: {slot: [{"value": ..., "span": [start, end] or null}]}}}, as in AnPreDial); --intent:
DialoGLUE-style CSVs (text,category), as one-turn labelled dialogs; --unlabelled: UnPreDial json files of
the same layout (labels ignored) or jsonl, one {"id", "turns"} per line. Writes labelled-*.tar,
unlabelled-*.tar, sizes.json and report.json (every skipped dialog, its file and why) into --out.

Exit 2 when an input file is missing (nothing is written); exit 3 when more than --max-skip-rate of a set's
dialogs were skipped (the shards and report.json are written, to look at).
"""

from __future__ import annotations

import argparse
import json
import sys

from mmpt.commands import installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--labelled", nargs="*", default=[])
    parser.add_argument("--intent", nargs="*", default=[])
    parser.add_argument("--unlabelled", nargs="*", default=[])
    parser.add_argument("--trigger-role", default="user", help="user, system or user_system (substring test)")
    parser.add_argument("--max-turns", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=2000)
    parser.add_argument(
        "--max-skip-rate",
        type=float,
        default=0.1,
        help="fail (exit 3) when more than this fraction of the labelled or unlabelled dialogs are skipped",
    )
    args = parser.parse_args(argv)

    from mmpt.data.dialog import write_dialog_shards
    from mmpt.data.shards import DataError

    reports = write_dialog_shards(
        args.out,
        labelled=args.labelled,
        unlabelled=args.unlabelled,
        intent=args.intent,
        trigger_role=args.trigger_role,
        max_turns=args.max_turns,
        shard_size=args.shard_size,
    )
    summary = {name: {k: v for k, v in r.to_dict().items() if k != "skipped_records"} for name, r in reports.items()}
    print(json.dumps(summary, indent=2))
    for name, report in reports.items():
        for file, dialog_id, reason in report.skipped[:20]:
            print(f"skipped {name}: {file} dialog {dialog_id!r}: {reason}", file=sys.stderr)
    for name, report in reports.items():
        if report.skip_rate() > args.max_skip_rate:
            raise DataError(
                f"{len(report.skipped)} of {report.dialogs + len(report.skipped)} {name} dialogs were "
                f"skipped, more than --max-skip-rate={args.max_skip_rate} (commonest: "
                f"{report.commonest_reason()}); every one is listed in {args.out}/report.json"
            )
    return 0


run = installed(main)
