"""What a model family's reference server does per session beyond ``LMGen.step``.

A released checkpoint is data (its config, read by moshi's loaders) plus a few behaviours
of the server it was released with, keyed here by the checkpoint's ``model_type``; the
batched step reads these, never a model's name. Condition tensors are moshi's own
(``run_inference.get_condition_tensors``: Hibiki's ``description="very_good"``, and
``"very_bad"`` as the negative under classifier-free guidance).
"""

from __future__ import annotations

from dataclasses import dataclass

from duplexserve.engine_bridge.engine import Tail


@dataclass(frozen=True)
class Family:
    model_type: str
    # moshi.server (and hibiki-zero's) resets Mimi after encoding a session's first frame,
    # so its second frame is encoded as if it started the stream (moshi PR #200); LMGen
    # discards the first frame's codes either way.
    first_frame_reset: bool = True
    # After input.end (docs/protocol.md): a dialogue model is stepped on silence for its delay,
    # so the answer to the last frame is heard. A translation model is told the input
    # ended as moshi's run_inference tells Hibiki: one frame whose codes are ``card`` on
    # every input codebook (Mimi does not encode it), then silence until the text stream
    # samples its end of text (``eos_text_id``, the tokenizer's ``eos_id()``).
    ends_on_eos: bool = False
    eos_text_id: int = 2
    # PersonaPlex's server steps a prompt (a voice, silence, its "<system> ... <system>"
    # text, silence: every stream forced) before each session, and its LMGen feeds a
    # user frame to the model one call after it arrives (prompts.py).
    prompted: bool = False

    def tail(self, delay: int) -> Tail:
        if self.ends_on_eos:
            return Tail(until_done=True)
        return Tail(frames=delay + 1 if self.prompted else delay)  # the frame held back


FAMILIES: dict[str, Family] = {
    "moshi": Family("moshi"),
    "hibiki": Family("hibiki", ends_on_eos=True),  # Hibiki and Hibiki-Zero: moshi.server's loop
    # NVIDIA's server: no first-frame rule (the prompt holds the first positions).
    "personaplex": Family("personaplex", first_frame_reset=False, prompted=True),
}


def get_family(model_type: str) -> Family:
    """The family of ``model_type``; an error naming it for one the engine does not serve."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not served by the moshi engine (served: "
            f"{', '.join(FAMILIES)}); docs/moshi-engine.md lists what is not supported yet"
        ) from None
