"""The suite's training data, built on the machine by the project's own corpus builders (nothing is downloaded).

- image-text: the bilingual digits corpus (`mmpt.demo.digits`), 32 px scans that each method's
  transforms resize to its input size (224 px for ViT-B/16 and M²-Encoder 0.4B);
- video-text: the moving-digits clips (`mmpt.demo.moving_digits`), mp4 encoded with PyAV;
- dialogs: the generated task-oriented dialogs (`mmpt.demo.dialogs`) and, as SPACE-2's encoder, a
  randomly initialised BERT checkpoint written here (bert-base's shape on the GPU) with a WordPiece
  vocabulary laid out like BERT's, so the `[unusedN]` slots SPACE-2 puts its role tokens on exist.

Each builder returns at once when its corpus is already complete, so stages can share them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from pathlib import Path

# BERT's first ids: [PAD], [unused0..98], then [UNK] [CLS] [SEP] [MASK] at 100..103.
BERT_HEAD = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def digits(root: Path, dry_run: bool) -> Path:
    from mmpt.demo.digits import build_digits

    if dry_run:  # what the tests build: fewer captions, smaller shards
        return build_digits(root / "digits", captions_per_image=2, shard_size=400)
    return build_digits(root / "digits")


def moving_digits(root: Path, dry_run: bool) -> Path:
    from mmpt.demo.moving_digits import build_moving_digits

    clips = 12 if dry_run else 96  # per kind; training is resampled, so a few hundred clips serve any step count
    return build_moving_digits(
        root / "moving_digits", clips_per_kind=clips, test_clips_per_kind=6, shard_size=8 if dry_run else 64
    )


def dialogs(root: Path) -> Path:
    from mmpt.demo.dialogs import build_dialog_shards

    return build_dialog_shards(root / "dialogs")


def corpus_words(corpus: Path) -> list[str]:
    """Lower-case words of the dialog files, most frequent first (ties alphabetical)."""
    counts: Counter[str] = Counter()
    for path in sorted(corpus.rglob("*.json*")):
        counts.update(re.findall(r"[a-z]+", path.read_text(encoding="utf-8").lower()))
    return [w for w, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def bert_vocabulary(words: list[str], size: int | None) -> list[str]:
    """BERT's layout: special and unused slots, characters, `##` continuations, words; padded with
    further `[unusedN]` entries up to `size` (None: no padding)."""
    characters = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = [*BERT_HEAD, *characters, *(f"##{c}" for c in characters)]
    known = set(vocab)
    for word in words:
        if size is not None and len(vocab) >= size:
            break
        if word not in known:
            vocab.append(word)
            known.add(word)
    if size is not None:
        vocab += [f"[unused{i}]" for i in range(99, 99 + size - len(vocab))]
    return vocab


def bert_checkpoint(directory: Path, corpus: Path, dry_run: bool) -> Path:
    """A random BERT (bert-base's shape, or 2 x 32 for the dry run) with its tokenizer, as SPACE-2 loads one."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    if (directory / "config.json").is_file():
        return directory
    if dry_run:
        vocab = bert_vocabulary(corpus_words(corpus), None)
        config = BertConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
        )
    else:
        config = BertConfig()  # bert-base-uncased's shape: 12 x 768, 30,522 tokens, 512 positions
        vocab = bert_vocabulary(corpus_words(corpus), config.vocab_size)
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True)
    staging = directory.with_name(directory.name + ".building")
    tokenizer.save_pretrained(staging)
    BertForMaskedLM(config).save_pretrained(staging)
    staging.rename(directory)
    return directory
