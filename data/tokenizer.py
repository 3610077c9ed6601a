"""A bilingual (Chinese/English) WordPiece tokenizer built from a corpus, and a padding wrapper.

BERT's normaliser splits every CJK character into its own word, so Chinese needs no segmenter;
English words become WordPiece units. Trained in seconds on a demo corpus, fully offline.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_wordpiece(texts: Iterable[str], path: str | os.PathLike, vocab_size: int = 2000) -> Tokenizer:
    """Build a WordPiece vocabulary from `texts` and save a `tokenizer.json` at `path` (transformers loads it too).

    Deterministic (the same texts always give the same file, which `tokenizers`' own trainer does not
    promise): every character seen, as a word start and as a `##` continuation, then whole words by
    frequency, ties in alphabetical order, up to `vocab_size`.
    """
    normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    characters = sorted({char for word in counts for char in word})
    vocab = [*SPECIAL_TOKENS, *characters, *(f"##{char}" for char in characters)]
    known = set(vocab)
    for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(vocab) >= vocab_size:
            break
        if word not in known:
            vocab.append(word)
            known.add(word)
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab.index("[CLS]")), ("[SEP]", vocab.index("[SEP]"))],
    )
    tokenizer.save(str(path))
    return tokenizer


class TextTokenizer:
    """Texts -> {"input_ids", "attention_mask"} of shape [n, context_length]; right padding."""

    def __init__(self, path: str | os.PathLike, context_length: int):
        self.path = str(path)
        self.context_length = context_length
        self._tokenizer = Tokenizer.from_file(self.path)
        self._tokenizer.enable_truncation(context_length)
        pad_id = self._tokenizer.token_to_id("[PAD]")
        self._tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, length=context_length)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def token_id(self, token: str) -> int:
        """The id of a (special) token, e.g. "[MASK]"; KeyError if the vocabulary lacks it."""
        index = self._tokenizer.token_to_id(token)
        if index is None:
            raise KeyError(f"{self.path} has no token {token!r}")
        return index

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encodings = self._tokenizer.encode_batch(list(texts))
        return {
            "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.long),
        }

    @property
    def pad_id(self) -> int:
        return self._tokenizer.padding["pad_id"] if self._tokenizer.padding else 0

    def save_pretrained(self, out: str | os.PathLike) -> None:
        """This tokenizer as a transformers `PreTrainedTokenizerFast` in `out`: the same ids and padding."""
        from transformers import PreTrainedTokenizerFast

        vocab = self._tokenizer.get_vocab()
        names = ("unk_token", "[UNK]"), ("cls_token", "[CLS]"), ("sep_token", "[SEP]"), ("mask_token", "[MASK]")
        specials = {key: token for key, token in names if token in vocab}
        fast = PreTrainedTokenizerFast(
            tokenizer_file=self.path,
            pad_token=self._tokenizer.id_to_token(self.pad_id),
            model_max_length=self.context_length,
            **specials,
        )
        fast.save_pretrained(str(out))
