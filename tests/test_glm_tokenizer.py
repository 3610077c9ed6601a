"""The GLM tokenizer of M²-Encoder: its rules on a SentencePiece model trained here, and the official ids
on the official `sp.model` where MMPT_GLM_SP_MODEL names it (the file ships with the official M²-Encoder
release: `vlmo/tokenizer/sp.model` in alipay/Ant-Multi-Modal-Framework, `prj/M2_Encoder`)."""

import os
import pickle

import pytest
import sentencepiece

from mmpt.eval.retrieval import official_caption_normalization
from mmpt.models.m2_remote.glm_tokenizer import CLS_ID, EOS_ID, GLMTokenizer, encode_whitespaces, split_special

OFFICIAL_SP_MODEL = os.environ.get("MMPT_GLM_SP_MODEL")
needs_official = pytest.mark.skipif(not OFFICIAL_SP_MODEL, reason="set MMPT_GLM_SP_MODEL to the official sp.model")


@pytest.fixture(scope="module")
def small(glm_sp_model):
    return GLMTokenizer(glm_sp_model), sentencepiece.SentencePieceProcessor(model_file=str(glm_sp_model))


def content(tokenizer: GLMTokenizer, text: str) -> list[int]:
    out = tokenizer([text])
    length = int(out["attention_mask"][0].sum())
    ids = out["input_ids"][0].tolist()
    assert ids[0] == tokenizer.cls_id and ids[length - 1] == tokenizer.eos_id
    return ids[1 : length - 1]


def test_literal_special_tokens_stand_alone_and_eat_the_spaces_beside_them(small):
    tokenizer, sp = small
    piece = sp.piece_to_id
    assert content(tokenizer, "[MASK] is here <|endoftext|> [CLS]") == [
        piece("[MASK]"),
        *sp.encode("is here"),
        piece("<|endoftext|>"),
        piece("[CLS]"),
    ]
    # the text beside a special token is encoded on its own (its own dummy prefix), without the touching spaces
    assert content(tokenizer, "a photo [MASK]  of a cat") == [
        *sp.encode("a photo"),
        piece("[MASK]"),
        *sp.encode("of a cat"),
    ]
    assert content(tokenizer, "[CLS][CLS] x") == [piece("[CLS]"), piece("[CLS]"), *sp.encode("x")]
    # spaces not touching a special token become blank pieces as usual
    assert split_special("  leading  [UNK]trailing   ") == ["  leading", "[UNK]", "trailing   "]
    assert content(tokenizer, "  leading  [UNK]trailing   ") == [
        *sp.encode("<|blank_2|>leading"),
        piece("[UNK]"),
        *sp.encode("trailing<|blank_3|>"),
    ]
    # other special spellings are not split out: SentencePiece matches them as its own pieces
    assert split_special("x [SEP] y") == ["x [SEP] y"]
    assert piece("[SEP]") in content(tokenizer, "x [SEP] y")


def test_runs_of_spaces_become_blank_pieces_longest_first(small):
    tokenizer, sp = small
    assert encode_whitespaces("a" + " " * 13 + "b") == "a<|blank_10|><|blank_3|>b"
    assert encode_whitespaces("a" + " " * 21 + "b") == "a<|blank_10|><|blank_10|> b"  # a single space stays
    pieces = [sp.id_to_piece(i) for i in content(tokenizer, "a" + " " * 13 + "b")]
    assert pieces[-3:-1] == ["<|blank_10|>", "<|blank_3|>"] and pieces[-1].endswith("b")


def test_truncation_keeps_the_last_pieces_and_padding_is_end_of_text(small):
    tokenizer, sp = small
    text = " ".join(str(i % 10) for i in range(100))
    full = sp.encode(text)
    assert len(full) > 50
    out = tokenizer([text, "a cat"])
    assert out["input_ids"].shape == (2, 52) and out["input_ids"][0].tolist() == [
        tokenizer.cls_id,
        *full[-50:],
        tokenizer.eos_id,
    ]
    short = [tokenizer.cls_id, *sp.encode("a cat"), tokenizer.eos_id]
    assert out["input_ids"][1].tolist() == short + [tokenizer.eos_id] * (52 - len(short))
    assert out["attention_mask"].sum(1).tolist() == [52, len(short)]
    assert tokenizer.pad_id == tokenizer.eos_id == sp.piece_to_id("<|endoftext|>")


