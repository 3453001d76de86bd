"""The tiny presets' toy tokenizer: the shipped file is what its code makes, every id a tiny LM
samples is one of its pieces, and the engine is given it where nothing else is named."""

from __future__ import annotations

import pytest

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.moshi.presets import PRESETS, served_tokenizer
from duplexserve.engine_bridge.moshi.toy_tokenizer import TOY_TOKENIZER, train

sentencepiece = pytest.importorskip("sentencepiece")


def test_the_shipped_model_is_the_trained_one_with_a_piece_per_text_id():
    assert TOY_TOKENIZER.read_bytes() == train()
    toy = sentencepiece.SentencePieceProcessor(model_file=str(TOY_TOKENIZER))
    tiny = {name: p for name, p in PRESETS.items() if name.startswith("tiny")}
    assert tiny and all(p.tokenizer == str(TOY_TOKENIZER) for p in tiny.values())
    assert {p.lm["text_card"] for p in tiny.values()} == {toy.get_piece_size()}
    assert [toy.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert toy.decode(toy.encode("<system> You enjoy a good conversation. <system>")) == \
        "<system> You enjoy a good conversation. <system>"


def test_the_engine_gets_the_presets_unless_told_otherwise():
    toy = str(TOY_TOKENIZER)
    assert served_tokenizer(ServerConfig(engine="moshi", moshi_preset="tiny-personaplex")) == toy
    assert served_tokenizer(ServerConfig(engine="moshi", moshi_preset="personaplex-7b")) == ""
    assert served_tokenizer(ServerConfig(engine="moshi", moshi_tokenizer="/x/spm.model")) == "/x/spm.model"
    assert served_tokenizer(ServerConfig(engine="moshi", moshi_hf_repo="nvidia/personaplex-7b-v1")) == ""
