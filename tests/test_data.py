import io
import json
import re
import tarfile
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmpt.data import (
    BatchStream,
    DataError,
    MissingFieldError,
    ShardSetWriter,
    Source,
    StatefulLoader,
    StreamSpec,
    counts,
)
from mmpt.data.image_text import decode_image, decode_text
from mmpt.data.loader import SkipPolicy
from mmpt.data.shards import count_samples, expand_shards
from mmpt.data.stream import ShardStream, read_shard


def png_bytes(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (4, 4), color=value).save(buffer, format="PNG")
    return buffer.getvalue()


def write_set(folder, n=40, per_shard=5, prefix="part", corrupt=(), drop_text=()):
    with ShardSetWriter(folder / prefix, max_samples=per_shard) as writer:
        for i in range(n):
            sample = {"__key__": f"{i:05d}", "png": png_bytes(i % 256), "txt": f"caption {i}", "cls": str(i)}
            if i in corrupt:
                sample["png"] = sample["png"][: len(sample["png"]) // 2]  # truncated image bytes
            if i in drop_text:
                del sample["txt"]
            writer.write(sample)
    return str(folder / f"{prefix}-*.tar")


def decode(sample):
    image = decode_image(sample["png"])
    if "txt" not in sample:
        raise MissingFieldError(f"sample {sample['__key__']!r} has no text field")
    return {
        "pixel": torch.tensor(image.getpixel((0, 0))[0]),
        "id": torch.tensor(int(decode_text(sample["cls"]))),
        "augment": torch.rand(1)[0],  # stands for a random transform: must replay identically on resume
    }


def subset(actual: dict, **expected) -> bool:
    """Whether `actual` has every expected count (shows both when not)."""
    picked = {k: actual[k] for k in expected}
    assert picked == expected, (picked, expected)
    return True


def ids_of(batches):
    return [int(i) for b in batches for i in b["id"]]


def test_shard_round_trip(tmp_path):
    samples = [
        {"__key__": f"k{i}", "png": png_bytes(i), "txt": f"字 {i}", "json": json.dumps({"i": i})} for i in range(13)
    ]
    with ShardSetWriter(tmp_path / "rt", max_samples=5) as writer:
        for sample in samples:
            writer.write(sample)
    urls = expand_shards(str(tmp_path / "rt-{000000..000002}.tar"))
    assert len(urls) == 3 and count_samples(urls) == 13
    assert json.loads((tmp_path / "sizes.json").read_text()) == {
        "rt-000000.tar": 5,
        "rt-000001.tar": 5,
        "rt-000002.tar": 3,
    }
    read = [s for url in urls for _, s in read_shard(url)]
    assert [s["__key__"] for s in read] == [s["__key__"] for s in samples]
    for original, back in zip(samples, read):
        assert (
            back["png"] == original["png"]
            and back["txt"].decode() == original["txt"]
            and back["json"].decode() == original["json"]
        )


def test_missing_shards_are_named(tmp_path):
    with pytest.raises(DataError, match="no shard matches"):
        expand_shards(str(tmp_path / "nothing-*.tar"))
    with pytest.raises(DataError, match="does not exist"):
        expand_shards(str(tmp_path / "x-{000000..000001}.tar"))
    with pytest.raises(DataError, match=r"is a folder: name its shards \(.*/\*\.tar or "):
        expand_shards(f"{tmp_path}/")


def test_a_missing_relative_shard_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """A config's paths are relative to the command's directory, not the config file's: the error says which."""
    monkeypatch.chdir(tmp_path)
    for pattern in ("shards/{0..1}.tar", "shards/*.tar"):
        with pytest.raises(DataError, match=f"relative to {re.escape(str(tmp_path))}"):
            expand_shards(pattern)
    with pytest.raises(DataError) as absolute:
        expand_shards(str(tmp_path / "shards/0.tar"))
    assert "relative to" not in str(absolute.value)


def test_a_glob_over_img2dataset_output_means_its_tars(tmp_path):
    for name in ("00000.tar", "00000_stats.json", "00000.parquet", "00001.tar", "sizes.json"):
        (tmp_path / name).write_bytes(b"")
    assert expand_shards(f"{tmp_path}/*") == [f"{tmp_path}/00000.tar", f"{tmp_path}/00001.tar"]
    assert expand_shards(f"{tmp_path}/*.parquet") == [f"{tmp_path}/00000.parquet"]  # what was asked, without tars


def test_epoch_mode_ranks_and_workers_read_disjoint_samples_covering_the_dataset(tmp_path):
    pattern = write_set(tmp_path, n=43, per_shard=5)  # 9 shards, uneven last shard
    urls = expand_shards(pattern)
    per_slot = []
    for slot in range(4):  # 2 ranks x 2 workers
        stream = ShardStream(urls, slot=slot, num_slots=4, seed=3, mode="epoch", shuffle_buffer=7, max_epochs=1)
        per_slot.append([s["__key__"] for s in stream])
    seen = [key for keys in per_slot for key in keys]
    assert len(seen) == len(set(seen)) == 43

    # The same through the rank-level loader with 2 workers per rank.
    by_rank = []
    for rank in range(2):
        spec = StreamSpec(
            [Source.from_pattern(pattern)],
            batch_size=4,
            seed=3,
            mode="epoch",
            shuffle_buffer=7,
            rank=rank,
            world_size=2,
            num_workers=2,
            max_epochs=1,
            drop_last=False,
        )
        by_rank.append(ids_of(StatefulLoader(BatchStream(spec, decode))))
    assert not set(by_rank[0]) & set(by_rank[1])
    assert sorted(by_rank[0] + by_rank[1]) == list(range(43))


def test_epoch_mode_needs_enough_shards(tmp_path):
    pattern = write_set(tmp_path, n=10, per_shard=5)  # 2 shards
    spec = StreamSpec(
        [Source.from_pattern(pattern, name="tiny")], batch_size=2, mode="epoch", world_size=2, num_workers=2
    )
    with pytest.raises(DataError, match="2 shards cannot feed 4 readers"):
        BatchStream(spec, decode)


def test_next_epoch_reshuffles_and_resampled_is_deterministic(tmp_path):
    urls = expand_shards(write_set(tmp_path, n=30, per_shard=5))
    stream = ShardStream(urls, slot=0, num_slots=1, seed=0, mode="epoch", shuffle_buffer=10, max_epochs=2)
    keys = [s["__key__"] for s in stream]
    assert sorted(keys[:30]) == sorted(keys[30:]) and keys[:30] != keys[30:]

    def resampled(seed):
        stream = ShardStream(urls, slot=1, num_slots=2, seed=seed, shuffle_buffer=10)
        return [s["__key__"] for s in islice(stream, 50)]

    assert resampled(1) == resampled(1) != resampled(2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_sample_exact(tmp_path, num_workers):
    en = write_set(tmp_path, n=60, per_shard=6, prefix="en")
    zh = write_set(tmp_path, n=60, per_shard=6, prefix="zh")

    def loader():
        spec = StreamSpec(
            [Source.from_pattern(en), Source.from_pattern(zh, weight=2.0)],
            batch_size=5,
            seed=7,
            shuffle_buffer=9,
            rank=1,
            world_size=2,
            num_workers=num_workers,
        )
        return StatefulLoader(BatchStream(spec, decode))

    uninterrupted = loader()
    reference = list(islice(uninterrupted, 23))

    first = loader()
    head = list(islice(first, 11))  # stop after an odd number of batches
    state = json.loads(json.dumps(first.state_dict()))  # must survive serialisation
    resumed = loader()
    resumed.load_state_dict(state)
    tail = list(islice(resumed, 12))
    assert ids_of(head + tail) == ids_of(reference)
    for key in ("pixel", "augment"):
        torch.testing.assert_close(torch.cat([b[key] for b in head + tail]), torch.cat([b[key] for b in reference]))


def test_resume_rejects_a_different_layout(tmp_path):
    pattern = write_set(tmp_path, n=20, per_shard=5)
    spec = StreamSpec([Source.from_pattern(pattern)], batch_size=2, num_workers=1)
    first = StatefulLoader(BatchStream(spec, decode))
    next(iter(first))
    other = StatefulLoader(BatchStream(StreamSpec([Source.from_pattern(pattern)], batch_size=2, num_workers=2), decode))
    with pytest.raises(DataError, match="Resume with the same layout"):
        other.load_state_dict(first.state_dict())


def test_mixing_follows_weights(tmp_path):
    en = write_set(tmp_path, n=50, per_shard=10, prefix="en")
    zh = write_set(tmp_path / "zh", n=50, per_shard=10, prefix="zh")
    streams = [Source.from_pattern(en, 1.0, "en"), Source.from_pattern(zh, 3.0, "zh")]
    spec = StreamSpec(streams, batch_size=1, shuffle_buffer=0)
    sources = Counter()

    def tag_source(sample):
        sources[sample["__source__"]] += 1
        return {"x": torch.zeros(1)}

    for _ in islice(StatefulLoader(BatchStream(spec, tag_source)), 2000):
        pass
    assert 0.70 < sources["zh"] / 2000 < 0.80


def test_corrupt_sample_is_skipped_and_counted(tmp_path, caplog):
    pattern = write_set(tmp_path, n=30, per_shard=10, corrupt={4, 17})
    spec = StreamSpec(
        [Source.from_pattern(pattern)], batch_size=4, mode="epoch", shuffle_buffer=0, max_epochs=1, drop_last=False
    )
    loader = StatefulLoader(BatchStream(spec, decode), SkipPolicy(max_rate=0.5, min_samples=1))
    ids = ids_of(loader)
    assert sorted(ids) == sorted(set(range(30)) - {4, 17})
    assert subset(loader.counts(), seen=30, decoded=28, skipped=2, undecodable=2, missing_field=0, lost=0)
    assert "'00004'" in caplog.text and "part-000000.tar" in caplog.text


def test_skip_rate_limit_fails_with_the_last_error(tmp_path):
    pattern = write_set(tmp_path, n=30, per_shard=10, corrupt=set(range(0, 30, 3)))
    spec = StreamSpec([Source.from_pattern(pattern)], batch_size=4, mode="epoch", shuffle_buffer=0, max_epochs=1)
    with pytest.raises(
        DataError,
        match=r"could not be used \(undecodable \d+; commonest: undecodable\), more than "
        r"max_skip_rate=0.1; "
        r"last failure: sample '000\d\d'",
    ):
        list(StatefulLoader(BatchStream(spec, decode), SkipPolicy(max_rate=0.1, min_samples=10)))


def text_decoder():
    from mmpt.data.image_text import ImageTextDecoder

    return ImageTextDecoder(
        lambda image: torch.zeros(1),
        lambda texts: {"input_ids": torch.zeros(len(texts), 2), "attention_mask": torch.zeros(len(texts), 2)},
    )


def test_sample_missing_a_field_is_skipped_and_counted(tmp_path, caplog):
    pattern = write_set(tmp_path, n=10, per_shard=5, drop_text={3, 7})
    spec = StreamSpec(
        [Source.from_pattern(pattern)], batch_size=2, shuffle_buffer=0, mode="epoch", max_epochs=1, drop_last=False
    )
    loader = StatefulLoader(BatchStream(spec, text_decoder()), SkipPolicy(max_rate=0.5, min_samples=1))
    assert sum(len(b["image"]) for b in loader) == 8
    assert subset(loader.counts(), seen=10, decoded=8, skipped=2, missing_field=2, undecodable=0)
    assert re.search(r"skipped sample '00003' of .*part-000000.tar has no text field \(looked for txt", caplog.text)


def test_source_without_the_field_stops_early_in_one_line(tmp_path):
    pattern = write_set(tmp_path, n=40, per_shard=10, drop_text=set(range(40)))
    spec = StreamSpec(
        [Source.from_pattern(pattern, name="web")],
        batch_size=2,
        shuffle_buffer=0,
        mode="epoch",
        max_epochs=1,
        num_workers=1,
    )
    with pytest.raises(DataError) as error:
        list(StatefulLoader(BatchStream(spec, text_decoder()), SkipPolicy(max_rate=1.0)))
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message  # raised in a worker, arrives as one line
    assert re.search(
        r"source 'web': none of its first 16 samples has a field the method needs; the last one: sample "
        r"'00015' .* has no text field \(looked for txt, text, caption; it has cls, png\)",
        message,
    )


def tar_member(path, name):
    return next(m for m in tarfile.open(path).getmembers() if m.name == name)


def damaged_set(folder):
    """Three shards of 10: the first cut inside sample 4's caption, the second with sample 15's header
    first member's header overwritten, the third intact; `sizes.json` knows all three sizes."""
    pattern = write_set(folder, n=30, per_shard=10)
    first, second = folder / "part-000000.tar", folder / "part-000001.tar"
    cut = tar_member(first, "00004.txt").offset_data + 3
    first.write_bytes(first.read_bytes()[:cut])
    header = min(m.offset for m in tarfile.open(second).getmembers() if m.name.startswith("00015."))
    data = second.read_bytes()
    second.write_bytes(data[:header] + b"\xff" * 512 + data[header + 512 :])
    return pattern


def test_samples_lost_with_a_broken_shard_are_counted_exactly(tmp_path, caplog):
    spec = StreamSpec(
        [Source.from_pattern(damaged_set(tmp_path))],
        batch_size=2,
        shuffle_buffer=0,
        mode="epoch",
        max_epochs=1,
        drop_last=False,
    )
    loader = StatefulLoader(BatchStream(spec, text_decoder()), SkipPolicy(max_rate=0.5, min_samples=1))
    assert sum(len(b["image"]) for b in loader) == 4 + 5 + 10
    # shard 0 yields 0-3 whole and 4 without its caption (skipped), 5-9 are lost; shard 1 ends before 15
    assert subset(
        loader.counts(), seen=20, decoded=19, missing_field=1, lost=5 + 5, broken_shards=2, unsized_broken_shards=0
    )
    assert "unexpected end of data" in caplog.text and "no valid tar header at byte" in caplog.text


def test_broken_shard_of_unknown_size_and_a_missing_shard_are_counted(tmp_path):
    pattern = damaged_set(tmp_path)
    (tmp_path / "sizes.json").unlink()
    urls = expand_shards(pattern) + [str(tmp_path / "gone.tar")]
    spec = StreamSpec(
        [Source("web", urls)], batch_size=2, shuffle_buffer=0, mode="epoch", max_epochs=1, drop_last=False
    )
    loader = StatefulLoader(BatchStream(spec, text_decoder()), SkipPolicy(max_rate=0.5, min_samples=1))
    assert sum(len(b["image"]) for b in loader) == 19
    assert subset(loader.counts(), seen=20, lost=0, broken_shards=3, unsized_broken_shards=3)
    summary = counts.nest(counts.flatten(loader.counts_by_source(), ["web"]), ["web"])["all"]
    assert counts.describe(summary) == (
        "19 decoded, 1 skipped (missing_field 1), 0 lost with 3 broken shard(s) "
        "(+ the unknown rest of 3 shard(s) without a known size)"
    )


@pytest.mark.parametrize("mode", ["resampled", "epoch"])
def test_a_source_whose_every_shard_is_unreadable_is_a_data_error_not_an_endless_pass(tmp_path, mode):
    """A CSV named as a shard and a truncated tar yield nothing but errors: the stream stops within a few passes
    naming the source and a shard, where it would read them again forever (here: 99 passes, then the end); one
    readable shard keeps it going."""
    (tmp_path / "pairs.csv").write_text("image,caption\na.png,a cat\n")
    cut = Path(expand_shards(write_set(tmp_path / "set", n=5, per_shard=5))[0])
    cut.write_bytes(cut.read_bytes()[:300])
    broken = [str(tmp_path / "pairs.csv"), str(cut)]
    stream = ShardStream(broken, slot=0, num_slots=1, seed=0, mode=mode, shuffle_buffer=0, name="mine", max_epochs=99)
    with pytest.raises(DataError, match=r"source 'mine': none of its 2 shard\(s\) could be read \(.*Error"):
        next(iter(stream))
    good = expand_shards(write_set(tmp_path / "good", n=5, per_shard=5))
    stream = ShardStream(broken + good, slot=0, num_slots=1, seed=0, mode=mode, shuffle_buffer=0, name="mine")
    assert len(list(islice(stream, 12))) == 12


def test_reshard_starts_every_reader_after_the_furthest_epoch(tmp_path):
    pattern = write_set(tmp_path, n=40, per_shard=5)

    def epoch_of(sample):
        return {"epoch": torch.tensor(sample["__epoch__"]), "id": torch.tensor(int(decode_text(sample["cls"])))}

    def loader(rank, world, workers):
        spec = StreamSpec(
            [Source.from_pattern(pattern)],
            batch_size=4,
            mode="epoch",
            shuffle_buffer=3,
            rank=rank,
            world_size=world,
            num_workers=workers,
        )
        return StatefulLoader(BatchStream(spec, epoch_of))

    old = [loader(rank, 2, 1) for rank in range(2)]
    for rank, reader in enumerate(old):
        list(islice(reader, 7 if rank else 3))  # rank 1 is into its second epoch (5 batches per epoch)
    states = [json.loads(json.dumps(reader.state_dict())) for reader in old]
    new = loader(0, 1, 2)
    new.reshard(states)
    batches = list(islice(new, 10))
    assert all(int(e) == 2 for b in batches for e in b["epoch"])  # after epoch 1, the furthest reached
    assert sorted(int(i) for b in batches for i in b["id"]) == list(range(40))  # one whole epoch, once each
    assert new.counts()["seen"] == 3 * 4 + 7 * 4 + 40 and new.state_dict()["start_epoch"] == 2


def test_tokenizer_build_is_deterministic_across_processes(tmp_path):
    import os
    import subprocess
    import sys

    script = (
        "import sys; from mmpt.data.tokenizer import train_wordpiece; "
        "train_wordpiece(['a handwritten digit seven', '手写的数字七', 'the number 7'] * 3, sys.argv[1])"
    )
    for seed in ("1", "2"):
        subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / f"{seed}.json")],
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
    assert (tmp_path / "1.json").read_bytes() == (tmp_path / "2.json").read_bytes()
    from mmpt.data.tokenizer import TextTokenizer

    ids = TextTokenizer(tmp_path / "1.json", 8)(["digit seven 七"])["input_ids"][0].tolist()
    assert 1 not in ids[:5]  # no [UNK]: every word and character of the corpus is in the vocabulary


