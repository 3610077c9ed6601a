"""The official M²-Encoder text tokenizer (GLM-10B-Chinese SentencePiece), re-implemented.

Known from the official code (`GLMChineseTokenizer` under transformers 4.17, which M²-Encoder pins):
- the text is first split at literal occurrences of the four special tokens `[CLS]`, `<|endoftext|>`,
  `[MASK]` and `[UNK]`, each becoming its own id; the text left of one loses its trailing
  whitespace and the text right of one its leading whitespace, and pieces left empty are dropped;
- in each remaining piece, runs of 2-10 spaces become `<|blank_n|>` (n = 10 first), then SentencePiece
  encodes the piece (its own dummy-prefix `▁` included); other special spellings (`[SEP]`,
  `[gMASK]`, `<|blank_3|>`) are SentencePiece's own user-defined pieces and are matched there;
- characters outside the vocabulary map to 0 (`<unk>`), not to `[UNK]`;
- the sequence is `[CLS] pieces <|endoftext|>`, 52 ids, content truncated from the *left* (the last
  50 pieces are kept), right-padded with id 50000 (`<|endoftext|>`), attention mask 0 on padding.
"""

from __future__ import annotations

import os
import re

import sentencepiece
import torch

CLS_ID = 50002  # the official sp.model's ids; a tokenizer reads its own from its model file
EOS_ID = PAD_ID = 50000
# The tokens the official tokenizer never lets SentencePiece see: its special tokens (cls, eos = pad,
# mask, unk in its tokenizer_config.json).
NO_SPLIT_TOKENS = ("[CLS]", "<|endoftext|>", "[MASK]", "[UNK]")
_BLANKS = re.compile(r" {2,}")
_NO_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in NO_SPLIT_TOKENS) + ")")


def encode_whitespaces(text: str) -> str:
    """Each run of spaces -> `<|blank_n|>` pieces, n = 10 first, then the remainder (a single space stays)."""

    def replace(match: re.Match) -> str:
        run, out = len(match.group()), []
        while run >= 2:
            n = min(run, 10)
            out.append(f"<|blank_{n}|>")
            run -= n
        return "".join(out) + " " * run

    return _BLANKS.sub(replace, text)


def split_special(text: str) -> list[str]:
    """`text` cut at literal special tokens, which stay whole; whitespace touching one is dropped, as are
    pieces left empty."""
    parts = [p for p in _NO_SPLIT.split(text) if p]
    for i, part in enumerate(parts):
        if part in NO_SPLIT_TOKENS:
            if i > 0 and parts[i - 1] not in NO_SPLIT_TOKENS:
                parts[i - 1] = parts[i - 1].rstrip()
            if i + 1 < len(parts) and parts[i + 1] not in NO_SPLIT_TOKENS:
                parts[i + 1] = parts[i + 1].lstrip()
    return [p for p in parts if p]


class GLMTokenizer:
    """Texts -> {"input_ids", "attention_mask"} int64 tensors of shape [n, context_length]."""

    def __init__(self, model_file: str | os.PathLike, context_length: int = 52):
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePiece model {model_file} not found (the GLM tokenizer's sp.model)")
        self.model_file, self.context_length = str(model_file), context_length
        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model_file)
        missing = [t for t in NO_SPLIT_TOKENS if self._sp.piece_to_id(t) == self._sp.unk_id()]
        if missing:
            raise ValueError(
                f"SentencePiece model {model_file} lacks the GLM special pieces {missing}: not a GLM tokenizer model"
            )
        self.cls_id = self._sp.piece_to_id("[CLS]")
        self.eos_id = self.pad_id = self._sp.piece_to_id("<|endoftext|>")

    def __getstate__(self) -> dict:  # picklable for DataLoader workers
        return {"model_file": self.model_file, "context_length": self.context_length}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_file"], state["context_length"])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Content ids (no [CLS]/end of text added, no truncation)."""
        ids: list[int] = []
        for part in split_special(text):
            if part in NO_SPLIT_TOKENS:
                ids.append(self._sp.piece_to_id(part))
            else:
                ids.extend(self._sp.encode(encode_whitespaces(part), out_type=int))
        return ids

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        room = self.context_length - 2
        ids = torch.full((len(texts), self.context_length), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, text in enumerate(texts):
            content = self.encode(text)[-room:] if room else []
            sequence = [self.cls_id, *content, self.eos_id]
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        return {"input_ids": ids, "attention_mask": mask}
