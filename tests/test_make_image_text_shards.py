"""`mmpt-make-image-text-shards`: a folder with sidecar captions, a gb18030 csv with two caption columns, and
Chinese-CLIP's tsv + jsonl become img2dataset-layout shards that mmpt's loader reads as they are (a caption column
chosen by `json.<column>`), resized where asked; bad pairs are skipped by reason with exit 3 past the limit; an
interrupted run, started again, ends with the same bytes; a missing column, a line of a JSON table that is not
an object or a wrong --images-root is one line and exit 2."""

import base64
import io
import json
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from conftest import REPO
from mmpt.cli import exit_code
from mmpt.commands.make_image_text_shards import main as make_shards
from pool import scenario


def jpeg(size, colour=(200, 30, 30), fmt="JPEG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


def members(tar_path):
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.fixture
def inputs(tmp_path):
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    (photos / "a.jpg").write_bytes(jpeg((640, 480)))
    (photos / "a.txt").write_text("a red square")
    (photos / "sub/b.png").write_bytes(jpeg((100, 300), fmt="PNG"))
    (photos / "sub/b.txt").write_text("绿色的图片", encoding="utf-8")
    (photos / "broken.jpg").write_bytes(b"not an image")
    (photos / "broken.txt").write_text("broken")
    (photos / "uncaptioned.jpg").write_bytes(jpeg((50, 50)))
    table = "path,caption,caption_zh\nphotos/a.jpg,a red square,红色方块\nphotos/sub/b.png,a tall one,高图\n"
    table += "photos/a.jpg,,只有中文\n"  # no English caption: no "caption" in its json
    (tmp_path / "pairs.csv").write_bytes(table.encode("gb18030"))
    image = jpeg((80, 60))
    tsv = f"1001\t{base64.urlsafe_b64encode(image).decode()}\n1002\t{base64.b64encode(image).decode()}\n"
    (tmp_path / "train_imgs.tsv").write_text(tsv + "1003\t#not base64#\n")  # both alphabets, then a damaged line
    texts = [
        {"text_id": 1, "text": "蓝色", "image_ids": [1001, 1002, 1003]},
        {"text_id": 2, "text": "缺", "image_ids": [9]},
    ]
    (tmp_path / "train_texts.jsonl").write_text("\n".join(json.dumps(t, ensure_ascii=False) for t in texts) + "\n")
    return tmp_path


def test_a_table_becomes_shards_mmpt_trains_on_in_either_caption_column(inputs, digits_root):
    from mmpt.config_loader import load_config
    from mmpt.methods import get_method

    out = inputs / "shards"
    args = ["--table", str(inputs / "pairs.csv"), "--image-column", "path", "--caption-columns", "caption,caption_zh"]
    assert make_shards([*args, "--encoding", "gb18030", "--out", str(out), "--resize", "64", "--processes", "1"]) == 0
    files = members(out / "00000.tar")
    assert sorted(files) == [f"00000000{i}.{kind}" for i in range(3) for kind in ("jpg", "json", "txt")]
    record = json.loads(files["000000001.json"])
    assert record["caption_zh"] == "高图" and files["000000001.txt"].decode() == "a tall one"
    chinese_only = json.loads(files["000000002.json"])  # a source reading json.caption finds no English here
    assert "caption" not in chinese_only and chinese_only["caption_zh"] == files["000000002.txt"].decode() == "只有中文"
    assert (record["original_width"], record["original_height"], record["width"], record["height"]) == (
        100,
        300,
        64,
        192,
    )
    assert Image.open(io.BytesIO(files["000000001.jpg"])).size == (64, 192)
    assert json.loads((out / "00000_stats.json").read_text())["successes"] == 3

    config = REPO / "configs/clip/demo.yaml"
    source = f'data.train.sources=[{{shards: "{out}/*.tar", caption_key: json.caption_zh}}]'
    small = ["data.prepare=null", "data.train.batch_size=2", "data.train.num_workers=0", "method.image.image_size=32"]
    cfg = load_config(config, [source, f"method.tokenizer={digits_root / 'tokenizer.json'}", *small])
    get_method("clip").prepare(cfg, inputs)
    batch = next(iter(get_method("clip").train_data(cfg, inputs, rank=0, world_size=1))).batch
    assert batch["image"].shape == (2, 3, 32, 32) and batch["input_ids"].shape[0] == 2


def test_bad_pairs_are_counted_by_reason_and_a_rerun_keeps_finished_shards(inputs, capsys):
    out = inputs / "shards"
    args = ["--images", str(inputs / "photos"), "--out", str(out), "--shard-size", "2", "--processes", "1"]
    with pytest.raises(Exception) as error:  # 2 of 4 skipped, past the default 1%
        make_shards(args)
    assert exit_code(error.value) == 3 and "1 no caption, 1 unreadable image" in str(error.value)
    named = [
        pair for shard in sorted(out.glob("*_stats.json")) for pair in json.loads(shard.read_text())["skipped_pairs"]
    ]
    assert [(Path(p["source"]).name, p["reason"]) for p in named] == [
        ("broken.jpg", "unreadable_image"),
        ("uncaptioned.jpg", "no_caption"),
    ]
    assert f"the first: {named[0]['source']} (unreadable image)" in str(error.value)
    first = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    (out / "00001.tar").unlink()
    (out / "00001_stats.json").unlink()
    assert make_shards([*args, "--max-skip-rate", "0.5"]) == 0
    assert "(1 kept from an earlier run)" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == first  # the same shards as one run


def test_a_parquet_table_reads_as_the_csv_does(inputs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {"path": ["photos/a.jpg"], "caption": ["a red square"], "caption_zh": ["红色方块"]}
    pq.write_table(pa.table(rows), inputs / "pairs.parquet")
    args = ["--table", str(inputs / "pairs.parquet"), "--image-column", "path", "--caption-columns", "caption_zh"]
    assert make_shards([*args, "--out", str(inputs / "shards"), "--processes", "1"]) == 0
    assert members(inputs / "shards/00000.tar")["000000000.txt"].decode() == "红色方块"


def test_chinese_clip_layout_gives_a_pair_per_text_and_image(inputs):
    out = inputs / "shards"
    pair = [str(inputs / "train_imgs.tsv"), str(inputs / "train_texts.jsonl")]
    assert make_shards(["--cn-clip", *pair, "--out", str(out), "--processes", "1", "--max-skip-rate", "0.6"]) == 0
    files = members(out / "00000.tar")
    assert [json.loads(files[f"00000000{i}.json"])["source"] for i in (0, 1)] == [
        "image 1001 (text 1)",
        "image 1002 (text 1)",
    ]
    assert files["000000000.txt"].decode() == "蓝色" and files["000000000.jpg"] == jpeg((80, 60))  # kept as it was
    skipped = json.loads((out / "00000_stats.json").read_text())["skipped"]
    assert skipped == {"missing_image": 1, "unreadable_image": 1}


def test_a_missing_column_is_one_line_and_exit_2(inputs):
    args = ["--table", str(inputs / "pairs.csv"), "--image-column", "file", "--caption-columns", "caption"]
    with pytest.raises(Exception) as error:
        make_shards([*args, "--encoding", "gb18030", "--out", str(inputs / "out")])
    assert exit_code(error.value) == 2 and "row 1 has no column 'file'" in str(error.value)
    assert "\n" not in str(error.value)


def test_a_wrong_images_root_is_one_line_and_exit_2_before_any_shard(inputs):
    args = ["--table", str(inputs / "pairs.csv"), "--image-column", "path", "--caption-columns", "caption,caption_zh"]
    args += ["--encoding", "gb18030", "--out", str(inputs / "out")]
    for root, said in ((inputs / "nowhere", "no such folder"), (inputs / "photos", "none of the first 3 images")):
        with pytest.raises(Exception) as error:
            make_shards([*args, "--images-root", str(root)])
        assert exit_code(error.value) == 2 and said in str(error.value) and "\n" not in str(error.value)
    assert f"is not at {inputs}/photos/photos/a.jpg" in str(error.value)
    assert not (inputs / "out").exists()  # nothing written that a fixed rerun would keep
    assert make_shards([*args, "--images-root", str(inputs)]) == 0


def test_a_jsonl_row_without_its_caption_is_skipped_and_a_line_that_is_not_an_object_is_exit_2(inputs, capsys):
    rows = [{"path": "photos/a.jpg", "caption": "a red square"}, {"path": "photos/sub/b.png"}]
    (inputs / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--image-column", "path", "--caption-columns", "caption", "--max-skip-rate", "0.5"]
    assert make_shards(["--table", str(inputs / "rows.jsonl"), *args, "--out", str(inputs / "out")]) == 0
    assert "wrote 1 of 2 pairs" in capsys.readouterr().out
    (inputs / "csv.jsonl").write_text("path,caption\nphotos/a.jpg,a red square\n")
    (inputs / "array.json").write_text(json.dumps(rows))
    for table, says in (("csv.jsonl", "line 1 is not JSON (Expecting value)"), ("array.json", "is a JSON list")):
        with pytest.raises(Exception) as error:
            make_shards(["--table", str(inputs / table), *args, "--out", str(inputs / table.replace(".", "_"))])
        assert exit_code(error.value) == 2 and says in str(error.value), str(error.value)
    with pytest.raises(Exception) as error:
        make_shards(
            ["--cn-clip", str(inputs / "train_imgs.tsv"), str(inputs / "csv.jsonl"), "--out", str(inputs / "c")]
        )
    assert exit_code(error.value) == 2 and "csv.jsonl: line 1 is not JSON" in str(error.value), str(error.value)


@scenario("clip-from-a-converted-gbk-table")
def clip_from_a_converted_gbk_table(corpora, run_dir):
    """300 digit scans named in a gb18030 csv with English and Chinese captions, converted into 2 shards (resized,
    2 processes), then the clip demo trained on them on 2 ranks reading the Chinese column."""
    from test_config_matrix import shrink

    from mmpt.eval.zeroshot import load_classification_set

    folder = run_dir.parent / "gbk-table"
    (folder / "scans").mkdir(parents=True, exist_ok=True)
    data = load_classification_set(corpora["digits"] / "zeroshot", "zh")
    english = load_classification_set(corpora["digits"] / "zeroshot", "en").classnames
    rows = ["路径,caption,caption_zh"]
    for i, (image, label, _) in enumerate(list(data.samples())[:300]):
        (folder / "scans" / f"{i:03d}.png").write_bytes(image)
        rows.append(f"scans/{i:03d}.png,the digit {english[label]},手写的{data.classnames[label]}")
    (folder / "pairs.csv").write_bytes(("\n".join(rows) + "\n").encode("gb18030"))
    args = ["--table", str(folder / "pairs.csv"), "--image-column", "路径", "--caption-columns", "caption,caption_zh"]
    shards = folder / "shards"
    assert (
        make_shards([*args, "--encoding", "gb18030", "--out", str(shards), "--shard-size", "150", "--resize", "48"])
        == 0
    )
    config = REPO / "configs/clip/demo.yaml"
    source = f'data.train.sources=[{{shards: "{shards}/{{00000..00001}}.tar", caption_key: json.caption_zh}}]'
    rest = ["train.max_steps=4", "data.eval=[]", "train.eval_every=0"]
    return config, [*shrink(config, corpora), source, *rest], "train"


@pytest.mark.pool("clip-from-a-converted-gbk-table")
def test_two_ranks_train_on_shards_converted_from_a_gbk_table(rank_pool):
    from conftest import read_metrics

    run_dir = rank_pool.run_dir("clip-from-a-converted-gbk-table")
    stats = [json.loads(p.read_text()) for p in sorted((run_dir.parent / "gbk-table/shards").glob("*_stats.json"))]
    assert [s["successes"] for s in stats] == [150, 150]
    losses = [r["loss/contrastive"] for r in read_metrics(run_dir) if "loss/contrastive" in r]
    assert len(losses) == 4 and all(0 < v < 20 for v in losses)


def test_a_truncated_jpeg_is_found_though_kept_jpegs_decode_at_an_eighth():
    """JPEGs kept as they are decode at the smallest DCT scale only to check them: a cut-off file still fails."""
    from mmpt.commands.make_image_text_shards import jpeg_of

    whole = jpeg((640, 480))
    assert jpeg_of(whole, None) == (whole, {"original_width": 640, "original_height": 480, "width": 640, "height": 480})
    assert jpeg_of(whole, 240)[1] == {"original_width": 640, "original_height": 480, "width": 320, "height": 240}
    with pytest.raises(OSError, match="truncated"):
        jpeg_of(whole[: len(whole) // 2], None)
