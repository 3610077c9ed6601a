import json
import re

import numpy as np
import pytest
import torch

from mmpt.config import ConfigError
from mmpt.data.shards import DataError, MissingDataError
from mmpt.eval.retrieval import official_caption_normalization, recall_metrics, retrieval_ranks
from mmpt.eval.retrieval_formats import load_retrieval_set
from mmpt.eval.templates import DEFAULT_TEMPLATES
from mmpt.eval.video_retrieval import load_video_retrieval_set, video_rank_metrics
from mmpt.eval.zeroshot import load_templates


def test_recall_metrics_on_hand_built_ranks():
    # 3 images, 4 captions (image 0 has two). Scores chosen so the ranks are known.
    image = torch.eye(3)
    text = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [0.5, 0.9, 0], [0.2, 0, 0.1]])
    owner = torch.tensor([0, 0, 1, 2])
    m = recall_metrics(image, text, owner)
    # text -> image: caption0 -> image0 rank 0; caption1 -> image0 (score 0) vs image2 (1): rank 1;
    # caption2 -> image1 (0.9) best: rank 0; caption3 -> image2 (0.1) vs image0 (0.2): rank 1.
    assert m["image_retrieval_recall@1"] == pytest.approx(2 / 4) and m["image_retrieval_recall@5"] == 1.0
    # image -> text: image0's best own caption is caption0 (1.0): rank 0; image1 -> caption2: rank 0;
    # image2 -> caption3 (0.1) behind caption1 (1.0): rank 1.
    assert m["text_retrieval_recall@1"] == pytest.approx(2 / 3) and m["text_retrieval_recall@10"] == 1.0
    assert m["mean_recall"] == pytest.approx((2 / 4 + 1 + 1 + 2 / 3 + 1 + 1) / 6)


def test_identical_captions_of_other_images_rank_before_the_own_one():
    # two images of dogs, each captioned "a dog" (the same text, so the same features), and a cat
    image = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    dog, cat = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    m = recall_metrics(image, torch.stack([dog, dog, cat]), torch.tensor([0, 1, 2]))
    # image -> text: each dog image's own caption ties with the other dog's: rank 1, not 0
    assert m["text_retrieval_recall@1"] == pytest.approx(1 / 3) and m["text_retrieval_recall@5"] == 1.0
    # text -> image: "a dog" of image 1 scores image 0 higher (1.0 > 0.8): rank 1; the others rank 0
    assert m["image_retrieval_recall@1"] == pytest.approx(2 / 3)


def test_ranks_with_ties_equal_a_brute_force_count():
    generator = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(7, 4, generator=generator), dim=-1)
    distinct = torch.nn.functional.normalize(torch.randn(3, 4, generator=generator), dim=-1)
    pick = torch.randint(0, 3, (14,), generator=generator)  # 14 captions from 3 texts: many exact ties
    owner = torch.arange(14) % 7
    scores = images @ distinct[pick].T
    item_rank, text_rank = retrieval_ranks(scores, owner)
    for t in range(14):
        own = scores[owner[t], t]
        assert item_rank[t] == sum(1 for i in range(7) if i != owner[t] and scores[i, t] >= own)
    for i in range(7):
        best = max(scores[i, t] for t in range(14) if owner[t] == i)
        assert text_rank[i] == sum(1 for t in range(14) if owner[t] != i and scores[i, t] >= best)
    assert text_rank.float().mean() > 1  # the ties were there to count


def test_retrieval_jsonl_layout_and_errors(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"image": "a.png", "caption": ["x", "y"]})
        + "\n"
        + json.dumps({"image": "/abs.png", "caption": "z"})
        + "\n"
    )
    images, captions = load_retrieval_set(path)
    assert images[0] == tmp_path / "a.png" and str(images[1]) == "/abs.png" and captions == [["x", "y"], ["z"]]
    path.write_text('{"image": "a.png"}\n')
    with pytest.raises(DataError, match=r"r.jsonl:1: expected"):
        load_retrieval_set(path)


def test_official_caption_normalization_and_templates():
    assert official_caption_normalization("A “Red” Car") == 'a "red" car'
    assert len(DEFAULT_TEMPLATES["en"]) == 80 and all(
        "{c}" in t for t in DEFAULT_TEMPLATES["en"] + DEFAULT_TEMPLATES["zh"]
    )


