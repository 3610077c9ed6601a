"""Where a source's caption, image and video come from (`data/fields.py`), text encodings, and the skip
policy enforced where samples are read, so that no source can hang a run."""

import json
import re
import time
from itertools import islice

import pytest
import torch
from img2dataset_shards import captions, write_set

from mmpt.config import ConfigError
from mmpt.data import BatchStream, DataError, MissingFieldError, Source, StatefulLoader, StreamSpec
from mmpt.data.fields import SampleFields, TextEncodingError
from mmpt.data.image_text import decode_image, decode_text
from mmpt.data.loader import SkipPolicy

CAPTIONS = [captions(i)[0] for i in range(10)] + [captions(i)[1] for i in range(10)]


def caption_index(sample: dict) -> dict:
    """Decoder under test: the image must decode; the caption is returned as its index in `CAPTIONS`
    (English 0-9, Chinese 10-19)."""
    decode_image(sample["jpg"])
    return {
        "caption": torch.tensor(CAPTIONS.index(decode_text(sample["txt"]))),
        "key": torch.tensor(int(sample["__key__"])),
    }


def loader_of(sources: list[Source], workers: int = 0, batch_size: int = 6, policy=None, **spec) -> StatefulLoader:
    spec = StreamSpec(sources, batch_size=batch_size, num_workers=workers, shuffle_buffer=0, **spec)
    return StatefulLoader(BatchStream(spec, caption_index), policy or SkipPolicy(max_rate=0.01, min_samples=20))


def test_field_keys_read_members_and_json_fields():
    sample = {
        "__key__": "k",
        "jpg": b"J",
        "png": b"P",
        "txt": b"english",
        "json": json.dumps({"caption_zh": "中文", "meta": {"title": ["t1", " ", "t2"]}}).encode(),
    }
    assert SampleFields.of(caption="json.caption_zh").apply(sample)["txt"] == "中文"
    out = SampleFields.of(caption="txt", image="png").apply(sample)
    assert out["txt"] == "english" and out["jpg"] == b"P" and "png" not in out and "json" not in out
    drawn = set()
    for seed in range(40):  # a nested list: its non-empty strings are the candidates
        torch.manual_seed(seed)
        drawn.add(SampleFields.of(caption="json.meta.title").apply(sample)["txt"])
    assert drawn == {"t1", "t2"}
    assert SampleFields().apply(sample) is sample  # no keys named: untouched
    with pytest.raises(MissingFieldError, match=r"sample 'k' .* no non-empty caption under json.caption_en, text") as e:
        SampleFields.of(caption=["json.caption_en", "text"]).apply(sample)
    assert str(e.value).endswith("(it has jpg, json (json.caption_zh, json.meta), png, txt)")  # what a key can name
    with pytest.raises(MissingFieldError, match="no non-empty image under webp"):
        SampleFields.of(image="webp").apply(sample)
    with pytest.raises(ValueError, match="holds int, not a caption"):
        SampleFields.of(caption="json.n").apply({**sample, "json": b'{"n": 3}'})


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(caption="json."), "is not a field key"),
        (dict(image="json.url"), "are tar members"),
        (dict(caption=[]), "empty list"),
        (dict(text_encoding="klingon"), "not a text encoding"),
    ],
)
def test_bad_field_keys_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SampleFields.of(**bad)


def test_text_not_in_the_sources_encoding_is_its_own_skip_reason():
    gbk = {"__key__": "k", "__shard__": "s.tar", "txt": "数字的照片".encode("gbk")}
    with pytest.raises(
        TextEncodingError,
        match=r"not valid utf-8 .*captions must be UTF-8 \(or set the source's "
        r"text_encoding",
    ):
        decode_text(gbk["txt"])
    assert SampleFields.of(text_encoding="gbk").apply(gbk)["txt"] == "数字的照片"
    with pytest.raises(TextEncodingError, match=r"field 'txt' of sample 'k' of s.tar is not valid gbk"):
        SampleFields.of(text_encoding="gbk").apply({**gbk, "txt": b"\xff\xff\xff"})


