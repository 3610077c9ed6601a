import json

import pytest
import torch

from mmpt.data.shards import DataError
from mmpt.eval.retrieval import load_retrieval_set, official_caption_normalization, recall_metrics
from mmpt.eval.templates import DEFAULT_TEMPLATES


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


def test_retrieval_jsonl_layout_and_errors(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"image": "a.png", "caption": ["x", "y"]}) + "\n" + json.dumps({"image": "/abs.png", "caption": "z"}) + "\n")
    images, captions = load_retrieval_set(path)
    assert images[0] == tmp_path / "a.png" and str(images[1]) == "/abs.png" and captions == [["x", "y"], ["z"]]
    path.write_text('{"image": "a.png"}\n')
    with pytest.raises(DataError, match=r"r.jsonl:1: expected"):
        load_retrieval_set(path)


def test_official_caption_normalization_and_templates():
    assert official_caption_normalization("A “Red” Car") == 'a "red" car'
    assert len(DEFAULT_TEMPLATES["en"]) == 80 and all("{c}" in t for t in DEFAULT_TEMPLATES["en"] + DEFAULT_TEMPLATES["zh"])
