"""The memory plan of these options: the weights, the KV ring of a slot, the slots that fit.

The weights are counted on the model built on torch's meta device from the resolved
config, in the dtype the engine would load it in: exact for whatever moshi builds from
that config (grouped KV heads, per-step depformer weights, conditioners), with no
parameter formula to keep in step with moshi's modules, no memory used, and a few
seconds for a 7B. That needs torch and moshi, which serving needs anyway. The KV ring
comes from the config (``memory.kv_bytes_per_slot``, as the engine computes it), the
rest of a slot and the reserve are ``memory.py``'s: the plan the engine checks before it
allocates, made before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from duplexserve.check.model import Model
from duplexserve.config import AUTO_SESSIONS, ServerConfig
from duplexserve.engine_bridge.moshi.families import get_family
from duplexserve.engine_bridge.moshi.memory import MemoryPlan, Paging, fixed_bytes, kv_bytes_per_slot

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
#: What loading leaves on the GPU beyond the weights (the allocator's rounding of a thousand
#: tensors, the step's device buffers). ``--max-sessions auto`` keeps it free so that the
#: engine's own check, made after loading, agrees; an allowance, not measured on a GPU.
LOAD_SLACK = 512 * 2**20


@dataclass(frozen=True)
class Weights:
    lm: int  # bytes, parameters and buffers
    mimi: int
    dtype: str  # the LM's; Mimi is float32 (float64 with --moshi-dtype float64)

    @property
    def total(self) -> int:
        return self.lm + self.mimi


def lm_dtype(config: ServerConfig, on_gpu: bool) -> str:
    """``--moshi-dtype`` as the engine resolves it: auto is bfloat16 on a GPU, float32 on the CPU."""
    if config.moshi_dtype != "auto":
        return config.moshi_dtype
    return "bfloat16" if on_gpu else "float32"


def kv_per_slot(config: ServerConfig, model: Model, dtype: str) -> int:
    """Bytes of LM KV ring a slot holds, as the engine counts them (stock attention keeps it in the
    model's dtype; classifier-free guidance gives each session two rows)."""
    lm = model.lm
    kv_dtype = config.moshi_kv_dtype if config.moshi_attention == "live" else "bf16"
    return kv_bytes_per_slot(lm["num_layers"], lm["dim"], lm["num_heads"], lm["context"], kv_dtype,
                             DTYPE_BYTES[dtype], lm.get("kv_repeat", 1),
                             branches=1 if config.moshi_cfg_coef == 1.0 else 2)


def paging(config: ServerConfig, model: Model, kv: int) -> Paging | None:
    """Paged KV's sizes where the engine would page (``MoshiEngine._paged_kv``: live attention, no
    prompt prefill, no guidance), from ``kv``, a full context's bytes a slot; else None (a ring)."""
    if (
        config.moshi_kv_layout != "paged" or config.moshi_attention != "live"
        or get_family(model.model_type).prompted or config.moshi_cfg_coef != 1.0
    ):  # fmt: skip
        return None
    return Paging.of(kv, model.lm["context"], config.moshi_kv_floor_s)


def weight_bytes(model: Model, dtype: str) -> Weights:
    """The model's parameters and buffers, built on the meta device (imports torch and moshi).

    A LoRA adapter is fused at load, so the LM counts as its base (the LoRA keys left out).
    """
    import torch
    from moshi.models import loaders

    kwargs = {k: v for k, v in model.lm.items() if k not in ("lora", "lora_rank", "lora_scaling")}
    lm = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="meta", dtype=getattr(torch, dtype))
    mimi = loaders.get_mimi(None, model.mimi, device="meta", num_codebooks=model.codebooks)
    if dtype == "float64":
        mimi = mimi.double()
    with torch.no_grad():  # the codebooks cache their embeddings on first use, as in the engine
        mimi.encode(torch.zeros(1, 1, mimi.frame_size, device="meta", dtype=next(mimi.parameters()).dtype))
    return Weights(_bytes(lm), _bytes(mimi), dtype)


def plan(config: ServerConfig, model: Model, free: int, on_gpu: bool) -> tuple[Weights, MemoryPlan]:
    """``--max-sessions`` slots against ``free`` bytes less the weights (auto: the slots that fit)."""
    dtype = lm_dtype(config, on_gpu)
    weights = weight_bytes(model, dtype)
    label = "int8" if config.moshi_kv_dtype == "int8" and config.moshi_attention == "live" else dtype
    kv = kv_per_slot(config, model, dtype)
    fixed = fixed_bytes(get_family(model.model_type).prompted, config.prompt_cache_mb * 2**20, kv)
    paged = paging(config, model, kv)
    if paged is not None:  # a slot reserves its floor's pages; the pool is the rest (memory.py)
        kv = paged.floor_pages * paged.page_bytes
    memory = MemoryPlan(config.max_sessions, label, kv, free - weights.total, fixed, paged)
    if config.max_sessions == AUTO_SESSIONS:
        memory = dataclasses.replace(memory, slots=auto_slots(memory))
    return weights, memory


def auto_slots(memory: MemoryPlan) -> int:
    """What ``--max-sessions auto`` takes: the slots that fit with :data:`LOAD_SLACK` kept free."""
    return dataclasses.replace(memory, free=memory.free - LOAD_SLACK).max_slots


def auto_plan(config: ServerConfig, model: Model) -> MemoryPlan | str:
    """``--max-sessions auto`` on the GPU the engine would use, or why there is none (imports torch)."""
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no GPU to size the slots by"
    device = torch.device("cuda" if config.device == "auto" else config.device)
    free = torch.cuda.mem_get_info(device)[0]
    return plan(dataclasses.replace(config, max_sessions=AUTO_SESSIONS), model, free, True)[1]


def _bytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))
