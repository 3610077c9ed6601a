"""The GLM tokenizer as a transformers tokenizer, for `AutoTokenizer.from_pretrained(folder,
trust_remote_code=True)`: the rules of `glm_tokenizer.py` (the official ids), with transformers' padding and
truncation set as the official code has them (content truncated from the left, padding on the right with
`<|endoftext|>`). `tokenizer(texts, padding="max_length", truncation=True)` gives what mmpt trained on."""

from __future__ import annotations

import os
import shutil
from typing import ClassVar

from transformers import PreTrainedTokenizer

from .glm_tokenizer import NO_SPLIT_TOKENS, GLMTokenizer


class GLMChineseTokenizer(PreTrainedTokenizer):
    vocab_files_names: ClassVar[dict[str, str]] = {"vocab_file": "sp.model"}
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, context_length: int = 52, **kwargs):
        self.vocab_file = vocab_file
        self.glm = GLMTokenizer(vocab_file, context_length)
        defaults = dict(
            cls_token="[CLS]",
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            mask_token="[MASK]",
            unk_token="[UNK]",
            model_max_length=context_length,
            truncation_side="left",
            padding_side="right",
        )
        super().__init__(context_length=context_length, **{**defaults, **kwargs})

    @property
    def vocab_size(self) -> int:
        return self.glm.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {self.glm._sp.id_to_piece(i): i for i in range(self.glm.vocab_size)}

    def tokenize(self, text: str, **kwargs) -> list[str]:
        """The official pieces (special tokens split off first; see `glm_tokenizer.py`)."""
        return [self.glm._sp.id_to_piece(i) for i in self.glm.encode(text)]

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.tokenize(text)

    def _convert_token_to_id(self, token: str) -> int:
        return self.glm._sp.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.glm._sp.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.glm._sp.decode_pieces([t for t in tokens if t not in NO_SPLIT_TOKENS])

    def build_inputs_with_special_tokens(
        self, token_ids_0: list[int], token_ids_1: list[int] | None = None
    ) -> list[int]:
        if token_ids_1 is not None:
            raise ValueError("the M²-Encoder's tokenizer encodes single texts, not pairs")
        return [self.glm.cls_id, *token_ids_0, self.glm.eos_id]

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "sp.model")
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
