"""Bad-data soak: two sources of web-like shards with every kind of damage mixed in at known places,
trained on 2 ranks and resumed once; the counts the run reports must equal the damage it read."""

import io
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import REPO, deepspeed_command, launcher_env, read_metrics, tiny_config, write_config
from mmpt.data import ShardSetWriter
from mmpt.data.stream import ShardStream, read_shard
from mmpt.engine.stops import EXIT_DATA
from pool import scenario

SHARDS, PER_SHARD = 6, 24
GARBAGE, EMPTY, NO_CAPTION = 19, 23, 29  # every n-th sample of a source (counted from its first)


def image_bytes(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), color=(value, 255 - value, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def damage_of(index: int) -> str | None:
    """The damage written into a source's `index`-th sample (one kind at most)."""
    if index % GARBAGE == GARBAGE - 1:
        return "undecodable"  # garbage bytes
    if index % EMPTY == EMPTY - 1:
        return "undecodable"  # a zero-byte image
    if index % NO_CAPTION == NO_CAPTION - 1:
        return "missing_field"
    return None


def write_source(folder: Path, name: str, captions: list[str]) -> dict[str, dict]:
    """Shards of one source and, per shard, what reading it to its end yields: {shard url: expected counts
    when fully read, plus `reasons`: the skip reason (or None) of each sample it yields, in order}."""
    with ShardSetWriter(folder / name, max_samples=PER_SHARD) as writer:
        for index in range(SHARDS * PER_SHARD):
            sample = {
                "__key__": f"{name}{index:04d}",
                "png": image_bytes(index % 256),
                "txt": captions[index % len(captions)],
            }
            kind = damage_of(index)
            if index % GARBAGE == GARBAGE - 1:
                sample["png"] = b"\x89PNG garbage"
            elif index % EMPTY == EMPTY - 1:
                sample["png"] = b""
            elif kind == "missing_field":
                del sample["txt"]
            writer.write(sample)
    shards = sorted(str(p) for p in folder.glob(f"{name}-*.tar"))
    plan = {
        url: {"reasons": [damage_of(i * PER_SHARD + k) for k in range(PER_SHARD)], "lost": 0, "broken": 0, "unsized": 0}
        for i, url in enumerate(shards)
    }
    # Shard 1: cut inside the caption of its 10th sample, which keeps its image (sizes.json knows its size).
    cut_at = 9
    _cut_inside(shards[1], f"{name}{PER_SHARD + cut_at:04d}.txt")
    plan[shards[1]].update(
        reasons=plan[shards[1]]["reasons"][:cut_at] + ["missing_field"], lost=PER_SHARD - cut_at - 1, broken=1
    )
    # Shard 3: the header of its 6th sample's first file overwritten: the rest of the shard is unreadable.
    _overwrite_header(shards[3], f"{name}{3 * PER_SHARD + 5:04d}.")
    plan[shards[3]].update(reasons=plan[shards[3]]["reasons"][:5], lost=PER_SHARD - 5, broken=1)
    if name == "en":
        # Shard 4: not a tar at all; shard 5: cut, and its size unknown to sizes.json.
        Path(shards[4]).write_bytes(b"<html>503 Service Unavailable</html>" * 40)
        plan[shards[4]].update(reasons=[], lost=PER_SHARD, broken=1)
        _cut_inside(shards[5], f"{name}{5 * PER_SHARD + 14:04d}.txt")
        plan[shards[5]].update(reasons=plan[shards[5]]["reasons"][:14] + ["missing_field"], lost=0, broken=1, unsized=1)
        sizes = json.loads((folder / "sizes.json").read_text())
        del sizes[Path(shards[5]).name]
        (folder / "sizes.json").write_text(json.dumps(sizes))
    return plan


def _cut_inside(url: str, member: str) -> None:
    data = Path(url).read_bytes()
    offset = next(m for m in tarfile.open(url).getmembers() if m.name == member).offset_data
    Path(url).write_bytes(data[: offset + 2])


def _overwrite_header(url: str, key_prefix: str) -> None:
    data = Path(url).read_bytes()
    offset = min(m.offset for m in tarfile.open(url).getmembers() if m.name.startswith(key_prefix))
    Path(url).write_bytes(data[:offset] + b"\x17" * 512 + data[offset + 512 :])


def counts_read(plan: dict[str, dict], fully: list[str], partly: tuple[str, int] | None) -> dict[str, int]:
    """What reading `fully` to their ends and the first `partly[1]` samples of `partly[0]` must count."""
    total = dict.fromkeys(
        ("seen", "decoded", "missing_field", "undecodable", "lost", "broken_shards", "unsized_broken_shards"), 0
    )
    reads = [(plan[url]["reasons"], plan[url]) for url in fully]
    if partly is not None:
        reads.append((plan[partly[0]]["reasons"][: partly[1]], None))
    for reasons, ended in reads:
        total["seen"] += len(reasons)
        total["decoded"] += reasons.count(None)
        total["missing_field"] += reasons.count("missing_field")
        total["undecodable"] += reasons.count("undecodable")
        if ended is not None:
            total["lost"] += ended["lost"]
            total["broken_shards"] += ended["broken"]
            total["unsized_broken_shards"] += ended["unsized"]
    return total


def expected_counts(plan: dict[str, dict], urls: list[str], position: dict, slot: int, slots: int, seed: int):
    """Counts implied by one reader's saved position (epoch, shard, sample), from the damage plan alone."""
    reader = ShardStream(urls, slot=slot, num_slots=slots, seed=seed, mode="epoch")
    fully = [url for epoch in range(position["epoch"]) for url in reader.shard_order(epoch)]
    order = reader.shard_order(position["epoch"])
    fully += order[: position["shard_pos"]]
    partly = (order[position["shard_pos"]], position["member"]) if position["shard_pos"] < len(order) else None
    return counts_read(plan, fully, partly)


def write_damaged_web(folder: Path, digits_root: Path) -> dict[str, dict]:
    """Two damaged sources, en and zh, in `folder`; their damage plans (also in `folder`/plans.json)."""
    captions = [s["txt"] for _, s in read_shard(str(sorted((digits_root / "train").glob("en-*.tar"))[0]))][:50]
    plans = {name: write_source(folder, name, captions) for name in ("en", "zh")}
    (folder / "plans.json").write_text(json.dumps(plans))
    return plans


@pytest.fixture(scope="module")
def damaged_web(module_tmp, digits_root) -> tuple[Path, dict[str, dict]]:
    folder = module_tmp("web")
    return folder, write_damaged_web(folder, digits_root)


def damaged_config(folder: Path, run_dir: Path, digits_root: Path, max_skip_rate: float) -> dict:
    data = {
        "train": {
            "sources": [{"shards": str(folder / f"{name}-*.tar"), "name": name} for name in ("en", "zh")],
            "mode": "epoch",
            "shuffle_buffer": 0,
            "num_workers": 1,
            "batch_size": 12,
            "max_skip_rate": max_skip_rate,
            "min_samples_for_skip_rate": 20,
        }
    }
    return tiny_config(digits_root, run_dir, data=data, train={"max_steps": 14, "save_every": 5})


@scenario("bad-data-through")
def damaged_but_usable(corpora, run_dir):
    """Stopped after the checkpoint at step 5, then resumed to 14, into the second epoch."""
    folder = run_dir.parent / "damaged-web"
    folder.mkdir()
    write_damaged_web(folder, corpora["digits"])
    return damaged_config(folder, run_dir, corpora["digits"], max_skip_rate=0.25), [], "stop_at:5"


@pytest.mark.pool("bad-data-through")
def test_damaged_web_shards_train_through_with_exact_counts(rank_pool):
    run_dir = rank_pool.run_dir("bad-data-through")
    plans = json.loads((run_dir.parent / "damaged-web/plans.json").read_text())
    assert any(line.startswith("resumed from") for line in rank_pool.record("bad-data-through")["said"])

    from mmpt.engine import checkpoint

    states = checkpoint.rank_states(checkpoint.find_resume(run_dir, "auto"))
    summary = json.loads((run_dir / "summary.json").read_text())["data"]
    epochs = set()
    for index, name in enumerate(plans):
        urls = sorted(plans[name])
        expected = dict.fromkeys(counts_read({}, [], None), 0)
        for rank, state in enumerate(states):
            (position,) = state["data"]["positions"].values()
            reader = position["stream"]["sources"][index]
            epochs.add(reader["epoch"])
            for key, value in expected_counts(plans[name], urls, reader, rank, 2, seed=0).items():
                expected[key] += value
        reported = summary[name]
        assert {k: reported[k] for k in expected if k not in ("missing_field", "undecodable")} == {
            k: v for k, v in expected.items() if k not in ("missing_field", "undecodable")
        }, name
        assert (reported["skipped/missing_field"], reported["skipped/undecodable"]) == (
            expected["missing_field"],
            expected["undecodable"],
        ), name
        assert expected["lost"] and expected["missing_field"] and expected["undecodable"]  # every damage was met
    assert 1 in epochs  # the readers went past a whole epoch of damaged shards
    assert torch.isfinite(torch.tensor([r["loss/total"] for r in read_metrics(run_dir) if "loss/total" in r])).all()


@pytest.mark.distributed
def test_too_much_damage_stops_in_one_line_per_rank(tmp_path, digits_root, damaged_web):
    config = write_config(
        tmp_path / "cfg.yaml", damaged_config(damaged_web[0], tmp_path / "run", digits_root, max_skip_rate=0.02)
    )
    result = subprocess.run(
        deepspeed_command(config), cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_DATA and "Traceback" not in output
    lines = [line for line in output.splitlines() if line.startswith("mmpt: ")]
    assert 1 <= len(lines) <= 2, lines  # the rank(s) whose readers crossed the limit, or one of them and a peer
    pattern = (
        r"mmpt: (rank \d: )?data error: (source '(en|zh)'|all sources): \d+ of \d+ samples could not be "
        r"used \(([a-z_]+ \d+(, )?)+; commonest: [a-z_]+\), more than max_skip_rate=0.02"
        r"(, most from source '(en|zh)')?; last failure: sample '(en|zh)\d+' of .*\.tar: .+"
    )
    assert any(re.fullmatch(pattern, line) for line in lines), lines
