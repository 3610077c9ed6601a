import csv
import io
import json
import random
import sys

import numpy as np
import pytest
import torch

from conftest import SMALL_MOVING_DIGITS
from mmpt.data import BatchStream, MissingFieldError, ShardSetWriter, Source, StatefulLoader, StreamSpec
from mmpt.data.loader import SkipPolicy
from mmpt.data.shards import count_samples, expand_shards
from mmpt.data.stream import read_shard
from mmpt.data.tokenizer import TextTokenizer
from mmpt.data.video import (
    VideoTextDecoder,
    decode_frames,
    frame_indices,
    npy_bytes,
    parse_sentences,
    write_video_shards,
)
from mmpt.demo.moving_digits import build_moving_digits, encode_mp4


def all_frames(count):
    return list(range(count))


@pytest.fixture(scope="module")
def corpus(moving_digits_root):
    return moving_digits_root


def backends():
    try:
        import decord  # noqa: F401
    except ImportError:
        return ["pyav"]
    return ["decord", "pyav"]


def to_tensor(image):
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


def samples_of(pattern):
    return [sample for url in expand_shards(pattern) for _, sample in read_shard(url)]


def decoder(corpus, **kwargs):
    return VideoTextDecoder(4, to_tensor, TextTokenizer(corpus / "tokenizer.json", 16), **kwargs)


# -- frame sampling -------------------------------------------------------------------------------


def test_eval_takes_the_middle_frame_of_each_segment():
    assert frame_indices(16, 4, train=False, rng=None) == [1, 5, 9, 13]
    assert frame_indices(10, 3, train=False, rng=None) == [1, 4, 7]  # segments [0,3) [3,6) [6,10)
    assert frame_indices(8, 8, train=False, rng=None) == list(range(8))
    assert frame_indices(5, 1, train=False, rng=None) == [2]


