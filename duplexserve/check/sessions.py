"""The sessions a model takes that these options would refuse, found before serving.

PersonaPlex takes a text prompt and a voice: without a tokenizer every text prompt is
refused (``invalid_prompt``, 1007), without ``--voice-prompt-dir`` every voice
(``voice_not_found``, 1008), and a session finds that out only when it opens. Any model
without a tokenizer streams no text. ``serve`` starts all the same (each is a warning),
so ``duplexserve check`` says it.
"""

from __future__ import annotations

from pathlib import Path

from duplexserve.check.model import Model
from duplexserve.check.requirements import Problem
from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.moshi.families import get_family
from duplexserve.engine_bridge.moshi.prompts import VOICE_SUFFIXES

TOKENIZER_FIX = "pass --moshi-tokenizer, a SentencePiece model (the released ones: tokenizer_spm_32k_3.model)"
VOICES_FIX = "pass --voice-prompt-dir, a folder of voice prompts (NVIDIA's voices.tgz .pt files, or .wav)"


def session_problems(config: ServerConfig, model: Model) -> list[Problem]:
    """Each kind of session ``model`` supports that ``config`` would refuse, or degrade."""
    prompted = get_family(model.model_type).prompted
    problems = []
    if not model.tokenizer:
        what = "no tokenizer: sessions get no text (text.delta)"
        if prompted:
            what += " and every text prompt is refused (invalid_prompt, 1007)"
        problems.append(Problem(what, TOKENIZER_FIX, fatal=False))
    folder = config.voice_prompt_dir
    if folder and not prompted:
        what = f"--voice-prompt-dir is ignored: a {model.model_type} model takes no prompt"
        problems.append(Problem(what, "leave it out", fatal=False))
    elif prompted and not folder:
        what = "no voices: every voice prompt is refused (voice_not_found, 1008) and GET /v1/voices is empty"
        problems.append(Problem(what, VOICES_FIX, fatal=False))
    elif prompted and not Path(folder).is_dir():
        what = f"--voice-prompt-dir {folder} is not a folder: the engine would not start"
        problems.append(Problem(what, VOICES_FIX))
    elif prompted and not any(p.suffix in VOICE_SUFFIXES and p.is_file() for p in Path(folder).iterdir()):
        what = f"--voice-prompt-dir {folder} holds no voice ({', '.join(VOICE_SUFFIXES)}): every voice " \
               "prompt is refused (voice_not_found, 1008)"
        problems.append(Problem(what, VOICES_FIX, fatal=False))
    return problems