def test_two_sources_read_different_json_fields(tmp_path):
    pattern = write_set(tmp_path / "web", shards=4, per_shard=10)
    spec = StreamSpec(
        [
            Source.from_pattern(pattern, name="en", fields=SampleFields.of(caption="json.caption")),
            Source.from_pattern(pattern, name="zh", fields=SampleFields.of(caption="json.caption_zh")),
        ],
        batch_size=6,
        per_source=True,
        shuffle_buffer=0,
        mode="epoch",
        max_epochs=1,
    )
    batches = list(StatefulLoader(BatchStream(spec, caption_index)))
    for batch in batches:
        assert (batch["en"]["caption"] == batch["en"]["key"] % 10).all()  # English captions, matching the image
        assert (batch["zh"]["caption"] == 10 + batch["zh"]["key"] % 10).all()
    assert len(batches) == 40 // 3


@pytest.mark.parametrize("workers", [0, 2])
def test_a_caption_drawn_per_read_is_seeded_and_resumes_exactly(tmp_path, workers):
    pattern = write_set(tmp_path / "web", shards=4, per_shard=12)
    both = SampleFields.of(caption=["json.caption", "json.caption_zh"])

    def make():
        return loader_of([Source.from_pattern(pattern, name="bi", fields=both)], workers=workers, mode="resampled")

    straight = [(b["key"].tolist(), b["caption"].tolist()) for b in islice(make(), 10)]
    drawn = [c for _, cs in straight for c in cs]
    assert {c < 10 for c in drawn} == {True, False}  # both languages are drawn
    assert all(c % 10 == k % 10 for keys, cs in straight for k, c in zip(keys, cs))  # each caption matches its image
    first = make()
    head = [(b["key"].tolist(), b["caption"].tolist()) for b in islice(first, 4)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    tail = [(b["key"].tolist(), b["caption"].tolist()) for b in islice(resumed, 6)]
    assert head + tail == straight


@pytest.mark.parametrize("workers", [0, 2])
def test_a_gbk_source_is_counted_and_stops_in_one_line_or_reads_with_its_encoding(tmp_path, workers):
    pattern = write_set(tmp_path / "legacy", shards=4, per_shard=30, text_encoding="gbk")
    started = time.monotonic()
    with pytest.raises(DataError) as error:
        next(iter(loader_of([Source.from_pattern(pattern, name="legacy")], workers=workers)))
    message = str(error.value)
    assert time.monotonic() - started < 30 and "\n" not in message
    assert message.startswith(
        "source 'legacy': none of 20 samples read could be used (text_encoding 20; "
        "commonest: text_encoding); last failure: sample '0"
    ), message
    assert "captions must be UTF-8 (or set the source's text_encoding" in message
    fixed = loader_of(
        [Source.from_pattern(pattern, name="legacy", fields=SampleFields.of(text_encoding="gbk"))], workers=workers
    )
    batch = next(iter(fixed))
    assert (batch["caption"] == 10 + batch["key"] % 10).all()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sources", [1, 2])
def test_a_source_of_undecodable_images_stops_where_samples_are_read(tmp_path, workers, sources):
    """Every image of the `broken` source is garbage: no batch is ever completed from it, so the limit must
    be enforced per sample read, in the workers, not per batch delivered; a healthy second source does not
    hide it, and a limit of 1.0 does not either."""
    broken = Source.from_pattern(
        write_set(tmp_path / "broken", shards=4, per_shard=25, image=b"\xff\xd8 not a jpeg"), name="broken"
    )
    healthy = Source.from_pattern(write_set(tmp_path / "ok", shards=4, per_shard=25), name="ok")
    mix = [broken, healthy][:sources]
    started = time.monotonic()
    with pytest.raises(
        DataError,
        match=r"^source 'broken': none of (\d+) samples read could be used \(undecodable \1; "
        r"commonest: undecodable\); last failure: sample '\d+' of .*\.tar: ",
    ):
        for _ in islice(loader_of(mix, workers=workers, policy=SkipPolicy(max_rate=1.0, min_samples=20)), 50):
            pass
    assert time.monotonic() - started < 30


def test_the_skip_rate_is_checked_per_source():
    policy = SkipPolicy(max_rate=0.1, min_samples=10)
    row = dict(seen=20, decoded=17, missing_field=1, text_encoding=0, undecodable=2)
    assert policy.violation(row) == (
        "3 of 20 samples could not be used (missing_field 1, undecodable 2; commonest: "
        "undecodable), more than max_skip_rate=0.1"
    )
    assert policy.violation({**row, "seen": 9, "decoded": 6}) is None  # too few read to judge
    assert policy.violation({**row, "decoded": 18, "undecodable": 1}) is None  # 2 of 20 is not more than 10%


def test_field_keys_a_method_does_not_read_are_config_errors(tmp_path):
    from mmpt.config_loader import load_config

    config = tmp_path / "c.yaml"
    config.write_text("extends: " + json.dumps(str(__import__("conftest").REPO / "configs/space2/demo.yaml")) + "\n")
    for override, message in [
        (
            "data.train.sources.0.caption_key=json.caption",
            "config key 'data.train.sources.0.caption_key': method 'space2' reads no field keys",
        ),
        (
            "data.train.sources.0.text_encoding=klingon",
            "'data.train.sources.0.text_encoding' = 'klingon': 'klingon' is not a text encoding",
        ),
        (
            "data.eval=[{dataset: dialogs, task: intent, caption_key: txt}]",
            "config key 'data.eval.0.caption_key': method 'space2' reads no field keys of evaluation sets",
        ),
        (
            "data.eval=[{dataset: dialogs, task: zeroshot_retrieval}]",
            "config key 'data.eval.0.task' = 'zeroshot_retrieval': method 'space2' offers intent",
        ),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(config, [override])


@pytest.mark.distributed
@pytest.mark.parametrize("broken, workers, sources", [("gbk", 2, 1), ("garbage", 0, 2)])
def test_an_unusable_source_stops_a_two_rank_run_with_exit_3_in_seconds(
    tmp_path, digits_root, broken, workers, sources
):
    import subprocess

    from conftest import REPO, deepspeed_command, launcher_env, tiny_config, write_config
    from mmpt.engine.stops import EXIT_DATA

    options = {"text_encoding": "gbk"} if broken == "gbk" else {"image": b"<html>403 Forbidden</html>"}
    bad = {"shards": write_set(tmp_path / broken, shards=4, per_shard=50, **options), "name": broken}
    good = {"shards": str(digits_root / "train/en-*.tar"), "name": "digits"}
    cfg = tiny_config(digits_root, tmp_path / "run")
    cfg["data"]["train"].update(sources=[bad, good][:sources], num_workers=workers)
    started = time.monotonic()
    result = subprocess.run(
        deepspeed_command(write_config(tmp_path / "cfg.yaml", cfg)),
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_DATA and "Traceback" not in output, output[-3000:]
    assert time.monotonic() - started < 60
    lines = [line for line in output.splitlines() if line.startswith("mmpt: ")]
    assert 1 <= len(lines) <= 2, lines  # each rank that found it (the launcher may end the other first)
    # Found by a reader (that source alone) or by the rank (all its readers' sources together): either way the
    # line names the source and the commonest reason.
    reason = "text_encoding" if broken == "gbk" else "undecodable"
    by_reader = rf"source '{broken}': none of 200 samples read could be used \({reason} 200; commonest: {reason}\)"
    by_rank = (
        rf"all sources: \d+ of \d+ samples could not be used \({reason} \d+; commonest: {reason}\), more than "
        rf"max_skip_rate=0.01, most from source '{broken}'"
    )
    assert all(
        re.fullmatch(rf"mmpt: (rank 1: )?data error: ({by_reader}|{by_rank}); last failure: .+", line) for line in lines
    ), lines


def test_held_out_shards_are_a_retrieval_set_with_the_captions_their_keys_hold(tmp_path):
    from mmpt.eval.retrieval_formats import read_retrieval_set

    pattern = write_set(tmp_path / "heldout", shards=2, per_shard=5)
    chinese = read_retrieval_set(pattern, SampleFields.of(caption="json.caption_zh"))
    assert chinese.texts == [captions(i)[1] for i in range(10)] and len(chinese.images) == 10
    assert chinese.matches.equal(torch.eye(10, dtype=torch.bool))
    both = read_retrieval_set(pattern, SampleFields.of(caption=["json.caption", "json.caption_zh"]))
    assert both.texts[:2] == list(captions(0)) and both.matches.sum(dim=1).tolist() == [2] * 10
    plain = read_retrieval_set(str(tmp_path / "heldout/00000.tar"))  # no keys: the txt member
    assert plain.texts == [captions(i)[0] for i in range(5)]


def test_the_zeroshot_command_reads_a_shard_pattern_with_its_caption_key(corpora, tmp_path):
    """`mmpt-zeroshot --dataset PATTERN --caption-key KEY` scores what the method does with data.eval's keys, and
    records the key it read."""
    from test_locking import tiny

    from mmpt.commands.zeroshot import main as zeroshot
    from mmpt.release import PretrainedModel

    (tmp_path / "run").mkdir()
    cfg, method, model = tiny("clip", corpora, tmp_path / "run")
    PretrainedModel(model.eval(), cfg, tmp_path / "run").save_pretrained(tmp_path / "release")
    write_set(tmp_path / "heldout", shards=2, per_shard=5)
    pattern = str(tmp_path / "heldout/{00000..00001}.tar")
    run = ["--model", str(tmp_path / "release"), "--dataset", pattern, "--task", "zeroshot_retrieval"]
    run += ["--device", "cpu", "--language", "zh", "--output", str(tmp_path / "out.json")]
    for key in (None, "json.caption_zh"):
        assert zeroshot([*run, *(["--caption-key", key] if key else [])]) == 0
        fields = None if key is None else SampleFields.of(caption=key)
        expected = method.zeroshot(model, cfg, tmp_path / "release", pattern, "zh", "zeroshot_retrieval", fields=fields)
        written = json.loads((tmp_path / "out.json").read_text())
        assert written["metrics"] == expected["metrics"]
        assert written["caption_key"] == (key or "txt")  # what was scored, whatever language it is filed under
    with pytest.raises(MissingFieldError, match="no non-empty caption under json.caption_fr"):
        zeroshot([*run, "--caption-key", "json.caption_fr"])


def test_a_tokenizer_that_knows_none_of_the_captions_words_stops_the_run(tmp_path, digits_root):
    """Captions that all become the same few ids would train at chance with exit 0: refused, naming the run's
    tokenizer and the shard, by the tokenizer's method on its first captions. The corpus' own tokenizer passes."""
    from conftest import tiny_config, write_config
    from mmpt.config_loader import load_config
    from mmpt.data.tokenizer import TextTokenizer, train_wordpiece
    from mmpt.methods import get_method
    from mmpt.methods.image_text import check_captions_tokenize_apart

    sources = [Source.from_pattern(str(digits_root / "train/en-*.tar"))]
    check_captions_tokenize_apart(TextTokenizer(digits_root / "tokenizer.json", 16), sources, "tokenizer.json")
    wordless = tmp_path / "wordless.json"
    train_wordpiece([], wordless)  # its special tokens and nothing else: every word is unknown
    config = tiny_config(digits_root, tmp_path / "run", method={"tokenizer": str(wordless)})
    cfg = load_config(write_config(tmp_path / "run.yaml", config))
    method = get_method("clip")
    (tmp_path / "run").mkdir()
    method.prepare(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"wordless.json: the first \d+ captions of .*en-.*\.tar tokenise to 4 "):
        method.train_data(cfg, tmp_path / "run", rank=0, world_size=1)