@pytest.mark.parametrize("count,segments", [(16, 4), (7, 3), (100, 8), (101, 8), (9, 9)])
def test_train_draws_one_random_frame_inside_each_segment(count, segments):
    rng = random.Random(0)
    seen = [set() for _ in range(segments)]
    for _ in range(300):
        indices = frame_indices(count, segments, train=True, rng=rng)
        assert len(indices) == segments and indices == sorted(indices)
        for i, index in enumerate(indices):
            assert i * count // segments <= index < (i + 1) * count // segments
            seen[i].add(index)
    if count <= 16:  # every frame of every segment gets drawn
        assert [sorted(s) for s in seen] == [
            list(range(i * count // segments, (i + 1) * count // segments)) for i in range(segments)
        ]


def test_short_videos_repeat_frames_and_empty_ones_fail():
    for train in (True, False):
        indices = frame_indices(3, 8, train=train, rng=random.Random(1))
        assert len(indices) == 8 and indices == sorted(indices) and set(indices) == {0, 1, 2}
    assert frame_indices(1, 4, train=True, rng=random.Random(0)) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="0 frames"):
        frame_indices(0, 4, train=False, rng=None)


def test_train_without_rng_draws_from_torch():
    torch.manual_seed(3)
    first = frame_indices(1000, 8, train=True, rng=None)
    torch.manual_seed(3)
    assert frame_indices(1000, 8, train=True, rng=None) == first
    torch.manual_seed(4)
    assert frame_indices(1000, 8, train=True, rng=None) != first


# -- decoding --------------------------------------------------------------------------------------


def test_decord_and_pyav_decode_the_same_frames(corpus):
    pytest.importorskip("decord")
    videos = [path.read_bytes() for path in sorted((corpus / "test" / "videos").glob("*.mp4"))[:4]]
    for data in videos + [samples_of(str(corpus / "train/en-*.tar"))[0]["mp4"]]:
        counts, frames = {}, {}
        for backend in ("decord", "pyav"):
            frames[backend] = decode_frames(data, lambda n, b=backend: counts.update({b: n}) or list(range(n)), backend)
        assert counts["decord"] == counts["pyav"] == 16
        assert frames["decord"].shape == frames["pyav"].shape == (16, 64, 64, 3)
        diff = np.abs(frames["decord"].astype(int) - frames["pyav"].astype(int))
        assert diff.max() <= 16 and diff.mean() < 0.5
        picked = {b: decode_frames(data, lambda n: frame_indices(n, 5, False, None), b) for b in ("decord", "pyav")}
        np.testing.assert_allclose(picked["decord"], picked["pyav"], atol=16)
        np.testing.assert_array_equal(picked["pyav"], frames["pyav"][frame_indices(16, 5, False, None)])


def test_a_video_decord_cannot_open_leaves_stderr_clean_and_says_why(corpus, capfd):
    """decord's C++ prints a failed open's input, for bytes the video's raw bytes, which made logs binary."""
    pytest.importorskip("decord")
    data = bytes(range(256)) * 12  # starts like nothing FFmpeg reads
    with pytest.raises(ValueError, match=r"undecodable video \(3072 bytes, decord\): RuntimeError"):
        decode_frames(data, all_frames, "decord")
    print("after", file=sys.stderr)  # the process's stderr is back
    assert capfd.readouterr().err == "after\n"


@pytest.mark.parametrize("backend", backends())
def test_decoded_frames_show_the_rendered_clip(backend):
    clip = np.zeros((8, 32, 32), dtype=np.uint8)
    for t in range(8):
        clip[t, 8:16, 2 + 2 * t : 10 + 2 * t] = 200  # a bright square moving right
    frames = decode_frames(encode_mp4(clip, fps=8), all_frames, backend)
    assert frames.shape == (8, 32, 32, 3) and frames.dtype == np.uint8
    assert np.abs(frames[..., 0].astype(int) - clip).mean() < 4
    columns = [int(np.argmax(frame[12, :, 0])) for frame in frames]
    assert columns == sorted(columns) and columns[-1] - columns[0] >= 10


@pytest.mark.parametrize("backend", backends())
def test_a_container_without_a_frame_count_is_counted_by_decoding(backend):
    av = pytest.importorskip("av")
    if "libvpx-vp9" not in av.codecs_available:
        pytest.skip("no VP9 encoder")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for t in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 20 * t, dtype=np.uint8), format="rgb24")
            frame.pts = t
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    counts = []
    frames = decode_frames(buffer.getvalue(), lambda n: counts.append(n) or frame_indices(n, 5, False, None), backend)
    assert counts == [10] and frames.shape == (5, 64, 64, 3)
    assert [round(float(f.mean()) / 20) for f in frames] == [0, 2, 4, 6, 8]  # segments of 2: the first is the middle