def write_img2dataset_shard(folder, shard: int, count: int, failed: int):
    """One shard as img2dataset writes it: `{shard:05d}.tar` of jpg/txt/json per sample (successes only),
    `_stats.json` and a parquet of every url beside it, no sizes.json."""
    import tarfile as tar_module

    path = folder / f"{shard:05d}.tar"
    with tar_module.open(path, "w") as archive:
        for i in range(count):
            key = f"{shard:05d}{i:04d}"
            image = io.BytesIO()
            Image.new("RGB", (8, 8), color=(i, 0, 0)).save(image, format="JPEG")
            meta = {
                "url": f"http://example.com/{key}.jpg",
                "key": key,
                "status": "success",
                "error_message": None,
                "width": 8,
                "height": 8,
                "original_width": 640,
                "original_height": 480,
                "caption": f"photo {i}",
                "sha256": "0" * 64,
            }
            for suffix, data in (
                ("jpg", image.getvalue()),
                ("txt", f"photo {i}".encode()),
                ("json", json.dumps(meta).encode()),
            ):
                info = tar_module.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    (folder / f"{shard:05d}_stats.json").write_text(
        json.dumps(
            {
                "count": count + failed,
                "successes": count,
                "failed_to_download": failed,
                "failed_to_resize": 0,
                "status_dict": {"success": count, "Connection timed out": failed},
            }
        )
    )
    (folder / f"{shard:05d}.parquet").write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")  # stands in; never read
    return path


def test_img2dataset_output_is_read_as_it_is(tmp_path):
    """jpg + txt + json per sample, no sizes.json: sizes come from `_stats.json`, so a cut shard's loss is exact."""
    for shard in range(3):
        write_img2dataset_shard(tmp_path, shard, count=12, failed=3)
    assert count_samples(expand_shards(str(tmp_path / "{00000..00002}.tar"))) == 36
    cut = tmp_path / "00001.tar"
    cut.write_bytes(cut.read_bytes()[: tar_member(cut, "000010005.txt").offset_data + 1])  # inside sample 5's caption
    spec = StreamSpec(
        [Source.from_pattern(str(tmp_path / "*.tar"), name="laion")],
        batch_size=4,
        mode="epoch",
        shuffle_buffer=0,
        max_epochs=1,
        drop_last=False,
    )
    loader = StatefulLoader(BatchStream(spec, text_decoder()), SkipPolicy(max_rate=0.5, min_samples=1))
    assert sum(len(b["image"]) for b in loader) == 12 + 5 + 12
    assert subset(
        loader.counts(), seen=30, decoded=29, missing_field=1, lost=6, broken_shards=1, unsized_broken_shards=0
    )
