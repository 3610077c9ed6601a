"""Write SPACE-2 training shards from dialog corpora, with a report of everything skipped.

    python launch/make_dialog_shards.py --out shards/space2 \
        --labelled data/AnPreDial/*/train.json --intent data/banking77/train.csv \
        --unlabelled data/UnPreDial/*.jsonl

--labelled: SPACE-2 json files ({dialog id: {"turns": [{role, text, label}]}}); --intent: DialoGLUE-style
CSVs (text,category), as one-turn labelled dialogs; --unlabelled: jsonl, one {"id", "turns"} per line.
Writes labelled-*.tar, unlabelled-*.tar, sizes.json and report.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--labelled", nargs="*", default=[])
    parser.add_argument("--intent", nargs="*", default=[])
    parser.add_argument("--unlabelled", nargs="*", default=[])
    parser.add_argument("--trigger-role", default="user", help="user, system or user_system (substring test)")
    parser.add_argument("--max-turns", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=2000)
    args = parser.parse_args(argv)

    from mmpt.data.dialog import write_dialog_shards

    reports = write_dialog_shards(args.out, labelled=args.labelled, unlabelled=args.unlabelled, intent=args.intent,
                                  trigger_role=args.trigger_role, max_turns=args.max_turns,
                                  shard_size=args.shard_size)
    summary = {name: {k: v for k, v in r.to_dict().items() if k != "skipped_records"} for name, r in reports.items()}
    print(json.dumps(summary, indent=2))
    for name, report in reports.items():
        for file, dialog_id, reason in report.skipped[:20]:
            print(f"skipped {name}: {file} dialog {dialog_id!r}: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from mmpt import cli

    sys.exit(cli.run(main))
