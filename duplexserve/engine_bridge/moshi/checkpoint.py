"""Where the moshi engine's checkpoint comes from: moshi's own ``CheckpointInfo``, offline.

config.json is read by moshi's ``CheckpointInfo.from_hf_repo``, exactly as ``moshi.server``
reads it (file names, ``model_type``, ``lm_gen_config``, LoRA, a Mimi config); this module
only says where each file it names lies: in a local folder (``--moshi-weights``) or in the
local Hugging Face cache (``--moshi-hf-repo``, never a download). It swaps the loader's
``hf_hub_download`` for that lookup while ``from_hf_repo`` runs, so every file the
config names, a LoRA file or Mimi config included, is found the way moshi finds it.
With ``download`` (``duplexserve serve OWNER/NAME``, check/model_source.py) a file missing
from the cache is fetched into it by huggingface_hub, so exactly the files the loader
reads are downloaded, never the whole repository; a failure is a :class:`FetchError`.

PersonaPlex's config.json names only its ``model_type`` and a version: its architecture
lives in the loader of NVIDIA's server (Moshi 7B with 16 depformer steps), so a stub
config of a known ``model_type`` takes that architecture here (``_STUB_ARCHITECTURES``).

One of moshi's readings is not kept: offline, a config.json missing from the cache
raises ``LocalEntryNotFoundError``, a kind of the ``EntryNotFoundError`` moshi takes for
a legacy repository, and it silently builds a Moshi 7B. Here only the repositories known
to ship no config.json (``kyutai/moshiko-*``, ``kyutai/moshika-*``) take that path; any
other missing config.json is an error that names it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duplexserve.engine_bridge.moshi.families import get_family

if TYPE_CHECKING:
    from moshi.models.loaders import CheckpointInfo

    from duplexserve.config import ServerConfig
    from duplexserve.engine_bridge.moshi.presets import Preset

# Released without config.json, so moshi builds them from its own _lm_kwargs (checkpoints.md, 1).
_NO_CONFIG = ("moshiko-", "moshika-")
# Released with a stub config.json: model_type -> the preset holding its architecture.
_STUB_ARCHITECTURES = {"personaplex": "personaplex-7b"}


@dataclass(frozen=True)
class CheckpointSource:
    """The checkpoint settings (``--moshi-hf-repo`` or ``--moshi-weights``, and overrides)."""

    hf_repo: str = ""  # OWNER/NAME[@REVISION], from the local Hugging Face cache
    weights: str = ""  # a local folder laid out like the repository (or a cache snapshot)
    config: str = ""  # replaces the checkpoint's config.json (moshi's --config-path)
    lora: str = ""  # a LoRA adapter, fused at load (moshi's --lora-weight)
    tokenizer: str = ""  # replaces the checkpoint's SentencePiece model
    preset: str = ""  # a stub config's architecture, when this preset is of its model_type

    @classmethod
    def from_config(cls, config: ServerConfig) -> CheckpointSource:
        return cls(
            config.moshi_hf_repo, config.moshi_weights, config.moshi_config, config.moshi_lora,
            config.moshi_tokenizer, config.moshi_preset,
        )  # fmt: skip

    @property
    def given(self) -> bool:
        """True when a checkpoint is named; otherwise the engine serves a preset."""
        return bool(self.hf_repo or self.weights)


class FetchError(Exception):
    """Downloading a file of the checkpoint failed; ``cause`` is huggingface_hub's error. Not an
    ``EntryNotFoundError``: moshi would take a missing config.json for a legacy repository."""

    def __init__(self, repo: str, filename: str, revision: str | None, cause: Exception) -> None:
        super().__init__(f"{filename} of {repo}@{revision or 'main'}: {type(cause).__name__}: {cause}")
        self.repo, self.filename, self.revision, self.cause = repo, filename, revision, cause


def resolve_checkpoint(source: CheckpointSource, download: bool = False) -> CheckpointInfo:
    """moshi's ``CheckpointInfo`` of ``source``, every file found on disk; loads no weights.

    Raises ``FileNotFoundError`` naming the first missing file, ``ValueError`` for settings
    that do not go together or a checkpoint the engine does not serve. ``download``: a file
    of ``source.hf_repo`` missing from the cache is downloaded into it (``FetchError``).
    """
    if not download:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported
    from moshi.models import loaders

    if bool(source.hf_repo) == bool(source.weights):
        raise ValueError("name one checkpoint: --moshi-hf-repo OWNER/NAME[@REVISION] or --moshi-weights DIR")
    if source.weights:
        folder = Path(source.weights)
        if not folder.is_dir():
            raise FileNotFoundError(f"moshi weights folder {folder} does not exist")
        repo, revision = str(folder), None
    else:
        folder = None
        repo, _, rev = source.hf_repo.partition("@")
        revision = rev or None
        if repo.count("/") != 1:
            raise ValueError(f"--moshi-hf-repo {source.hf_repo!r}: OWNER/NAME[@REVISION]")
    config = _local(source.config) if source.config else None
    lora = _local(source.lora) if source.lora else None
    tokenizer = _local(source.tokenizer) if source.tokenizer else None
    no_config = _ships_no_config(repo, folder)
    with _files_from(_Files(folder, no_config=no_config, download=download)), warnings.catch_warnings():
        if no_config:  # moshi's warning that it takes the Moshi 7B defaults: right for these, and noise
            warnings.filterwarnings("ignore", "Repository .* contains no config.json", UserWarning)
        info = loaders.CheckpointInfo.from_hf_repo(
            repo, tokenizer=tokenizer, config_path=config, lora_weights=lora, revision=revision
        )
    get_family(info.model_type)  # refuses a family the engine does not serve, by name
    _fill_stub_architecture(info, source.preset)
    wants_lora = bool((info.lm_config or {}).get("lora"))
    if wants_lora != (info.lora_weights is not None):
        raise ValueError(
            f'{source.lora or "the config"}: a LoRA adapter needs a config with "lora": true '
            "(moshi-finetune's consolidated/config.json, through --moshi-config) and the adapter "
            "(--moshi-lora, or the config's lora_name); one came without the other"
        )
    return info


def _fill_stub_architecture(info: CheckpointInfo, preset_name: str) -> None:
    """A config.json of a known ``model_type`` without architecture keys (PersonaPlex's
    ``{"model_type": "personaplex", "version": "7b-v1"}``) gets the architecture its own
    server's loader builds, or ``--moshi-preset``'s where that preset is of the same
    ``model_type`` (``tiny-personaplex`` in the tests); keys it does give are kept."""
    from duplexserve.engine_bridge.moshi.presets import PRESETS

    given = dict(info.lm_config or {})
    if info.model_type not in _STUB_ARCHITECTURES or "dim" in given:
        return
    preset = PRESETS.get(preset_name)
    if preset is None or preset.model_type != info.model_type:
        preset = PRESETS[_STUB_ARCHITECTURES[info.model_type]]
    given.pop("version", None)
    info.lm_config = {**preset.lm, **given}
    info.lm_gen_config = info.lm_gen_config or dict(preset.lm_gen_config)
    info.mimi_config = info.mimi_config or dict(preset.mimi)


def preset_checkpoint(preset: Preset) -> CheckpointInfo:
    """A preset as moshi's ``CheckpointInfo`` without files: built with random weights."""
    import copy

    from moshi.models.loaders import CheckpointInfo

    no_file: Any = None  # get_mimi(None) and get_moshi(load_weight=False) build random modules
    return CheckpointInfo(
        no_file, no_file, no_file, copy.deepcopy(preset.lm), None, copy.deepcopy(preset.mimi),
        preset.model_type, lm_gen_config=dict(preset.lm_gen_config),
    )  # fmt: skip