def test_video_rank_metrics_on_hand_built_ranks():
    # the same scores as above, read as 3 clips and 4 captions: 1-based ranks
    video = torch.eye(3)
    text = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [0.5, 0.9, 0], [0.2, 0, 0.1]])
    m = video_rank_metrics(video, text, torch.tensor([0, 0, 1, 2]))
    # text -> video ranks 1, 3, 1, 2 (caption 1 scores 0 with its clip, tied with clip 1: the tie counts
    # against it); video -> text ranks 1, 1, 2
    assert m["video_retrieval_recall@1"] == pytest.approx(0.5) and m["video_retrieval_recall@5"] == 1.0
    assert m["video_retrieval_median_rank"] == 1.5  # an even count: the mean of the middle two, as np.median
    assert m["video_retrieval_mean_rank"] == pytest.approx(1.75)
    assert m["text_retrieval_recall@1"] == pytest.approx(2 / 3) and m["text_retrieval_median_rank"] == 1.0
    assert m["text_retrieval_mean_rank"] == pytest.approx(4 / 3)


def test_msrvtt_csv_and_video_jsonl_layouts(tmp_path):
    videos = tmp_path / "videos"
    videos.mkdir()
    for name in ("video7.mp4", "video9.webm"):
        (videos / name).write_bytes(b"")
    (tmp_path / "test.csv").write_text("video_id,sentence\nvideo7,a man sings\nvideo9,a cat\nvideo7,someone sings\n")
    files, captions = load_video_retrieval_set(tmp_path / "test.csv")
    assert files == [videos / "video7.mp4", videos / "video9.webm"]
    assert captions == [["a man sings", "someone sings"], ["a cat"]]
    (tmp_path / "missing.csv").write_text("video_id,sentence\nvideo8,a dog\n")
    with pytest.raises(DataError, match="video8"):
        load_video_retrieval_set(tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text("id,text\nvideo7,x\n")
    with pytest.raises(DataError, match="video_id,sentence"):
        load_video_retrieval_set(tmp_path / "bad.csv")
    (tmp_path / "r.jsonl").write_text(json.dumps({"video": "videos/video7.mp4", "caption": "a man sings"}) + "\n")
    assert load_video_retrieval_set(tmp_path / "r.jsonl") == ([tmp_path / "videos/video7.mp4"], [["a man sings"]])
    # found beside the listing first: a video root set for another listing (a csv's) does not move them
    assert load_video_retrieval_set(tmp_path / "r.jsonl", tmp_path / "msrvtt") == load_video_retrieval_set(
        tmp_path / "r.jsonl"
    )
    # the listing given to the video shard maker: clips named by id, found under a video root
    (tmp_path / "ids.jsonl").write_text(json.dumps({"video": "video9", "caption": "a cat"}) + "\n")
    assert load_video_retrieval_set(tmp_path / "ids.jsonl", videos) == ([videos / "video9.webm"], [["a cat"]])
    with pytest.raises(DataError, match=rf"ids.jsonl: video {re.escape(str(tmp_path / 'video9'))} not found"):
        load_video_retrieval_set(tmp_path / "ids.jsonl")  # found only in its own folder without one
    # the MSR-VTT 1k-A list as JSFusion distributes it
    (tmp_path / "MSRVTT_JSFUSION_test.csv").write_text(
        "key,vid_key,video_id,sentence\nret0,msr7,video7,a man sings\nret1,msr9,video9,a cat plays\n"
    )
    assert load_video_retrieval_set(tmp_path / "MSRVTT_JSFUSION_test.csv") == (
        [videos / "video7.mp4", videos / "video9.webm"],
        [["a man sings"], ["a cat plays"]],
    )
    # DiDeMo's annotation list: each video's moment descriptions joined into one paragraph query
    (tmp_path / "test_data.json").write_text(
        json.dumps(
            [
                {"annotation_id": 1, "video": "video7.mov", "description": "a man walks in. ", "times": [[0, 1]]},
                {"annotation_id": 2, "video": "video9.webm", "description": "a cat jumps", "times": [[2, 2]]},
                {"annotation_id": 3, "video": "video7.mov", "description": "he starts to sing", "times": [[3, 4]]},
            ]
        )
    )
    assert load_video_retrieval_set(tmp_path / "test_data.json") == (
        [videos / "video7.mp4", videos / "video9.webm"],
        [["a man walks in. he starts to sing"], ["a cat jumps"]],
    )


def test_clip_benchmark_per_language_folders_and_missing_templates(tmp_path, digits_root, caplog):
    import shutil

    from mmpt.eval.zeroshot import ClassNamesError, load_classification_set

    source = digits_root / "zeroshot"
    folder = tmp_path / "digits_cb"
    shutil.copytree(source / "test", folder / "test")
    for language, suffix in (("en", ""), ("zh", "_zh")):
        (folder / language).mkdir()
        shutil.copy(source / f"classnames{suffix}.txt", folder / language / "classnames.txt")
    shutil.copy(
        source / "zeroshot_classification_templates.txt", folder / "en" / "zeroshot_classification_templates.txt"
    )
    english = load_classification_set(folder, "en")
    assert english.templates_from == str(folder / "en" / "zeroshot_classification_templates.txt")
    chinese = load_classification_set(folder, "zh")  # class names in zh/, no zh templates: mmpt's, said so
    assert chinese.classnames == (source / "classnames_zh.txt").read_text(encoding="utf-8").split()
    assert chinese.templates == DEFAULT_TEMPLATES["zh"] and "mmpt default 'zh' templates" in chinese.templates_from
    assert "no 'zh' prompt templates (looked for zh/zeroshot_classification_templates.txt" in caplog.text
    caplog.clear()  # checked before training, then evaluated every eval_every steps: said once
    assert load_classification_set(folder, "zh").templates == chinese.templates and "templates" not in caplog.text
    with pytest.raises(MissingDataError, match="no 'fr' prompt templates .* no default 'fr' templates"):
        load_templates(folder, "fr")  # exit 2, as a missing file is
    suffixed = load_classification_set(source, "zh")  # the suffixed layout still reads
    assert suffixed.templates_from.endswith("zeroshot_classification_templates_zh.txt")
    assert [n for _, n, _ in english.samples()] == [n for _, n, _ in suffixed.samples()]
    (folder / "zh" / "classnames.txt").unlink()
    with pytest.raises(ClassNamesError, match=r"no 'zh' class names \(looked for .*zh/classnames.txt"):
        load_classification_set(folder, "zh")


def test_results_of_datasets_with_the_same_folder_name_do_not_overwrite(tmp_path):
    from mmpt.methods.base import eval_record, save_eval_record

    first = save_eval_record(
        eval_record(tmp_path, "a/cifar10", "zeroshot_classification", "en", {"acc1": 0.1}), tmp_path
    )
    second = save_eval_record(
        eval_record(tmp_path, "b/cifar10", "zeroshot_classification", "en", {"acc1": 0.2}), tmp_path
    )
    assert first != second and json.loads(first.read_text())["metrics"]["acc1"] == 0.1
    assert json.loads(second.read_text())["dataset"] == "b/cifar10"
    shards = save_eval_record(
        eval_record(tmp_path, "c/test-{00000..00003}.tar", "zeroshot_retrieval", "zh", {"mean_recall": 0.5}), tmp_path
    )
    assert re.fullmatch(r"zeroshot_retrieval_test-_00000\.\.00003_[0-9a-f]{6}_zh\.json", shards.name), shards.name


COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "grey": (128, 128, 128)}


