"""The digits corpus' second zero-shot set: the held-out scans drawn at other sizes and positions, with
prompt wordings that no training caption and no `zeroshot/` template uses."""

import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from mmpt.data.tokenizer import TextTokenizer
from mmpt.demo.corpus import COMPLETE_MARKER
from mmpt.demo.digits import build_digits
from mmpt.eval.zeroshot import load_classification_set


def shard_members(pattern_root, suffix):
    """{sample key: member bytes} of every shard under `pattern_root` for members ending in `suffix`."""
    found = {}
    for shard in sorted(pattern_root.rglob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(suffix):
                    found[member.name[: -len(suffix)]] = tar.extractfile(member).read()
    return found


def bright_box(png):
    """(width, height, centre x, centre y) of the pixels brighter than a quarter of full scale."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
    ys, xs = np.nonzero(pixels > 64)
    return xs.max() - xs.min() + 1, ys.max() - ys.min() + 1, (xs.max() + xs.min()) / 2, (ys.max() + ys.min()) / 2


def test_unseen_set_is_the_held_out_scans_drawn_elsewhere(digits_root):
    seen, unseen = (digits_root / folder / "test" for folder in ("zeroshot", "zeroshot_unseen"))
    assert shard_members(seen, ".cls") == shard_members(unseen, ".cls")  # the same scans, the same labels
    seen_png, unseen_png = shard_members(seen, ".png"), shard_members(unseen, ".png")
    same = [key for key in seen_png if seen_png[key] == unseen_png[key]]  # a draw of scale ~1 and no shift
    assert len(seen_png) == 359 and len(same) < 359 * 0.02
    seen_boxes = np.array([bright_box(png) for png in seen_png.values()])
    unseen_boxes = np.array([bright_box(png) for png in unseen_png.values()])
    # Training-style scans fill a centred frame; the unseen ones vary in size and position.
    assert seen_boxes[:, 1].min() >= 24 and np.abs(seen_boxes[:, 3] - 15.5).max() <= 3
    assert unseen_boxes[:, 1].min() <= 22 and unseen_boxes[:, 1].std() > 2 * seen_boxes[:, 1].std()
    assert unseen_boxes[:, 2:].std(axis=0).min() > 1.5 * seen_boxes[:, 2:].std(axis=0).max()


@pytest.mark.parametrize("language", ["en", "zh"])
def test_unseen_prompts_are_worded_as_nothing_else_and_tokenize_without_unknowns(digits_root, language):
    unseen = load_classification_set(digits_root / "zeroshot_unseen", language)
    seen = load_classification_set(digits_root / "zeroshot", language)
    assert unseen.templates_from.endswith(
        "zeroshot_classification_templates" + ("" if language == "en" else "_zh") + ".txt"
    )
    assert unseen.classnames == seen.classnames and not set(unseen.templates) & set(seen.templates)
    captions = {text.decode() for text in shard_members(digits_root / "train" / language, ".txt").values()}
    prompts = {template.format(c=name) for template in unseen.templates for name in unseen.classnames}
    assert len(prompts) == 40 and not prompts & captions
    stripped = {prompt.rstrip(".。") for prompt in prompts}
    assert not any(prompt in caption for prompt in stripped for caption in captions)
    tokenizer = TextTokenizer(digits_root / "tokenizer.json", 24)
    ids = tokenizer(sorted(prompts))["input_ids"]
    assert not (ids == tokenizer.token_id("[UNK]")).any()


def test_a_corpus_from_an_older_builder_is_refused_and_kept(tmp_path):
    root = tmp_path / "digits"
    root.mkdir()
    (root / COMPLETE_MARKER).write_text("train images: 1438, held-out images: 359\n")  # version 1 wrote no version
    with pytest.raises(RuntimeError, match=f"{root}.*version 1.*Delete {root}"):
        build_digits(root)
    assert sorted(path.name for path in root.iterdir()) == [COMPLETE_MARKER]


def test_a_build_that_loses_the_race_to_publish_keeps_the_winners_corpus(tmp_path, monkeypatch):
    """Two ranks build the corpus at once: the second to finish finds the first's copy of the same builder version
    in place, keeps it and goes on (its own staging folder is removed)."""
    import mmpt.demo.digits as digits

    root = tmp_path / "digits"
    build_digits(root)
    winner = (root / COMPLETE_MARKER).read_text()
    monkeypatch.setattr(digits, "is_built", lambda path, version: False)  # as if it looked before the winner finished
    assert build_digits(root) == root
    assert (root / COMPLETE_MARKER).read_text() == winner
    assert [p.name for p in tmp_path.iterdir()] == ["digits"]
