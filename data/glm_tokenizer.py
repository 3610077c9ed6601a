"""The official M²-Encoder text tokenizer (GLM-10B-Chinese SentencePiece), re-implemented.

Sequence format: `[CLS] pieces <|endoftext|>`, 52 ids, content truncated from the *left* (the last
50 pieces are kept), right-padded with id 50000 (`<|endoftext|>`), attention mask 0 on padding.
Runs of 2-10 spaces become `<|blank_n|>` pieces first. Characters outside the vocabulary map to
0 (`<unk>`), as in the official tokenizer.
"""

from __future__ import annotations

import os
import re

import sentencepiece
import torch

CLS_ID = 50002
EOS_ID = PAD_ID = 50000
_BLANKS = re.compile(r" {2,}")


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


class GLMTokenizer:
    """Texts -> {"input_ids", "attention_mask"} int64 tensors of shape [n, context_length]."""

    def __init__(self, model_file: str | os.PathLike, context_length: int = 52):
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePiece model {model_file} not found (the GLM tokenizer's sp.model)")
        self.model_file, self.context_length = str(model_file), context_length
        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model_file)

    def __getstate__(self) -> dict:  # picklable for DataLoader workers
        return {"model_file": self.model_file, "context_length": self.context_length}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_file"], state["context_length"])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Content ids (no specials, no truncation)."""
        return self._sp.encode(encode_whitespaces(text), out_type=int)

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        room = self.context_length - 2
        ids = torch.full((len(texts), self.context_length), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, text in enumerate(texts):
            content = self.encode(text)[-room:] if room else []
            sequence = [CLS_ID, *content, EOS_ID]
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        return {"input_ids": ids, "attention_mask": mask}