class ColourModel(torch.nn.Module):
    """Images encode as their mean colour, texts as the colour they name: retrieval of known outcome."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def encode_image(self, images):
        return images.mean((2, 3)) * self.scale

    def encode_text(self, input_ids, attention_mask):
        return torch.stack([torch.tensor(COLOURS[list(COLOURS)[i]], dtype=torch.float32) for i in input_ids[:, 0]])


def colour_tokenize(texts):
    ids = torch.tensor([[next(i for i, name in enumerate(COLOURS) if name in t)] for t in texts])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def colour_png(name: str) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), COLOURS[name]).save(buffer, format="PNG")
    return buffer.getvalue()


# four images; the grey one has no caption (a distractor only); "a red or blue thing" matches two images
IMAGES = ["red", "green", "blue", "grey"]
CAPTIONS = {"red": ["a red square", "red"], "green": ["a green square"], "blue": ["blue tile"]}


def write_layouts(folder):
    """The same set in every layout the retrieval reader knows, as each project writes it."""
    import base64

    (folder / "images" / "val2014").mkdir(parents=True)
    for name in IMAGES:
        (folder / "images" / "val2014" / f"{name}.png").write_bytes(colour_png(name))
    captioned = [n for n in IMAGES if n in CAPTIONS]
    layouts = {}
    layouts["jsonl"] = folder / "m2.jsonl"
    layouts["jsonl"].write_text(
        "".join(json.dumps({"image": f"images/val2014/{n}.png", "caption": CAPTIONS[n]}) + "\n" for n in captioned)
    )
    layouts["albef"] = folder / "coco_karpathy_test.json"
    layouts["albef"].write_text(
        json.dumps([{"image": f"images/val2014/{n}.png", "caption": CAPTIONS[n]} for n in captioned])
    )
    layouts["karpathy"] = folder / "images" / "dataset_coco.json"
    layouts["karpathy"].write_text(
        json.dumps(
            {
                "dataset": "coco",
                "images": [
                    {
                        "filepath": "val2014",
                        "filename": f"{n}.png",
                        "split": "test",
                        "cocoid": i,
                        "sentences": [{"raw": c, "tokens": c.split()} for c in CAPTIONS[n]],
                    }
                    for i, n in enumerate(captioned)
                ]
                + [{"filepath": "val2014", "filename": "grey.png", "split": "train", "sentences": [{"raw": "grey"}]}],
            }
        )
    )
    (folder / "cn").mkdir()
    layouts["chinese_clip"] = folder / "cn" / "valid_texts.jsonl"
    texts = [(c, [IMAGES.index(n)]) for n in captioned for c in CAPTIONS[n]]
    layouts["chinese_clip"].write_text(
        "".join(
            json.dumps({"text_id": t, "text": text, "image_ids": [1000 + i for i in ids]}, ensure_ascii=False) + "\n"
            for t, (text, ids) in enumerate(texts)
        )
    )
    (folder / "cn" / "valid_imgs.tsv").write_text(
        "".join(f"{1000 + i}\t{base64.b64encode(colour_png(n)).decode()}\n" for i, n in enumerate(IMAGES))
    )
    return layouts


def test_every_retrieval_layout_reads_the_same_set(tmp_path):
    from mmpt.eval.retrieval import zeroshot_retrieval
    from mmpt.eval.retrieval_formats import read_retrieval_set

    layouts = write_layouts(tmp_path)
    for name, path in layouts.items():
        data = read_retrieval_set(path)
        assert sorted(data.texts) == sorted(c for group in CAPTIONS.values() for c in group), name
        assert data.matches.sum() == len(data.texts) and data.matches.any(0).all(), name
    assert len(read_retrieval_set(layouts["chinese_clip"]).images) == 4  # the tsv's distractor stays a candidate
    assert len(read_retrieval_set(layouts["karpathy"]).images) == 3  # the train split's image is not in the test

    def transform(image):
        return torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)

    results = {
        name: zeroshot_retrieval(ColourModel(), colour_tokenize, transform, path, batch_size=2)
        for name, path in layouts.items()
    }
    for name, metrics in results.items():
        assert metrics["image_retrieval_recall@1"] == 1.0, name  # every caption finds its colour first
        assert metrics == results["jsonl"], name


def test_a_text_matching_several_images_and_an_image_without_text(tmp_path):
    from mmpt.eval.retrieval_formats import check_chinese_clip, read_retrieval_set

    folder = tmp_path / "muge"
    folder.mkdir()
    import base64

    (folder / "valid_imgs.tsv").write_text(
        "".join(f"{i}\t{base64.b64encode(colour_png(n)).decode()}\n" for i, n in enumerate(IMAGES))
    )
    (folder / "valid_texts.jsonl").write_text(
        json.dumps({"text_id": 0, "text": "红色或蓝色", "image_ids": [0, 2]}, ensure_ascii=False) + "\n"
    )
    check_chinese_clip(folder / "valid_texts.jsonl")  # what a run checks before training: the first image decodes
    data = read_retrieval_set(folder / "valid_texts.jsonl")
    assert data.matches[:, 0].tolist() == [True, False, True, False]
    scores = torch.tensor([[0.2], [0.9], [0.5], [0.1]])  # green scores highest, then blue (a match), then red
    item_rank, text_rank = retrieval_ranks(scores, data.matches)
    assert item_rank.tolist() == [1]  # the best match (blue) has one non-match (green) above it
    assert text_rank.tolist() == [0, 0]  # only the two matched images are image -> text queries
    (folder / "valid_texts.jsonl").write_text(json.dumps({"text_id": 0, "text": "x", "image_ids": [7]}) + "\n")
    with pytest.raises(
        DataError, match=r"valid_texts.jsonl:1: expected .* with ids of valid_imgs.tsv \(KeyError: '7'\)"
    ):
        read_retrieval_set(folder / "valid_texts.jsonl")


class ColourVideoModel(ColourModel):
    def encode_video(self, clips):  # [B, T, C, H, W] frames in [0, 1]
        return clips.mean((1, 3, 4)) * self.scale


def test_zeroshot_video_classification_over_class_folders(tmp_path, caplog):
    from mmpt.data.video import VideoTextDecoder
    from mmpt.demo.moving_digits import encode_mp4
    from mmpt.eval.video_classification import load_video_classification_set, video_classification

    def clip(name):
        return encode_mp4(np.tile(np.array(COLOURS[name], dtype=np.uint8), (4, 32, 32, 1)))

    placed = {"red": ["red", "red"], "green": ["green", "green"], "blue": ["blue", "blue", "red"]}  # one mislabelled
    for folder, colours in placed.items():
        (tmp_path / "k" / folder).mkdir(parents=True)
        for i, colour in enumerate(colours):
            (tmp_path / "k" / folder / f"{i}.mp4").write_bytes(clip(colour))
    data = load_video_classification_set(tmp_path / "k", "en")
    assert data.classnames == ["blue", "green", "red"] and "mmpt default 'en' templates" in data.templates_from
    assert "no 'en' prompt templates" in caplog.text
    decode = VideoTextDecoder(2, None, lambda texts: {}, train=False).decode_video
    metrics = video_classification(ColourVideoModel(), colour_tokenize, decode, data, batch_size=3)
    assert metrics["acc1"] == pytest.approx(6 / 7) and metrics["acc5"] == 1.0
    assert metrics["mean_per_class_recall"] == pytest.approx((2 / 3 + 1 + 1) / 3)


def image_folder(root, names, per_class=2):
    from PIL import Image

    for index, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            Image.new("RGB", (8, 8), color=(index * 40, k * 60, 0)).save(root / name / f"{k}.png")
    return root


def test_class_names_are_checked_by_what_they_are(tmp_path):
    from mmpt.eval.zeroshot import ClassNamesError, load_classification_set

    synsets = image_folder(tmp_path / "imagenet", ["n01440764", "n01443537", "n01484850"])
    with pytest.raises(ClassNamesError, match=r"class folders are named by ids \(n01440764, n01443537, n01484850\)"):
        load_classification_set(synsets, "en")
    (synsets / "classnames.txt").write_text("tench\ngoldfish\ngreat white shark\n")
    assert load_classification_set(synsets, "en").classnames == ["tench", "goldfish", "great white shark"]
    # Chinese prompts: the English names are passed over, and refused unless allowed.
    with pytest.raises(
        ClassNamesError,
        match=r"no 'zh' class names .*classnames.txt is not written in it.*"
        r"foreign_class_names",
    ):
        load_classification_set(synsets, "zh")
    assert load_classification_set(synsets, "zh", foreign_class_names=True).classnames[0] == "tench"
    (synsets / "classnames_zh.txt").write_text("丁鲷\n金鱼\n大白鲨\n", encoding="utf-8")
    assert load_classification_set(synsets, "zh").classnames == ["丁鲷", "金鱼", "大白鲨"]
    # CLIP_benchmark's per-language layout: one root per language, a plain classnames.txt in Chinese.
    zh_root = image_folder(tmp_path / "cifar_zh", ["0", "1"])
    (zh_root / "classnames.txt").write_text("飞机\n汽车\n", encoding="utf-8")
    assert load_classification_set(zh_root, "zh").classnames == ["飞机", "汽车"]
    (zh_root / "classnames.txt").write_text("飞机\n汽车\n鸟\n", encoding="utf-8")  # a config error, as in training
    with pytest.raises(ClassNamesError, match=r"classnames.txt lists 3 classes but .*cifar_zh has 2 class folders"):
        load_classification_set(zh_root, "zh")
    (zh_root / "classnames.txt").write_text("飞机\n汽车\n", encoding="utf-8")
    (zh_root / "zeroshot_classification_templates.txt").write_text("一张照片\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"templates.txt: every template needs a '\{c\}' placeholder"):
        load_classification_set(zh_root, "zh")
    # English folder names in Chinese prompts.
    folders = image_folder(tmp_path / "animals", ["cat", "dog"])
    assert load_classification_set(folders, "en").classnames == ["cat", "dog"]
    with pytest.raises(ClassNamesError, match=r"the class folders' names \(cat, dog, \.\.\.\) are not written in 'zh'"):
        load_classification_set(folders, "zh")


def test_chinese_clip_zeroshot_layout_scores_as_the_clip_benchmark_one(tmp_path, digits_root, corpora):
    """The digits zero-shot set (CLIP_benchmark's shards) rewritten as Chinese-CLIP's layout (label_cn.txt,
    label.txt, test/NNN/): the same model scores the same accuracy on both (in Chinese; label.txt is read for
    English the same way)."""
    import shutil

    from test_locking import tiny

    from mmpt.eval.zeroshot import load_classification_set, zeroshot_classification

    source = digits_root / "zeroshot"
    cn = tmp_path / "digits_cn"
    for image, label, where in load_classification_set(source, "en").samples():
        (cn / "test" / f"{label:03d}").mkdir(parents=True, exist_ok=True)
        (cn / "test" / f"{label:03d}" / f"{where.rsplit(':', 1)[-1]}.png").write_bytes(image)
    shutil.copy(source / "classnames_zh.txt", cn / "label_cn.txt")
    shutil.copy(source / "classnames.txt", cn / "label.txt")
    for templates in source.glob("zeroshot_classification_templates*.txt"):
        shutil.copy(templates, cn / templates.name)
    (tmp_path / "run").mkdir()
    cfg, method, model = tiny("clip", corpora, tmp_path / "run")
    tokenizer, transform = method.tokenizer(cfg, tmp_path / "run"), method.image_transform(cfg, train=False)
    for language in ("zh",):
        ours, theirs = (load_classification_set(folder, language) for folder in (source, cn))
        assert ours.classnames == theirs.classnames and len(list(theirs.samples())) == len(list(ours.samples()))
        scores = [zeroshot_classification(model, tokenizer, transform, data, batch_size=16) for data in (ours, theirs)]
        assert scores[0] == scores[1], (language, scores)


def test_top_images_file_scores_in_chinese_clips_own_evaluation_as_mmpt_does(tmp_path):
    """A Chinese-CLIP retrieval set (12 colour images in `valid_imgs.tsv`, a Chinese caption each, with their ids)
    scored by a model whose captions land near their image's colour, some nearer another's: `predictions` holds
    each caption's 10 best images as `make_topk_predictions` writes them, and Chinese-CLIP's own
    `evaluation.compute_score` reads it to the text-to-image recall@1/5/10 mmpt reports."""
    import base64
    import io

    from cn_clip.eval.evaluation import compute_score
    from PIL import Image

    from mmpt.eval.retrieval import zeroshot_retrieval

    generator = torch.Generator().manual_seed(3)
    colours = torch.rand(12, 3, generator=generator)
    near = colours + 0.25 * torch.randn(12, 3, generator=generator)  # each caption's features: its colour, moved

    class Model(ColourModel):  # images as their mean colour; caption i as `near[i]`
        def encode_text(self, input_ids, attention_mask):
            return near[input_ids[:, 0]]

    def tokenize(texts):
        ids = torch.tensor([[int(t.removeprefix("颜色"))] for t in texts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def png(rgb) -> str:
        buffer = io.BytesIO()
        Image.new("RGB", (4, 4), tuple(int(255 * v) for v in rgb)).save(buffer, format="PNG")
        return base64.b64encode(buffer.getvalue()).decode()

    (tmp_path / "valid_imgs.tsv").write_text("".join(f"{5000 + i}\t{png(c)}\n" for i, c in enumerate(colours)))
    texts = tmp_path / "valid_texts.jsonl"
    lines = [{"text_id": 100 + i, "text": f"颜色{i}", "image_ids": [5000 + i]} for i in range(12)]
    texts.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")

    def transform(image):
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)

    predictions = tmp_path / "out" / "predictions.jsonl"
    ours = zeroshot_retrieval(Model(), tokenize, transform, texts, batch_size=5, predictions=predictions)
    first = json.loads(predictions.read_text().splitlines()[0])
    assert first["text_id"] == 100 and len(first["image_ids"]) == 10 and all(i >= 5000 for i in first["image_ids"])
    _, r1, r5, r10 = compute_score(str(texts), str(predictions))
    assert 0.2 < ours["image_retrieval_recall@1"] < 0.9  # neither all found first nor at chance
    assert [r1, r5, r10] == pytest.approx([100 * ours[f"image_retrieval_recall@{k}"] for k in (1, 5, 10)])
