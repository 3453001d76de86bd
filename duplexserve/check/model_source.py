"""``duplexserve serve MODEL`` (and ``check MODEL``): a model named as ``vllm serve`` takes one.

MODEL is a local checkpoint folder (one that exists wins) or a Hugging Face repository id,
``OWNER/NAME[@REVISION]``. Either is served by the moshi engine, the family following from the
checkpoint's own config.json (``model_type``, read by the engine as for ``--moshi-weights``
and ``--moshi-hf-repo``, which MODEL sets), and ``--max-sessions`` defaults to ``auto`` (the
memory plan on the GPU; on the CPU auto is refused as it is today: give a number).

Only ``serve`` with a repository id downloads: what the loader reads and the cache lacks
(config.json, the LM and Mimi weights, the tokenizer, a Mimi config or LoRA the config names;
``checkpoint.py``'s ``download``), through huggingface_hub's own download (its progress bar,
its resume of a partial file, ``HF_TOKEN`` for gated repositories). A repository already in the
cache is served without a request to the Hub. The download runs in a child process, as the
preflight's checkpoint reading does, so that the server's own process imports no torch.
``--moshi-hf-repo`` and ``check`` stay offline.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING

from duplexserve.config import AUTO_SESSIONS, GIVEN
from duplexserve.options import environment_set

if TYPE_CHECKING:  # imported where used: the command line imports this module before any engine
    from duplexserve.engine_bridge.moshi.checkpoint import CheckpointSource, FetchError

DEST = "model_source"  # not ``model``: that is --model, the name clients are told


class CannotFetch(Exception):
    """The named repository cannot be brought into the cache: one line, exit 2."""


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """MODEL, listed in the help's "model" group where the options have one (option_table.py)."""
    groups = [g for g in parser._action_groups if g.title == "model"]
    (groups[0] if groups else parser).add_argument(
        DEST, nargs="?", default="", metavar="MODEL",
        help="a checkpoint to serve with the moshi engine: a Hugging Face repository OWNER/NAME[@REVISION] "
        "(serve downloads what the checkpoint reads and the cache lacks) or a local folder laid out like "
        "one; the family follows from its config.json and --max-sessions defaults to auto "
        "(docs/moshi-engine.md, Released checkpoints)",
    )  # fmt: skip


def split(model: str) -> tuple[str, str]:
    """``(hf_repo, weights)`` of MODEL: an existing folder, else ``OWNER/NAME[@REVISION]``."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return "", str(folder)
    repo = model.partition("@")[0]
    if repo.count("/") != 1 or model.startswith(("/", ".", "~")) or "" in repo.split("/") or folder.exists():
        raise ValueError(f"MODEL {model!r} is neither a checkpoint folder nor a Hugging Face repository "
                         "OWNER/NAME[@REVISION]")
    return model, ""


def apply(args: argparse.Namespace) -> None:
    """Turn MODEL, if given, into the settings it stands for; ValueError for what contradicts it.
    A setting counts as given on the command line (its flag) or in a non-empty variable, as
    options.py counts it."""
    model = getattr(args, DEST, "")
    if not model:
        return
    given = getattr(args, GIVEN, set()) | environment_set()
    if "engine" in given and args.engine != "moshi":
        raise ValueError(f"MODEL {model} is served by the moshi engine, not --engine {args.engine}"
                         + ("; vLLM-Omni's model is --vllm-omni-model" if args.engine == "vllm-omni" else ""))
    if args.moshi_hf_repo or args.moshi_weights:
        raise ValueError(f"MODEL {model} and --moshi-hf-repo/--moshi-weights both name a checkpoint: "
                         "give one")
    args.moshi_hf_repo, args.moshi_weights = split(model)
    args.engine = "moshi"
    if "max_sessions" not in given:
        args.max_sessions = AUTO_SESSIONS


def fetch(args: argparse.Namespace) -> None:
    """Bring the files of MODEL, a repository, into the Hugging Face cache; CannotFetch says why not."""
    model = getattr(args, DEST, "")
    if not model or not args.moshi_hf_repo:
        return
    from duplexserve.engine_bridge.moshi.checkpoint import CheckpointSource

    source = CheckpointSource(
        args.moshi_hf_repo, "", args.moshi_config, args.moshi_lora, args.moshi_tokenizer
    )
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        try:
            line = pool.submit(fetch_here, source).result()
        except BrokenProcessPool as exc:
            raise CannotFetch(f"downloading {model} failed: the process downloading it died ({exc})") from exc
    if line:
        raise CannotFetch(line)


def fetch_here(source: CheckpointSource) -> str:
    """In the child: download what is missing; the line saying why that failed, or ``""``. Any
    other problem of the checkpoint is left to the preflight, which says it as for the flags."""
    from huggingface_hub.utils import logging as hf_logging

    from duplexserve.engine_bridge.moshi.checkpoint import FetchError, resolve_checkpoint

    # Its retries on a network error (5, over some 20 s) are kept, their warnings not: the
    # failure is one line. Its progress bars show all the same (on a terminal, as tqdm does).
    hf_logging.set_verbosity_error()
    try:
        resolve_checkpoint(source, download=True)
    except FetchError as exc:
        return fetch_error_line(exc)
    except Exception:  # a bad config, a missing override: the preflight's to say, in its words
        return ""
    return ""


def fetch_error_line(exc: FetchError) -> str:
    """huggingface_hub's error as one line with what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    named = exc.repo + (f"@{exc.revision}" if exc.revision else "")
    cause = exc.cause
    if isinstance(cause, GatedRepoError):
        token = "the HF_TOKEN set has no access" if os.environ.get("HF_TOKEN") else "HF_TOKEN is not set"
        return (f"{exc.repo} is gated ({token}): accept its terms on https://huggingface.co/{exc.repo} "
                "with your account, then set HF_TOKEN to a token of that account "
                "(https://huggingface.co/settings/tokens)")
    if isinstance(cause, RepositoryNotFoundError):  # 401 and 404: the Hub does not say which
        return (f"{exc.repo} is not on the Hugging Face Hub, or is private: check the name, or set HF_TOKEN "
                "to a token with access to it")
    if isinstance(cause, RevisionNotFoundError):
        return f"{exc.repo} has no revision {exc.revision!r}: name a branch, tag or commit of it after @"
    if isinstance(cause, (LocalEntryNotFoundError, ConnectionError)):
        why = ("HF_HUB_OFFLINE=1 forbids downloading" if constants.HF_HUB_OFFLINE
               else f"the Hub ({constants.ENDPOINT}) cannot be reached")
        revision = f" --revision {exc.revision}" if exc.revision else ""
        return (f"{exc.filename} of {named} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                f"{why}: fetch it once with the network on, with `duplexserve serve {named}` (what the "
                f"checkpoint reads) or `huggingface-cli download {exc.repo}{revision}` (the whole "
                "repository)")
    if isinstance(cause, EntryNotFoundError):
        fix = ("not a checkpoint the moshi engine reads, or give its config with --moshi-config FILE"
               if exc.filename == "config.json" else "its config.json names a file the repository lacks")
        return f"{named} has no file {exc.filename}: {fix}"
    return f"downloading {exc.filename} of {named} failed: {type(cause).__name__}: {cause}"