@pytest.mark.parametrize("backend", backends())
def test_bad_video_data_is_a_value_error(corpus, backend):
    data = (corpus / "test" / "videos" / "test-0000.mp4").read_bytes()
    with pytest.raises(ValueError, match="empty video"):
        decode_frames(b"", all_frames, backend)
    for bad in (data[: len(data) // 2], b"not a video at all" * 50):
        with pytest.raises(ValueError, match="undecodable"):
            decode_frames(bad, all_frames, backend)
    with pytest.raises(ValueError, match="min_frames=20"):
        decoder(corpus, backend=backend, min_frames=20)({"mp4": data, "txt": b"a clip"})
    with pytest.raises(ValueError, match="unknown video backend"):
        decode_frames(data, all_frames, "opencv")


# -- the sample decoder ------------------------------------------------------------------------------


def test_parse_sentences():
    assert parse_sentences(b" one caption \n", "txt") == ["one caption"]
    assert parse_sentences('["a", " ", "b"]', "json") == ["a", "b"]
    zh = json.dumps({"sentences": ["数字七向左移动。"], "kind": "move"}).encode()
    assert parse_sentences(zh, "zh.json") == ["数字七向左移动。"]
    for bad in ('{"sentences": []}', '{"other": 1}', "[1, 2]"):
        with pytest.raises(ValueError):
            parse_sentences(bad, "json")


@pytest.mark.parametrize("backend", backends())
def test_decoder_replays_its_random_choices(corpus, backend):
    sample = samples_of(str(corpus / "train/en-000000.tar"))[0]
    sentences = json.loads(sample["json"])["sentences"]
    train = decoder(corpus, backend=backend, train=True)
    torch.manual_seed(11)
    first = train(sample)
    torch.manual_seed(11)
    again = train(sample)
    assert first["frames"].shape == (4, 3, 64, 64) and first["frames"].dtype == torch.float32
    assert first["input_ids"].shape == first["attention_mask"].shape == (16,)
    for key in first:
        torch.testing.assert_close(first[key], again[key])
    draws = []
    for seed in range(30):
        torch.manual_seed(seed)
        draws.append(train(sample))
    assert len({tuple(d["input_ids"].tolist()) for d in draws}) == len(sentences)  # every sentence gets picked
    assert len({d["frames"].sum().item() for d in draws}) > 1  # and different frames

    evaluate = decoder(corpus, backend=backend, train=False)
    out = evaluate(sample)
    tokens = TextTokenizer(corpus / "tokenizer.json", 16)([sentences[0]])
    torch.testing.assert_close(out["input_ids"], tokens["input_ids"][0])
    expected = decode_frames(sample["mp4"], lambda n: frame_indices(n, 4, False, None), backend)
    torch.testing.assert_close(out["frames"], torch.from_numpy(expected).permute(0, 3, 1, 2).float() / 255.0)


def test_random_frame_transform_is_the_same_across_a_clip(corpus):
    sample = samples_of(str(corpus / "train/zh-000000.tar"))[0]

    def noisy(image):
        return torch.full((1, 2, 2), torch.rand(()).item())

    frames = VideoTextDecoder(6, noisy, TextTokenizer(corpus / "tokenizer.json", 8), backend="pyav")(sample)["frames"]
    assert frames.shape == (6, 1, 2, 2) and torch.unique(frames).numel() == 1
    frames = VideoTextDecoder(
        6, noisy, TextTokenizer(corpus / "tokenizer.json", 8), backend="pyav", same_transform_per_clip=False
    )(sample)["frames"]
    assert torch.unique(frames).numel() == 6


def test_precomputed_features_replace_the_video(corpus, tmp_path):
    features = np.arange(10, dtype=np.float32)[:, None] * np.ones((1, 6), dtype=np.float32)  # row i is all i
    sample = {"__key__": "f", "npy": npy_bytes(features), "json": json.dumps(["a seven moves up."]).encode()}
    evaluate = decoder(corpus, train=False)
    out = evaluate(sample)
    assert set(out) == {"frame_features", "input_ids", "attention_mask"}
    assert out["frame_features"][:, 0].tolist() == [0.0, 3.0, 5.0, 8.0]  # segments [0,2) [2,5) [5,7) [7,10)
    torch.manual_seed(0)
    rows = decoder(corpus, train=True)(sample)["frame_features"][:, 0].tolist()
    assert all(lo <= r < hi for r, (lo, hi) in zip(rows, [(0, 2), (2, 5), (5, 7), (7, 10)]))
    with pytest.raises(ValueError, match="min_frames=12"):
        decoder(corpus, min_frames=12)(sample)
    with pytest.raises(ValueError, match=r"\[frames, dim\]"):
        evaluate({**sample, "npy": npy_bytes(np.zeros((4, 2, 2)))})

    # Through the loader, from shards written by the helper.
    sizes = write_video_shards(
        ({"__key__": f"clip{i}", "npy": features + i, "json": ["a clip", "another caption"]} for i in range(6)),
        str(tmp_path / "feat"),
        shard_size=4,
    )
    assert sizes == {"feat-000000.tar": 4, "feat-000001.tar": 2}
    spec = StreamSpec(
        [Source.from_pattern(str(tmp_path / "feat-*.tar"))], batch_size=3, mode="epoch", shuffle_buffer=0, max_epochs=1
    )
    batches = list(StatefulLoader(BatchStream(spec, evaluate)))
    assert [b["frame_features"].shape for b in batches] == [(3, 4, 6)] * 2
    assert sorted(float(b) for batch in batches for b in batch["frame_features"][:, 0, 0]) == [0, 1, 2, 3, 4, 5]


def test_a_sample_without_video_or_text_is_a_clear_error(corpus):
    sample = {"__key__": "k1", "__shard__": "s.tar", "json": b'["text"]', "jpg": b""}
    with pytest.raises(MissingFieldError, match=r"sample 'k1' of s.tar has no video field \(looked for mp4, webm, avi"):
        decoder(corpus)(sample)
    with pytest.raises(MissingFieldError, match="has no text field"):
        decoder(corpus)({"__key__": "k2", "mp4": b"x"})


@pytest.mark.parametrize("backend,num_workers", [(b, 0) for b in backends()] + [(backends()[0], 2)])
def test_corrupt_empty_and_missing_videos_are_skipped_and_counted(corpus, tmp_path, caplog, backend, num_workers):
    good = samples_of(str(corpus / "train/en-000000.tar"))
    with ShardSetWriter(tmp_path / "clips", max_samples=5) as writer:
        for i, sample in enumerate(good):
            writer.write({"__key__": f"good{i}", "mp4": sample["mp4"], "json": sample["json"]})
            if i == 2:
                writer.write({"__key__": "truncated", "mp4": sample["mp4"][:600], "json": sample["json"]})
            if i == 5:
                writer.write({"__key__": "empty", "mp4": b"", "json": sample["json"]})
            if i == 6:
                writer.write({"__key__": "no_video", "json": sample["json"]})  # the download of its mp4 failed
    urls = expand_shards(str(tmp_path / "clips-*.tar"))
    assert count_samples(urls) == len(good) + 3
    spec = StreamSpec(
        [Source.from_pattern(str(tmp_path / "clips-*.tar"))],
        batch_size=3,
        mode="epoch",
        shuffle_buffer=0,
        max_epochs=1,
        drop_last=False,
        num_workers=num_workers,
    )
    loader = StatefulLoader(
        BatchStream(spec, decoder(corpus, backend=backend)), SkipPolicy(max_rate=0.5, min_samples=1)
    )
    batches = list(loader)
    assert sum(len(b["frames"]) for b in batches) == len(good)
    assert all(b["frames"].shape[1:] == (4, 3, 64, 64) for b in batches)
    assert {k: loader.counts()[k] for k in ("seen", "skipped", "undecodable", "missing_field")} == {
        "seen": len(good) + 3,
        "skipped": 3,
        "undecodable": 2,
        "missing_field": 1,
    }
    if num_workers:  # the workers log in their own processes
        return
    assert "sample 'truncated' of" in caplog.text and "clips-000000.tar" in caplog.text
    assert "sample 'empty' of" in caplog.text and "empty video" in caplog.text


# -- the demo corpus -------------------------------------------------------------------------------


def test_corpus_layout_and_held_out_split(corpus):
    assert (corpus / "COMPLETE").exists() and (corpus / "tokenizer.json").exists()
    sizes = json.loads((corpus / "train" / "sizes.json").read_text())
    assert sum(sizes.values()) == 2 * 24 and len(sizes) == 2 * 3
    en, zh = samples_of(str(corpus / "train/en-*.tar")), samples_of(str(corpus / "train/zh-*.tar"))
    assert [s["__key__"] for s in en] == [s["__key__"] for s in zh] and len({s["__key__"] for s in en}) == 24
    assert all(a["mp4"] == b["mp4"] for a, b in zip(en, zh))
    metas = [json.loads(s["json"]) for s in en]
    assert {m["kind"] for m in metas} == {"move", "order"}
    assert all(len(m["sentences"]) == 3 for m in metas)
    zh_sentences = [s for sample in zh for s in json.loads(sample["json"])["sentences"]]
    assert all(any("\u4e00" <= ch <= "\u9fff" for ch in s) for s in zh_sentences)
    for meta, zh_meta in zip(metas, (json.loads(s["json"]) for s in zh)):
        names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
        assert all(names[d] in s for d in meta["digits"] for s in meta["sentences"] if not any(c.isdigit() for c in s))
        assert zh_meta["digits"] == meta["digits"]
        if meta["kind"] == "order":
            assert meta["digits"][0] != meta["digits"][1]

    test = [s for url in expand_shards(str(corpus / "test/test-*.tar")) for _, s in read_shard(url)]
    test_meta = [json.loads(s["json"]) for s in test]
    train_scans = {scan for m in metas for scan in m["scans"]}
    assert not train_scans & {scan for m in test_meta for scan in m["scans"]}  # held-out scans only


def test_retrieval_files_match_the_test_shards(corpus):
    test = [s for url in expand_shards(str(corpus / "test/test-*.tar")) for _, s in read_shard(url)]
    assert len(test) == 12 and count_samples(expand_shards(str(corpus / "test/test-*.tar"))) == 12
    for language, field in (("en", "json"), ("zh", "zh.json")):
        jsonl = (corpus / "test" / f"retrieval_{language}.jsonl").read_text(encoding="utf-8")
        lines = [json.loads(line) for line in jsonl.splitlines()]
        with open(corpus / "test" / f"msrvtt_{language}.csv", encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert [line["video"] for line in lines] == [f"videos/{s['__key__']}.mp4" for s in test]
        assert [row["video_id"] for row in rows] == [s["__key__"] for s in test]
        for sample, line, row in zip(test, lines, rows):
            assert line["caption"] == json.loads(sample[field])["sentences"] and len(line["caption"]) == 2
            assert row["sentence"] == line["caption"][0]
            assert (corpus / "test" / line["video"]).read_bytes() == sample["mp4"]
        assert len({row["sentence"] for row in rows}) == len(rows)  # every query names one clip


def test_corpus_build_is_deterministic(corpus, tmp_path):
    again = build_moving_digits(tmp_path / "again", **SMALL_MOVING_DIGITS)
    for pattern in ("train/en-*.tar", "train/zh-*.tar", "test/test-*.tar"):
        first, second = samples_of(str(corpus / pattern)), samples_of(str(again / pattern))
        assert [s["__key__"] for s in first] == [s["__key__"] for s in second]
        assert [s["json"] for s in first] == [s["json"] for s in second]
        assert [s["mp4"] for s in first] == [s["mp4"] for s in second]  # the encoder runs repeatably
    for name in ("retrieval_en.jsonl", "retrieval_zh.jsonl", "msrvtt_en.csv", "msrvtt_zh.csv"):
        assert (corpus / "test" / name).read_bytes() == (again / "test" / name).read_bytes()
    assert (corpus / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert build_moving_digits(again, **SMALL_MOVING_DIGITS) == again  # complete: not rebuilt


def test_resize_center_crop_keeps_uint8_and_matches_pil():
    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as PF

    from mmpt.data.video import ResizeCenterCrop

    frames = np.random.default_rng(0).integers(0, 256, (3, 48, 64, 3), dtype=np.uint8)
    clip = ResizeCenterCrop(32)(frames)
    assert clip.dtype == torch.uint8 and clip.shape == (3, 3, 32, 32)
    for frame, ours in zip(frames, clip):
        pil = PF.center_crop(PF.resize(Image.fromarray(frame), 32, InterpolationMode.BILINEAR), 32)
        reference = torch.from_numpy(np.array(pil)).permute(2, 0, 1).int()
        assert (ours.int() - reference).abs().max() <= 2  # rounding of PIL's and torch's antialiased filters
    assert torch.equal(
        ResizeCenterCrop(32)(frames[:, :32, :32]), torch.from_numpy(frames[:, :32, :32]).permute(0, 3, 1, 2)
    )


def test_make_video_shards_packs_a_folder_and_its_captions_as_documented(tmp_path):
    """docs/victor.md's command on a folder of clips and MSR-VTT's caption json; the shards hold the documented
    caption format and train-decode; a missing folder is exit 2, too many missing clips exit 3."""
    import re
    import subprocess
    import sys

    from conftest import REPO
    from mmpt.data.stream import read_shard
    from mmpt.engine.stops import EXIT_CONFIG, EXIT_DATA

    (command,) = re.findall(r"```bash\n(.*?)\n```", (REPO / "docs/victor.md").read_text(), flags=re.S)
    words = command.split()
    (tmp_path / "clips").mkdir()
    for index in range(3):
        clip = np.zeros((8, 32, 32), dtype=np.uint8)
        clip[:, 4 * index : 4 * index + 8, 4:12] = 200
        (tmp_path / "clips" / f"video{index}.mp4").write_bytes(encode_mp4(clip, fps=8))
    sentences = [
        {"video_id": f"video{i}", "caption": f"clip {i} take {k}", "sen_id": 2 * i + k}
        for i in range(3)
        for k in range(2)
    ]
    (tmp_path / "captions.json").write_text(json.dumps({"videos": [], "sentences": sentences}))

    def pack(*args):
        return subprocess.run(
            [sys.executable, str(REPO / words[1]), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )

    done = pack(*words[2:])
    assert done.returncode == 0, done.stderr
    samples = [s for url in sorted((tmp_path / "shards/clips").glob("train-*.tar")) for _, s in read_shard(str(url))]
    assert [s["__key__"] for s in samples] == ["video0", "video1", "video2"]
    assert json.loads(samples[1]["json"]) == {"sentences": ["clip 1 take 0", "clip 1 take 1"]}
    assert samples[2]["mp4"] == (tmp_path / "clips/video2.mp4").read_bytes()
    decoder = VideoTextDecoder(
        4,
        None,
        lambda texts: {
            "input_ids": torch.zeros(len(texts), 4, dtype=torch.long),
            "attention_mask": torch.ones(len(texts), 4, dtype=torch.long),
        },
        backend="pyav",
    )
    assert decoder(samples[0])["frames"].shape == (4, 3, 32, 32)

    (tmp_path / "captions.csv").write_text("video_id,sentence\nvideo0,a\nvideo7,b\n")
    too_many_missing = pack("--videos", "clips", "--captions", "captions.csv", "--out", "shards/csv/train")
    assert too_many_missing.returncode == EXIT_DATA and "Traceback" not in too_many_missing.stderr
    assert (
        "mmpt: 1 of 2 captioned videos are not in clips (e.g. 'video7'), more than --max-skip-rate"
        in too_many_missing.stderr
    )
    no_folder = pack("--videos", "nowhere", "--captions", "captions.json", "--out", "shards/x/train")
    assert no_folder.returncode == EXIT_CONFIG and "mmpt: --videos nowhere: no such folder" in no_folder.stderr


def _photo_clip(width, height, frames=12):
    """A clip panning across a photograph (texture a decoder pays for), `width` x `height`."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photo = Image.fromarray(load_sample_images().images[1]).resize((width + 4 * frames, height + 2 * frames))
    pixels = np.asarray(photo)
    return np.stack([pixels[2 * i : 2 * i + height, 4 * i : 4 * i + width] for i in range(frames)])


@pytest.mark.parametrize("backend", backends())
def test_frames_decoded_at_the_models_size_are_the_crop_a_full_decode_gives(backend):
    """Scaled while decoding (`short_side`): the shorter side as asked and the longer one as torchvision's
    resize makes it, so `ResizeCenterCrop` cuts the same crop, resampled by FFmpeg instead of torch."""
    from mmpt.data.video import ResizeCenterCrop

    pick = lambda n: frame_indices(n, 4, False, None)
    for width, height in ((320, 192), (192, 320)):
        data = encode_mp4(_photo_clip(width, height))
        scaled = decode_frames(data, pick, backend, short_side=64)
        assert scaled.shape == ((4, 64, 106, 3) if width > height else (4, 106, 64, 3))
        full = ResizeCenterCrop(64)(decode_frames(data, pick, backend)).float()
        difference = (ResizeCenterCrop(64)(scaled).float() - full).abs()
        assert difference.mean() < 4 and torch.quantile(difference.flatten(), 0.99) < 24, (backend, difference.mean())
    small = encode_mp4(_photo_clip(96, 48))  # no larger than asked: decoded as it is
    assert decode_frames(small, pick, backend, short_side=64).shape == (4, 48, 96, 3)


@pytest.mark.parametrize("backend", backends())
def test_the_video_decoder_decodes_at_the_size_its_transform_resizes_to_where_that_pays(backend, corpus):
    """decord scales while decoding (faster on large frames); PyAV's scaling is slower than a full decode and a
    resize, so PyAV decodes at full size (benchmarks/results/video_at_size.md)."""
    from mmpt.data.video import ResizeCenterCrop

    data = encode_mp4(_photo_clip(320, 192))
    pick = lambda n: frame_indices(n, 4, False, None)
    video = decoder(corpus, backend=backend, train=False, clip_transform=ResizeCenterCrop(64)).decode_video(data)
    short_side = 64 if backend == "decord" else None
    assert torch.equal(video, ResizeCenterCrop(64)(decode_frames(data, pick, backend, short_side=short_side)))