def test_unknown_characters_are_sentencepiece_unk_not_the_unk_token(small):
    tokenizer, sp = small
    ids = content(tokenizer, "€")
    assert 0 in ids and sp.piece_to_id("[UNK]") not in ids


def test_the_official_caption_normalization_and_nfkc(small):
    tokenizer, sp = small
    assert official_caption_normalization("A “Cat” Photo") == 'a "cat" photo'
    assert content(tokenizer, "猫，Ａ") == content(tokenizer, "猫,A")  # NFKC, as the official model normalises


def test_a_model_without_the_glm_pieces_is_refused(tmp_path):
    path = tmp_path / "plain.model"
    with open(path, "wb") as handle:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(["a photo of a cat"] * 20),
            model_writer=handle,
            vocab_size=30,
            hard_vocab_limit=False,
            minloglevel=2,
        )
    with pytest.raises(ValueError, match=r"plain.model lacks the GLM special pieces \['\[CLS\]'"):
        GLMTokenizer(path)


def test_the_tokenizer_crosses_into_loader_workers(small):
    tokenizer, _ = small
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy(["[MASK] a cat"])["input_ids"].tolist() == tokenizer(["[MASK] a cat"])["input_ids"].tolist()


# (text, ids up to the first appended end of text) printed by the official GLMChineseTokenizer
# (transformers 4.17.0, called as the official inference code calls it); the rest is 50000 padding.
OFFICIAL_IDS = [
    ("a photo of a cat", [50002, 778, 51021, 885, 778, 52984, 50000]),
    ("一只猫的照片", [50002, 15955, 44506, 6929, 50000]),
    ("a" + " " * 13 + "b", [50002, 778, 50010, 50017, 43658, 50000]),
    ("[MASK] is here <|endoftext|> [CLS]", [50002, 50003, 2476, 32106, 50000, 50002, 50000]),
    ("a photo [MASK]  of a cat", [50002, 778, 51021, 50003, 885, 778, 52984, 50000]),
    ("  leading  [UNK]trailing   ", [50002, 43358, 50018, 65458, 50004, 64203, 50017, 50000]),
    ("[CLS][CLS] x", [50002, 50002, 50002, 1898, 50000]),
    ("<|endoftext|>", [50002, 50000, 50000]),
    (
        "tab\tand\nnewline [SEP] <|blank_3|> [gMASK]",
        [50002, 53154, 1301, 73887, 43358, 50001, 43358, 50017, 43358, 50007, 50000],
    ),
    ("x [MASK]", [50002, 1898, 50003, 50000]),
    (
        " ".join(str(i) for i in range(200)),
        [
            50002,
            2582,
            11,
            3256,
            11,
            3040,
            11,
            1128,
            11,
            2273,
            11,
            2462,
            11,
            1108,
            11,
            2068,
            21278,
            2383,
            43366,
            2383,
            43372,
            2383,
            43393,
            2383,
            43413,
            32069,
            2383,
            43425,
            2383,
            43445,
            2383,
            43424,
            2383,
            43411,
            148,
            43364,
            148,
            43366,
            148,
            43372,
            148,
            43393,
            148,
            43413,
            148,
            43402,
            148,
            43425,
            27799,
            1892,
            957,
            50000,
        ],
    ),
]


@needs_official
def test_official_sp_model_gives_the_official_ids():
    tokenizer = GLMTokenizer(OFFICIAL_SP_MODEL)
    assert (tokenizer.cls_id, tokenizer.eos_id, tokenizer.vocab_size) == (CLS_ID, EOS_ID, 115244)
    out = tokenizer([text for text, _ in OFFICIAL_IDS])
    for row, (text, expected) in enumerate(OFFICIAL_IDS):
        assert out["input_ids"][row].tolist() == expected + [EOS_ID] * (52 - len(expected)), text
        assert int(out["attention_mask"][row].sum()) == len(expected), text
