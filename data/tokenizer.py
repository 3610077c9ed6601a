"""A bilingual (Chinese/English) WordPiece tokenizer trained on a corpus, and a padding wrapper.

BERT's normaliser splits every CJK character into its own word, so Chinese needs no segmenter;
English words become WordPiece units. Trained in seconds on a demo corpus, fully offline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_wordpiece(texts: Iterable[str], path: str | os.PathLike, vocab_size: int = 2000) -> Tokenizer:
    """Train on `texts`, save as a `tokenizer.json` at `path` (loadable by transformers too)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
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

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encodings = self._tokenizer.encode_batch(list(texts))
        return {
            "input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.long),
        }
