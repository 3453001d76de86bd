"""The tiny presets' SentencePiece model: a toy, like their random weights.

The released checkpoints ship their tokenizer; a tiny preset has none to ship, and without
one a PersonaPlex refuses every text prompt and no model streams text. This one gives the
tiny presets every feature of their family out of the box (text prompts, text output) on a
laptop. Its 64 pieces (the tiny presets' ``text_card``: a sampled id is always a piece) are
trained from :data:`TEXT` and mean nothing. ``toy_tokenizer.model`` beside this file is what
:func:`train` makes (751 bytes); ``python -m duplexserve.engine_bridge.moshi.toy_tokenizer``
writes it again.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

TOY_TOKENIZER = Path(__file__).with_name("toy_tokenizer.model")
PIECES = 64
#: What the pieces are learnt from: persona prompts of the kind PersonaPlex takes, and NVIDIA's wrapping.
TEXT = (
    "You are a wise and friendly teacher. Answer in a clear and engaging way.\n"
    "You enjoy having a good conversation. Every session is a slot of one batched streaming state.\n"
    "Hello from the duplex engine: the user and the model talk at the same time, in frames of eighty "
    "milliseconds.\n"
    "This tokenizer is a toy, made for tiny models with random weights: its pieces mean nothing.\n"
    "<system> You work for a bakery that sells bread, cakes and coffee. Be brief and polite. <system>\n"
)


def train(pieces: int = PIECES, lines: Iterable[str] | None = None) -> bytes:
    """A unigram model of exactly ``pieces`` pieces, ids 0-3 as the released ones (unk, bos, eos,
    pad), no normalisation (which would add a 200 KB table); the same bytes on every run.
    ``lines`` (default :data:`TEXT`) must hold enough distinct text for that many pieces."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines() if lines is None else lines), model_writer=model,
        vocab_size=pieces,
        hard_vocab_limit=True, model_type="unigram", normalization_rule_name="identity", pad_id=3,
        character_coverage=1.0, num_threads=1, minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


if __name__ == "__main__":
    TOY_TOKENIZER.write_bytes(train())