def _ships_no_config(repo: str, folder: Path | None) -> bool:
    """The repository, its Hugging Face cache folder or a folder named after it."""
    if folder is None:
        return repo.startswith(tuple(f"kyutai/{name}" for name in _NO_CONFIG))
    path = folder.resolve()
    return path.name.startswith(_NO_CONFIG) or any(f"models--kyutai--{n}" in str(path) for n in _NO_CONFIG)


def _local(path: str) -> Path:
    found = Path(path.removeprefix("file://"))
    if not found.is_file():
        raise FileNotFoundError(f"moshi checkpoint: {found} not found")
    return found


class _Files:
    """moshi's ``hf_hub_download(repo, filename, revision)``, answered from disk (``download``:
    a file missing from the cache is downloaded, the cache asked first so that a repository
    already there is served without a request to the Hub)."""

    def __init__(self, folder: Path | None, no_config: bool, download: bool = False) -> None:
        self.folder = folder
        self.no_config = no_config  # a repository released without config.json
        self.download = download

    def __call__(self, repo_id: str, filename: str, revision: str | None = None, **_: Any) -> str:
        if self.folder is not None and repo_id == str(self.folder):
            path = self.folder / filename
            if path.is_file():
                return str(path)
            where = f"{path} not found"
        else:
            from huggingface_hub import constants, hf_hub_download
            from huggingface_hub.errors import LocalEntryNotFoundError

            try:
                return hf_hub_download(repo_id, filename, revision=revision, local_files_only=True)
            except LocalEntryNotFoundError:
                if self.download and not (filename == "config.json" and self.no_config):
                    try:  # huggingface_hub's own download: its progress bar, resumed, HF_TOKEN
                        return hf_hub_download(repo_id, filename, revision=revision)
                    except Exception as exc:  # whichever the hub's error, one kind moshi lets through
                        raise FetchError(repo_id, filename, revision, exc) from exc
                where = (
                    f"{filename} of {repo_id}@{revision or 'main'} is not in the local Hugging Face "
                    f"cache ({constants.HF_HUB_CACHE}); nothing is downloaded"
                )
        if filename == "config.json":
            if self.no_config:
                from huggingface_hub.errors import LocalEntryNotFoundError

                raise LocalEntryNotFoundError(where)  # moshi's legacy path: the Moshi 7B defaults
            raise FileNotFoundError(
                f"moshi checkpoint: {where}; only kyutai/moshiko-* and kyutai/moshika-* ship none "
                "(moshi would take any other for a Moshi 7B): give the config with --moshi-config FILE"
            )
        raise FileNotFoundError(f"moshi checkpoint: {where}")


@contextlib.contextmanager
def _files_from(files: Callable[..., str]) -> Iterator[None]:
    from moshi.models import loaders

    saved = loaders.hf_hub_download
    loaders.hf_hub_download = files
    try:
        yield
    finally:
        loaders.hf_hub_download = saved
