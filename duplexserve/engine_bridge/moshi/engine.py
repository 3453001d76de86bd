"""The real engine: Kyutai's Mimi codec and multistream LM, one batched streaming state.

Every session is a slot of one ``streaming_forever(num_slots)`` state of Mimi and of
``LMGen``; a step runs Mimi encode, one LM step and Mimi decode over all slots at once,
always at the full batch size so that the shapes never change and the library's CUDA
graphs replay. Slots without a frame this step are masked by the exec mask (one device
tensor that every streaming state reads; their state does not move); a slot is reset
with ``reset_streaming(mask)`` when a session opens in it, so nothing of the previous
occupant survives. The LM's temporal attention reads each row's live prefix of its KV
only (``live_lm.py``), optionally in 8 bits; the KV is a ring a slot by default, or paged
(``paged_kv.py``: a call takes pages as it ages, a slot reserves only its floor), and is sized
against the GPU's free memory before it is allocated (``memory.py``).

The LM answers with a delay (``max(delays)`` frames: 1 for Moshi, 2 for Hibiki). With
``support_out_of_sync`` each slot keeps its own clock, and the rows still inside
their delay come back as "ungenerated": those rows get silence and their Mimi
decoder does not run, so input frame i is always answered by output frame i and the
model's first real audio is output frame ``delay_frames``.

torch and moshi are imported in ``start()``, on the engine thread, so the server
imports neither unless this engine is chosen.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.engine import Engine, MoveRefused, PromptError, StepResult
from duplexserve.engine_bridge.moshi.capture_plan import CapturePlan
from duplexserve.engine_bridge.moshi.checkpoint import CheckpointSource, preset_checkpoint, resolve_checkpoint
from duplexserve.engine_bridge.moshi.families import get_family
from duplexserve.engine_bridge.moshi.memory import (
    FRAME_HZ,
    OTHER_PER_SLOT,
    MemoryPlan,
    Paging,
    fixed_bytes,
    kv_bytes_per_slot,
    page_frames,
)
from duplexserve.engine_bridge.moshi.presets import MOSHI_7B_LM, get_preset
from duplexserve.engine_bridge.moshi.prompts import (
    Prompt,
    StreamLayout,
    load_voices,
    prompt_frames,
    wrap_system,
)

log = logging.getLogger(__name__)
#: A step longer than a frame (and twice the mean) makes every live session's answer late past a
#: one-frame playback buffer: it is logged with what it did.
SLOW_STEP_S = 0.08
#: A bucket's warm-up calls (``_warm_bucket``): eager, captured, replayed.
WARM_CALLS = 3
#: What ``start()`` imports: a spare engine process imports them before it waits
#: (process_engine.py), so that a restart does not (torch and Triton alone take seconds).
START_IMPORTS = (
    "torch",
    "moshi.models",
    "moshi.run_inference",
    "moshi.utils.compile",
    "duplexserve.engine_bridge.moshi.fused_norm",
    "duplexserve.engine_bridge.moshi.fused_pointwise",
    "duplexserve.engine_bridge.moshi.lean_depformer",
    "duplexserve.engine_bridge.moshi.live_lm",
    "duplexserve.engine_bridge.moshi.live_mimi",
    "duplexserve.engine_bridge.moshi.mimi_convs",
    "duplexserve.engine_bridge.moshi.prefill",
    "duplexserve.engine_bridge.moshi.row_buckets",
    "duplexserve.engine_bridge.moshi.row_reset",
    "duplexserve.engine_bridge.moshi.user_steps",
)
#: torch.compile's, imported too with ``--moshi-compile on``: on an H100 they moved 8 s out of
#: the lm phase into the spare's imports.
COMPILE_IMPORTS = ("torch._dynamo", "torch._inductor.compile_fx")


@dataclass(frozen=True)
class Sampling:
    """LMGen's sampling; one setting for the whole batch (the library samples batched).

    A value left None is the checkpoint's ``lm_gen_config``, else LMGen's default
    (0.8, 0.7, 250, 25), as ``moshi.server`` samples it.
    """

    greedy: bool = False
    temp: float | None = None
    temp_text: float | None = None
    top_k: int | None = None
    top_k_text: int | None = None

    def lm_gen_kwargs(self, lm_gen_config: dict[str, Any]) -> dict[str, Any]:
        given = {k: v for k, v in vars(self).items() if k != "greedy" and v is not None}
        return {**lm_gen_config, **given, "use_sampling": not self.greedy}


class MoshiEngine(Engine):
    name = "moshi"

    def __init__(
        self,
        num_slots: int,
        preset: str = "tiny",
        weights: str = "",
        tokenizer: str = "",
        hf_repo: str = "",
        config: str = "",
        lora: str = "",
        cfg_coef: float = 1.0,
        device: str = "auto",
        dtype: str = "auto",
        context: int = 0,
        sampling: Sampling | None = None,
        seed: int = 0,
        voice_dir: str = "",
        prompt_cache_mb: int = 1024,
        threads: int = 0,
        cuda_graphs: bool = True,
        warm_rows: int = 0,
        compile: str = "off",
        attention: str = "live",
        kv_dtype: str = "bf16",
        depformer: str = "lean",
        mimi_attention: str = "live",
        fp32_matmul: str = "float32",
        mimi_graph: str = "whole",
        mimi_convs: str = "fused",
        kv_layout: str = "ring",
        kv_floor_s: float = 60.0,
        kv_page: int = 0,
        kv_pages: int = 0,
    ) -> None:
        super().__init__(num_slots)
        source = CheckpointSource(hf_repo, weights, config, lora, tokenizer, preset)
        self.preset = None if source.given else get_preset(preset)
        self.checkpoint = resolve_checkpoint(source) if source.given else None  # moshi's CheckpointInfo
        self.source = source
        self.model_type = self.preset.model_type if self.preset else self.checkpoint.model_type  # type: ignore[union-attr]
        self.family = get_family(self.model_type)
        self.tokenizer_path = tokenizer or (self.checkpoint.tokenizer if self.checkpoint else None)
        self.cfg_coef = cfg_coef
        self.device_name = device
        self.dtype_name = dtype
        self.context = context
        self.sampling = sampling or Sampling()
        self.seed = seed
        self.voice_dir = voice_dir
        self._voices: dict[str, Any] = {}  # name -> prompts.Voice (prompted families)
        # Prompts seen, newest last: the ring prefix their prefill left, written into the row
        # of the next session with the same prompt instead of running it again.
        self._prompt_cache: collections.OrderedDict[tuple[str, str], list[Any]] = collections.OrderedDict()
        self.prompt_cache_bytes = prompt_cache_mb * 2**20
        self.threads = threads
        self.cuda_graphs = cuda_graphs
        self.warm_rows = warm_rows
        if compile not in ("on", "off"):
            raise ValueError(f"--moshi-compile {compile!r}: on or off")
        self.compile = compile
        self._capture = CapturePlan([num_slots], graphed=False)  # which buckets are captured (start())
        self.attention = attention
        self.kv_dtype = kv_dtype
        if depformer not in ("stock", "lean"):
            raise ValueError(f"--moshi-depformer {depformer!r}: stock or lean")
        self.depformer = depformer
        if mimi_attention not in ("stock", "live"):
            raise ValueError(f"--moshi-mimi-attention {mimi_attention!r}: stock or live")
        self.mimi_attention = mimi_attention
        if fp32_matmul not in ("float32", "tf32"):
            raise ValueError(f"--moshi-fp32-matmul {fp32_matmul!r}: float32 or tf32")
        self.fp32_matmul = fp32_matmul
        if mimi_graph not in ("parts", "whole"):
            raise ValueError(f"--moshi-mimi-graph {mimi_graph!r}: parts or whole")
        self.mimi_graph = mimi_graph
        if mimi_convs not in ("stock", "fused", "fused-cl"):
            raise ValueError(f"--moshi-mimi-convs {mimi_convs!r}: stock, fused or fused-cl")
        self.mimi_convs = mimi_convs
        if kv_dtype != "bf16" and attention != "live":
            raise ValueError(f"--moshi-kv-dtype {kv_dtype} needs --moshi-attention live")
        if kv_layout not in ("paged", "ring"):
            raise ValueError(f"--moshi-kv-layout {kv_layout!r}: paged or ring")
        if not kv_floor_s > 0:
            raise ValueError(f"--moshi-kv-floor-s {kv_floor_s}: a number of seconds above 0")
        self.kv_layout = kv_layout  # what was asked; ``self.paged`` says what runs (start())
        self.kv_floor_s = kv_floor_s
        self.kv_page = kv_page  # frames a page (0: memory.page_frames, the kernel's chunk; tests: a few)
        self.kv_pages = kv_pages  # pages of the pool (0: from memory, else every slot's full context)
        self.paged = False
        self.pages: Any = None  # paged_kv.PageTable
        lm_config = self.preset.lm if self.preset else self.checkpoint.lm_config  # type: ignore[union-attr]
        self.delay_frames = max((lm_config or MOSHI_7B_LM)["delays"])
        if cfg_coef != 1.0 and not (lm_config or {}).get("fuser"):
            raise ValueError(f"--moshi-cfg-coef {cfg_coef}: this LM has no conditioning to guide")
        self._steps = np.zeros(num_slots, dtype=np.int64)  # frames stepped since open, per slot
        self.timings = {"steps": 0, "step_s": 0.0, "host_s": 0.0}
        self.memory_in_use = (0, 0)  # bytes: the device's once started (a GPU's), its rings' part
        self._prompts_since_step = [0, 0]  # new (a forward), cached (a copy)
        self._move_identity: dict[str, Any] | None = None  # what a moved slot's state must match
        self._warming = False  # warm-up's steps compile and capture: slow on purpose, before ready
        #: Where the start went, in order (seconds): the log prints it, ``check`` and the
        #: start-time benchmark read it (docs/moshi-engine.md, "Start-up").
        self.start_phases: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the library may never reach a hub
        if not self.cuda_graphs:
            os.environ["NO_CUDA_GRAPH"] = "1"
        import torch
        from moshi.models import LMGen
        from moshi.utils.compile import no_compile

        from duplexserve.engine_bridge.moshi.fused_norm import install_fused_norms
        from duplexserve.engine_bridge.moshi.fused_pointwise import install_fused_pointwise
        from duplexserve.engine_bridge.moshi.lean_depformer import install_lean_depformer
        from duplexserve.engine_bridge.moshi.live_attention import triton_available
        from duplexserve.engine_bridge.moshi.live_lm import install_live_attention
        from duplexserve.engine_bridge.moshi.live_mimi import install_ring_attention
        from duplexserve.engine_bridge.moshi.mimi_convs import install_fused_convs
        from duplexserve.engine_bridge.moshi.user_steps import drop_user_steps

        self._torch = torch
        if self.device_name == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device_name)
        self.device = device
        if self.threads:
            torch.set_num_threads(self.threads)
        # Process-wide, set either way: Mimi's float32 matmuls are the process's only ones (the LM
        # is bf16), and the CUDA graphs keep the kernels chosen when they are captured.
        matmul = torch.backends.cuda.matmul
        if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
            matmul.fp32_precision = "tf32" if self.fp32_matmul == "tf32" else "ieee"
        else:
            matmul.allow_tf32 = self.fp32_matmul == "tf32"
        dtype = {
            "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "float32": torch.float32,
            "float64": torch.float64,  # both models: exact comparisons across batch sizes (tests)
        }[self.dtype_name]
        torch.manual_seed(self.seed)
        started = time.perf_counter()
        phase = _PhaseClock(self.start_phases)
        # As moshi.server builds it (model_type mutations, LoRA fused, conditioning kept float32).
        info = self.checkpoint or preset_checkpoint(self.preset)  # type: ignore[arg-type]
        mimi = info.get_mimi(device=device)
        if dtype == torch.float64:
            mimi = mimi.double()
        phase("mimi")
        overrides = {"context": self.context} if self.context else {}
        lm = info.get_moshi(
            device=device, dtype=dtype, load_weight=self.preset is None, fuse_lora=True,
            lm_kwargs_overrides=overrides,
        )  # fmt: skip
        if drop_user_steps(lm):  # PersonaPlex: moshi sized Mimi for all 16 steps
            mimi.set_num_codebooks(lm.n_q - lm.dep_q)
        phase("lm")
        if self.preset is not None:
            _calibrate_codebooks(mimi)
            phase("codebooks")
        if self.family.prompted:
            self._layout = StreamLayout.of(lm, mimi)
            # A .pt voice's embeddings on the GPU once: copied from the host at each prompt, they
            # would wait for everything queued before (a pageable copy does).
            self._voices = {
                name: dataclasses.replace(voice, embeddings=voice.embeddings.to(device, dtype))
                if voice.embeddings is not None else voice
                for name, voice in load_voices(self.voice_dir, mimi, lm.dim, lm.num_codebooks).items()
            }  # fmt: skip
            self.takes_prompts, self.voices = True, tuple(self._voices)
        phase("voices")
        self.tokenizer = None
        if self.tokenizer_path:
            import sentencepiece

            self.tokenizer = sentencepiece.SentencePieceProcessor(str(self.tokenizer_path))
        if self.attention == "live" and not install_live_attention(lm, kv_dtype=self.kv_dtype):
            if self.kv_dtype != "bf16":
                raise ValueError(
                    f"this LM cannot use live-prefix attention, which --moshi-kv-dtype {self.kv_dtype} needs"
                )
            log.warning("moshi engine: this LM cannot use live-prefix attention; stock attention")
        self.paged = self._paged_kv(lm)
        if self.attention == "live":  # the LM's and the depformer's RMSNorms, one kernel each on CUDA
            install_fused_norms(lm)
        compiled = device.type == "cuda" and self.compile == "on"
        if not compiled:  # eager: moshi's RoPE and gate one kernel each on CUDA, as compiled
            install_fused_pointwise(lm)
            install_fused_pointwise(mimi)
        if self.mimi_attention == "live" and triton_available(device) and not install_ring_attention(mimi):
            log.warning("moshi engine: this Mimi's transformers cannot take the ring attention; stock")
        if self.mimi_convs != "stock" and triton_available(device):
            install_fused_convs(mimi, channels_last=self.mimi_convs == "fused-cl")
        if self.depformer == "lean" and not install_lean_depformer(lm):
            log.warning("moshi engine: this LM's depformer cannot take the unmasked attention; stock")
        self.delay_frames = max(lm.delays)
        self.tail = self.family.tail(self.delay_frames)
        self._skip_text = (lm.existing_text_padding_id, lm.existing_text_end_padding_id)
        self.lm_gen = LMGen(
            lm,
            cfg_coef=self.cfg_coef,
            condition_tensors=self._condition_tensors(lm, self.num_slots),
            support_out_of_sync=True,  # one clock per slot: a reset never stalls the others
            on_audio_hook=self._force_audio if self.family.prompted else None,
            **self.sampling.lm_gen_kwargs(info.lm_gen_config),
        )
        self.mimi = mimi
        self._no_compile = contextlib.nullcontext if compiled else no_compile
        self._eager = no_compile  # a prefill's shapes vary: compiled, each new one would compile anew
        phase("kernels")
        self._allocate(self.num_slots, phase)
        kv = "KV ring a slot"
        if self.pages is not None:
            pages = self.pages
            kv = f"paged KV: {pages.pages} pages of {self.kv_page} frames, a floor of {pages.floor} a slot"
        log.info(
            "moshi engine ready: %s on %s, %d slots (%s), delay %d frames, %.1f s (%s)",
            self.preset.name if self.preset else self.source.hf_repo or self.source.weights,
            device,
            self.num_slots,
            kv,
            self.delay_frames,
            time.perf_counter() - started,
            ", ".join(f"{name} {s:.1f} s" for name, s in self.start_phases.items()),
        )

    def _allocate(self, b: int, phase: _PhaseClock | None = None) -> None:
        """Streaming state for ``b`` slots, host/device buffers, then warm-up (graph capture);
        ``phase`` times the state apart from each bucket's warm-up."""
        from duplexserve.engine_bridge.moshi.prefill import Prefill
        from duplexserve.engine_bridge.moshi.row_buckets import (
            GraphPool,
            RowBuckets,
            bucket_sizes,
            streaming_modules,
        )
        from duplexserve.engine_bridge.moshi.row_reset import RowReset
        from duplexserve.engine_bridge.moshi.slot_state import SlotState

        torch = self._torch
        n = self.frame_samples
        self.num_slots = b
        self._steps = np.zeros(b, dtype=np.int64)
        self._eoi_at = np.full(b, -1, dtype=np.int64)  # per slot: index of its end-of-input frame
        self._lead = np.full(b, self.delay_frames)  # per slot: steps before its first answer
        pin = self.device.type == "cuda"
        self._exec_host = torch.zeros(b, dtype=torch.bool, pin_memory=pin)
        self._exec = self._exec_host.numpy()
        self._decode_host = torch.zeros(b, dtype=torch.bool, pin_memory=pin)
        self._encode_host = torch.zeros(b, dtype=torch.bool, pin_memory=pin)  # without those rows
        self._decode = self._decode_host.numpy()
        mimi_dtype = next(self.mimi.parameters()).dtype  # float32, as Kyutai runs it (float64: tests)
        self._in_host = torch.zeros((b, 1, n), dtype=mimi_dtype, pin_memory=pin)
        self._in_np = self._in_host.numpy()[:, 0, :]
        self._in_dev = self._in_host.to(self.device) if pin else self._in_host
        self._out_host = torch.zeros((b, n), dtype=torch.float32, pin_memory=pin)
        self._out_np = self._out_host.numpy()
        self._text_host = torch.zeros(b, dtype=torch.long, pin_memory=pin)
        self._text_np = self._text_host.numpy()
        plan = None
        if self.device.type == "cuda":
            plan = self._memory_plan(b)
            log.info("moshi engine memory: %s", plan.describe())
            plan.check()
        if self.paged:
            self._page_table(b, plan)
        self.lm_gen.condition_tensors = self._condition_tensors(self.lm_gen.lm_model, b)
        with torch.no_grad():
            self.mimi.streaming_forever(b)
            self.lm_gen.streaming_forever(b)
        self._share_exec_mask(b)
        modules = streaming_modules(self.mimi, self.lm_gen)
        # Every per-row tensor, as a fresh row holds it; Mimi's rings, which a client's samples
        # reach, cleared at a reset too (slot_state.py).
        slots = SlotState(modules, b, cleared=streaming_modules(self.mimi))
        if self.family.prompted:  # prompts.py: each row's user codes held back a step
            lm = self.lm_gen.lm_model
            user = lm.num_codebooks - 1 - lm.dep_q
            self._held = torch.zeros((b, user, 1), dtype=torch.long, device=self.device)
            self._lagged = torch.zeros(b, dtype=torch.bool, device=self.device)
            slots.add(self._held)
            slots.add(self._lagged)
            self._sine = torch.tensor(self._layout.sine, device=self.device)  # a prompt's last held codes
            self._forced: dict[int, list[np.ndarray]] = {}  # slot -> agent tokens its next steps force
            self._unprompted: set[int] = set()  # opened, no prompt yet: the default runs first
            self._forcing: tuple[Any, Any] | None = None
            with torch.no_grad(), self._eager():
                self._prefill_runner = Prefill(lm, graphs=self.cuda_graphs)
        self._slots = slots
        self._rows = RowBuckets(modules, slots, bucket_sizes(b))
        if self.pages is not None:  # a moved row's pages stay where they are: its table row moves
            self._rows.on_move = self.pages.move
        else:
            self._prefix_moves(self._rows.views)
        with torch.no_grad(), self._no_compile():
            self._reset_rows = RowReset(slots, self.device, self.cuda_graphs)
        graphed = self.cuda_graphs and self.device.type == "cuda"
        whole = graphed and self.mimi_graph == "whole"
        pools = (GraphPool(), GraphPool())  # encode's graphs, decode's: each shared by the buckets
        self._mimi_fns = {  # one set of CUDA graphs per bucket
            n: self._graph_mimi(*pools) if whole else (self.mimi.encode, self.mimi.decode)
            for n in self._rows.sizes
        }
        self._mimi_encode, self._mimi_decode = self._mimi_fns[b]
        if phase is not None:
            phase("state")
        # Before ready: every bucket, or those of up to --moshi-warm-rows rows and the largest;
        # a step never runs a bucket not captured yet (capture_plan.py).
        self._capture = CapturePlan(self._rows.sizes, self.warm_rows, graphed)
        self._warm_up(self._capture.before_ready if graphed else [b], phase)
        if plan is not None:  # what the plan's allowance beyond the ring is measured against
            used = plan.free - self._torch.cuda.mem_get_info(self.device)[0]
            rings = (b + self.family.prompted) * plan.kv_per_slot  # the prefill's scratch row has one
            if self.pages is not None:
                rings = self.pages.pages * plan.paging.page_bytes  # type: ignore[union-attr]
            self.memory_in_use = (used, rings)
            log.info(
                "moshi engine memory in use: %.1f GiB, %.1f MiB a slot beyond its ring (planned: %.0f; "
                "%d buckets' graphs not captured yet, --moshi-warm-rows 0 captures every one first)",
                used / 2**30, (used - rings) / b / 2**20, OTHER_PER_SLOT / 2**20, len(self._capture.cold),
            )  # fmt: skip

    def _prefix_moves(self, views: Any) -> None:
        """A row moved down (row_buckets.py) copies of the LM's KV rings only the slots it has
        filled: a ring as long as the context holds a row's keys in ``[0, min(steps,
        capacity))``, its transformer's offset counting the steps (a prefill's too)."""
        from duplexserve.engine_bridge.moshi.row_buckets import RING_SLOTS

        torch = self._torch
        transformer = self.lm_gen.lm_model.transformer
        rings = [layer.self_attn._streaming_state.kv_cache for layer in transformer.layers]
        if any(ring is None for ring in rings) or not views.tensors:
            return
        offsets = transformer._streaming_state.offsets  # the full state's: updated in place
        capacity = rings[0].cache.shape[RING_SLOTS]
        tensors = [t for ring in rings for t in (ring.cache, getattr(ring, "scale", None)) if t is not None]
        views.prefixed = {id(t) for t in tensors}

        def live(src: np.ndarray) -> int:  # one read from the GPU, at a move only
            return min(int(offsets[torch.from_numpy(src).to(offsets.device)].max()), capacity)

        views.live_prefix = live

    def _condition_tensors(self, lm: Any, batch: int) -> dict[str, Any]:
        """moshi's own conditions of the family (Hibiki: "very_good", and "very_bad" rows
        under guidance), one row a slot: every session is conditioned as moshi.server's."""
        from moshi.run_inference import get_condition_tensors

        return get_condition_tensors(self.model_type, lm, batch, self.cfg_coef)

    def _graph_mimi(self, encode_pool: Any, decode_pool: Any) -> tuple[Any, Any]:
        """``--moshi-mimi-graph whole``: fewer kernels launched one by one from the host.

        The library graphs Mimi's encoder, decoder and transformers and launches the rest
        from the host, a kernel at a time: the frame-rate convolutions and the quantizer's
        few small ops per codebook. Here decode is one graph (the library's graphs run
        inline when captured inside another), and so is the quantizer's encode. The
        downsampling convolution before it stays out: it pads by replicating its first
        sample and keeps its "first frame" flag by assigning a new tensor each call, which a
        graph would never see again (captured, the first codebook's codes differed in 89%
        of the frames).
        """
        from duplexserve.engine_bridge.moshi.row_buckets import PooledGraphed

        latent = self.mimi._encode_to_unquantized_latent
        quantize = PooledGraphed(self.mimi.quantizer.encode, encode_pool)
        return (lambda x: quantize(latent(x))), PooledGraphed(self.mimi.decode, decode_pool)

    def _share_exec_mask(self, b: int) -> None:
        """Make every streaming state of Mimi and the LM read one device mask.

        The library's ``set_exec_mask`` walks every streaming module and copies a host
        mask into each module's own tensor: hundreds of Python calls and copies a step,
        and a pageable host tensor makes each copy wait for the GPU to reach it, so the
        host stalls behind the step it is queueing. With one shared tensor, a step sets
        its masks with one asynchronous copy from pinned memory each (the encode mask,
        then the decode mask, in stream order). Done before the graphs are captured.
        """
        from moshi.modules.streaming import StreamingModule

        torch = self._torch
        self._mask_dev = torch.ones(b, dtype=torch.bool, device=self.device)
        # Under guidance the LM runs every slot twice (conditioned rows, then unconditioned):
        # its modules read the mask repeated, refreshed from the slots' mask at each step.
        self._mask_lm = self._mask_dev if self.cfg_coef == 1.0 else self._mask_dev.repeat(2)
        lm_states = [
            m._streaming_state
            for m in self.lm_gen.lm_model.modules()
            if isinstance(m, StreamingModule) and m._streaming_state is not None
        ]
        mimi_states = [
            m._streaming_state
            for m in self.mimi.modules()
            if isinstance(m, StreamingModule) and m._streaming_state is not None
        ]
        for state in [self.lm_gen._streaming_state, *mimi_states]:
            state.exec_mask = self._mask_dev
        for state in lm_states:
            state.exec_mask = self._mask_lm

    def _memory_plan(self, slots: int) -> MemoryPlan:
        lm = self.lm_gen.lm_model
        attention = lm.transformer.layers[0].self_attn
        kv = kv_bytes_per_slot(
            len(lm.transformer.layers), attention.embed_dim, attention.num_heads, attention.context,
            self.kv_dtype if self.attention == "live" else "bf16", next(lm.parameters()).element_size(),
            attention.kv_repeat, branches=1 if self.cfg_coef == 1.0 else 2,
        )  # fmt: skip
        self._torch.cuda.empty_cache()  # what loading left in torch's cache is free for the ring
        fixed = fixed_bytes(self.family.prompted, self.prompt_cache_bytes, kv)
        free = self._torch.cuda.mem_get_info(self.device)[0]
        if not self.paged:
            return MemoryPlan(slots, self.kv_dtype, kv, free, fixed)
        paging = Paging.of(kv, attention.context, self.kv_floor_s, self.kv_page)
        return MemoryPlan(slots, self.kv_dtype, paging.floor_pages * paging.page_bytes, free, fixed, paging)

    def _paged_kv(self, lm: Any) -> bool:
        """Whether the LM's KV is paged (paged_kv.py): asked for, on live attention, without a
        prefill (prompted models write a prompt's keys into a ring row) or guidance (two rows a
        session); else the ring, said once."""
        if self.kv_layout != "paged":
            return False
        clock = getattr(lm.transformer, "_live_clock", None)
        why = (
            "the LM has no live-prefix attention" if clock is None
            else "prompted models prefill a ring" if self.family.prompted
            else "guidance runs two rows a session" if self.cfg_coef != 1.0
            else None
        )  # fmt: skip
        if why is not None:
            log.info("moshi engine: the LM's KV is a ring a slot (%s)", why)
        return why is None

    def _page_table(self, rows: int, plan: MemoryPlan | None) -> None:
        """The rows' page table, handed to every layer before the pools are built: as many
        pages as the plan leaves (or ``kv_pages``; on the CPU every row's full context)."""
        from duplexserve.engine_bridge.moshi.paged_kv import PageTable

        clock = self.lm_gen.lm_model.transformer._live_clock
        context = clock.capacity
        self.kv_page = self.kv_page or page_frames(context)
        full = 1 + rows * -(-context // self.kv_page)
        pages = self.kv_pages or (plan.pool_pages if plan is not None and plan.paging else full)
        floor = round(self.kv_floor_s * FRAME_HZ)
        pinned = self.device.type == "cuda"
        self.pages = clock.pages = PageTable(rows, pages, self.kv_page, context, floor, self.device, pinned)
        log.info(
            "moshi engine: paged KV, %d pages of %d frames (%d full contexts of %d), a floor of %d pages"
            " a slot", pages, self.kv_page, (pages - 1) // self.pages.per_row, context, self.pages.floor,
        )  # fmt: skip

    def resize(self, num_slots: int) -> None:
        """Rebuild the streaming state for another slot count, keeping the weights (the
        step-time benchmark sweeps batch sizes with it; the server never resizes)."""
        import gc

        for module in (self.mimi, self.lm_gen, self.lm_gen.lm_model):
            module._stop_streaming()
        self._mimi_encode = self._mimi_decode = self._rows = self._mimi_fns = None  # type: ignore[assignment]
        self._reset_rows = None  # type: ignore[assignment]
        self._prefill_runner = None
        gc.collect()  # the old states and their CUDA graphs hold memory until collected
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()
        self._allocate(num_slots)

    def _warm_up(self, sizes: list[int], phase: _PhaseClock | None = None) -> None:
        """Capture the CUDA graphs of each bucket of ``sizes`` rows (``_warm_bucket``), then
        run the default prompt's prefill once (prompted families)."""
        self._warming = True
        for size in sizes:
            self._warm_bucket(size)
            self._capture.mark(size)
            if phase is not None:
                phase(f"warm-up {size}")
        if self.family.prompted:  # the default prompt's prefill: its kernels, and the cache
            self._prompt_cache.clear()
            self.open(0, {})
            self.prompt(0, {})
            self.close(0)
            if phase is not None:
                phase("prefill")
        self._rows.map.clear()
        self._steps[:] = 0
        self._eoi_at[:] = -1
        self._lead[:] = self.delay_frames
        self.timings = {"steps": 0, "step_s": 0.0, "host_s": 0.0}
        self._warming = False

    def _warm_bucket(self, size: int) -> None:
        """A step's kernels at bucket ``size`` with every row masked off, ``WARM_CALLS`` times:
        moshi's ``CUDAGraphed`` runs its first call eagerly (compiling), captures at the second
        and replays. A masked row keeps its state (a session without a frame in a step is
        masked the same way), so this may run between the steps of live sessions."""
        torch = self._torch
        with torch.no_grad(), self._no_compile():
            self._rows.views.use(size)
            encode, decode = self._mimi_fns[size]
            self._exec[:] = False
            self._mask_dev.copy_(self._exec_host, non_blocking=True)
            self._refresh_lm_mask()
            self._forcing = None
            for _ in range(WARM_CALLS):
                codes = encode(self._in_dev[:size])
                if self.family.prompted:
                    codes = self._hold_back(codes, size)
                tokens = self.lm_gen.step(codes)
                decode(tokens[:, 1:].clamp(min=0))
            if self.device.type == "cuda":  # the pinned mask is rewritten by the next step
                torch.cuda.current_stream(self.device).synchronize()

    def warm(self) -> bool:
        """Capture the smallest bucket still cold (``--moshi-warm-rows``); the bridge calls it
        while no session is open, so it delays no live frame. Until then a step that needs it
        runs in a larger captured bucket (capture_plan.py)."""
        size = self._capture.next_idle()
        if size is not None:
            started = time.perf_counter()
            self._warming = True
            try:
                self._warm_bucket(size)
            finally:
                self._warming = False
            self._capture.mark(size)
            log.info(
                "moshi engine: the %d-row bucket's graphs captured in %.2f s while idle, %d buckets to go",
                size, time.perf_counter() - started, len(self._capture.cold),
            )  # fmt: skip
        return bool(self._capture.cold)

    def open(self, slot: int, params: dict[str, Any]) -> None:
        self._rows.map.open(slot)  # the lowest free row, reset before it next steps
        if self.pages is not None:  # it holds no page yet; its floor is reserved
            self.pages.open(int(self._rows.map.row_of[slot]))
        self._steps[slot] = 0
        self._eoi_at[slot] = -1
        self._lead[slot] = self.delay_frames
        if self.family.prompted:
            self._unprompted.add(slot)

    def close(self, slot: int) -> None:
        row = int(self._rows.map.row_of[slot])
        if self.pages is not None and row >= 0:  # its pages back to the free list
            self.pages.release(row)
        self._rows.map.close(slot)  # its row's state stays until an open resets it
        self._steps[slot] = 0
        self._eoi_at[slot] = -1
        if self.family.prompted:
            self._forced.pop(slot, None)
            self._unprompted.discard(slot)

    # ---------------------------------------------------------------------- moves
    def export_slot(self, slot: int) -> bytes:
        """The slot's row of every per-row tensor, the LM's KV up to what the row filled, and
        the slot's bookkeeping (slot_export.py). A PersonaPlex slot whose prompt still forces
        the agent's tokens moves with what it still forces; one opened whose prompt has not
        run yet is ``move_not_now``."""
        from duplexserve.engine_bridge.moshi import slot_export

        torch = self._torch
        if self.family.prompted and slot in self._unprompted:
            raise MoveRefused("move_not_now", f"slot {slot}'s prompt has not run yet: move it once it has")
        row = self._row_for_move(slot)
        if self.pages is not None and self.pages.stopped[row]:  # its keys wrap inside fewer pages
            raise MoveRefused("move_not_now", f"slot {slot}'s KV context stopped growing (paged KV ran out)")
        rings, rows = self._kv_rows(row)
        capacity, _ = slot_export.kv_layout(rings, self.num_slots)
        n = min(int(self.lm_gen.lm_model.transformer._streaming_state.offsets[row]), capacity)
        tensors = slot_export.read_row(self._slots, row, slot_export.ring_tensors(rings))
        tensors.update((f"kv.{i}", t) for i, t in enumerate(slot_export.row_kv(rings, rows, n)))
        forced = self._forced.get(slot, []) if self.family.prompted else []
        if forced:
            tensors["forced"] = torch.from_numpy(np.stack(forced))
        state = {
            "steps": int(self._steps[slot]),
            "eoi_at": int(self._eoi_at[slot]),
            "lead": int(self._lead[slot]),
            "forced": len(forced),
        }
        return slot_export.pack(self.move_identity(), state, tensors, n)

    def import_slot(self, slot: int, state: bytes) -> None:
        """Open ``slot`` (the reset of ``open``, done now) and write an exported state into its
        row: its next step is the one the exporting engine's would have been."""
        from duplexserve.engine_bridge.moshi import slot_export

        torch = self._torch
        saved, tensors, n = slot_export.unpack(state, self.move_identity())
        try:
            steps, eoi_at, lead, count = (int(saved[k]) for k in ("steps", "eoi_at", "lead", "forced"))
        except (KeyError, TypeError, ValueError) as exc:
            raise MoveRefused("move_corrupt", f"the slot state's bookkeeping does not parse: {exc}") from exc
        forced = tensors.get("forced")
        fits = forced is not None and forced.dim() == 2 and len(forced) == count
        if count and not (self.family.prompted and fits):
            raise MoveRefused("move_mismatch", "the slot state forces agent tokens this model cannot")
        rings, rows = self._kv_rows(0)
        kv = [tensors.get(f"kv.{i}") for i in range(sum(k.startswith("kv.") for k in tensors))]
        if not 0 <= n <= slot_export.kv_layout(rings, self.num_slots)[0]:
            raise MoveRefused("move_mismatch", f"the state holds {n} KV slots, past this model's context")
        slot_export.check_kv(kv, slot_export.row_kv(rings, [0] * len(rows), 0), n)  # type: ignore[arg-type]
        self.open(slot, {})
        try:
            row = self._row_for_move(slot)
            rings, rows = self._kv_rows(row)
            with torch.no_grad():
                slot_export.write_row(self._slots, row, slot_export.ring_tensors(rings), tensors)
                slot_export.put_row_kv(rings, rows, kv)  # type: ignore[arg-type]
        except BaseException:
            self.close(slot)
            raise
        self._steps[slot], self._eoi_at[slot], self._lead[slot] = steps, eoi_at, lead
        if self.family.prompted:
            self._unprompted.discard(slot)
            if count:
                self._forced[slot] = list(forced.numpy())  # type: ignore[union-attr]

    def move_identity(self) -> dict[str, Any]:
        """What a slot's state must have been made by to be imported here: the model, its
        dtypes and shapes, and every setting that changes what a row's state holds."""
        import hashlib

        from duplexserve.engine_bridge.moshi.slot_export import kv_layout

        if self._move_identity is not None:
            return self._move_identity
        lm = self.lm_gen.lm_model
        rings = [layer.self_attn._streaming_state for layer in lm.transformer.layers]
        ring = rings[0].kv_cache
        source = self.source
        named = source.hf_repo or os.path.basename(source.weights.rstrip("/"))
        model = self.preset.name if self.preset else named
        # A few weights' bytes: two replicas that name their checkpoint alike but load others differ.
        probe = hashlib.sha256()
        for module in (lm, self.mimi):
            for param in list(module.parameters())[:4]:
                probe.update(param.detach().flatten()[:64].double().cpu().numpy().tobytes())
        self._move_identity = {
            "family": self.model_type,
            "model": model,
            "lora": os.path.basename(source.lora),
            "weights": probe.hexdigest()[:16],
            "dtype": str(next(lm.parameters()).dtype).removeprefix("torch."),
            "mimi_dtype": str(next(self.mimi.parameters()).dtype).removeprefix("torch."),
            "kv_dtype": str(ring.cache.dtype).removeprefix("torch."),
            "kv_layout": "paged" if self.pages is not None else "ring",  # a ring row has offsets of its own
            "context": int(kv_layout(rings, self.num_slots)[0]),
            "cfg_coef": self.cfg_coef,
            "delay": int(self.delay_frames),
            "attention": self.attention,
            "depformer": self.depformer,
            "mimi_attention": self.mimi_attention,
        }
        return self._move_identity

    def _row_for_move(self, slot: int) -> int:
        """The slot's row, the full states in use and a reset still due done now."""
        self._rows.views.use(self.num_slots)
        row = int(self._rows.map.row_of[slot])
        if row < 0:
            raise MoveRefused("move_not_now", f"slot {slot} holds no session")
        if self._rows.map.reset[row]:
            with self._torch.no_grad():
                self._reset_rows(np.arange(row + 1) == row)
            self._rows.map.reset[row] = False
        return row

    def _kv_rows(self, row: int) -> tuple[list[Any], list[int]]:
        """The LM layers' streaming states (their rings) and the batch rows of ``row``'s
        copies there (two under guidance: conditioned, then unconditioned), of the full states."""
        self._rows.views.use(self.num_slots)
        from duplexserve.engine_bridge.moshi.slot_export import kv_layout

        rings = [layer.self_attn._streaming_state for layer in self.lm_gen.lm_model.transformer.layers]
        _, copies = kv_layout(rings, self.num_slots)
        return rings, [c * self.num_slots + row for c in range(copies)]

    # -------------------------------------------------------------------- prompts
    def prompt(self, slot: int, params: dict[str, Any]) -> None:
        """Reset the session's row now and run its prompt through the LM in one forward."""
        if not self.family.prompted:
            super().prompt(slot, params)
        prompt = self._build_prompt(params)  # refused before the default prompt is given up
        self._unprompted.discard(slot)
        self._prefill(slot, prompt, _prompt_key(params))

    def prompt_cached(self, params: dict[str, Any]) -> bool:
        """Whether ``prompt`` with ``params`` costs a copy, not a forward (the bridge runs
        at most one forward between two steps)."""
        return not self.family.prompted or _prompt_key(params) in self._prompt_cache

    def _build_prompt(self, params: dict[str, Any]) -> Prompt:
        """The prompt of a session's ``text_prompt`` and ``voice_prompt`` (prompts.py)."""
        text, voice_name = params.get("text_prompt") or "", params.get("voice_prompt") or ""
        voice = None
        if voice_name:
            voice = self._voices.get(voice_name)
            if voice is None:
                raise PromptError("voice_not_found", f"voice_prompt {voice_name!r}: no such voice here")
        tokens: list[int] = []
        if text.strip():
            if self.tokenizer is None:
                raise PromptError("invalid_prompt", "a text prompt needs the model's tokenizer, and this "
                                  "server has none: start it with --moshi-tokenizer (a SentencePiece model)")
            tokens = self.tokenizer.encode(wrap_system(text))
        frames = prompt_frames(len(tokens), voice)
        context = self.lm_gen.lm_model.transformer.layers[0].self_attn.context
        if frames > context:
            message = f"the prompt is {frames} frames, more than the model's context ({context})"
            raise PromptError("invalid_prompt", message)
        return Prompt.build(self._layout, tokens, voice)

    def _prefill(self, slot: int, prompt: Prompt, key: tuple[str, str]) -> None:
        from duplexserve.engine_bridge.moshi.live_lm import write_ring_prefix

        torch = self._torch
        row = int(self._rows.map.row_of[slot])
        lm = self.lm_gen.lm_model
        n = prompt.frames - 1  # positions the prompt runs through the transformer
        # Nothing here may wait for the GPU (a copy from pageable memory or a tensor element set
        # from a Python number does): after the forward's launch it would hold this thread, and
        # the next step of every live session, until the forward is done.
        tokens = self._to_device(prompt.tokens[: n + 1].T)  # [streams, n + 1]
        ring = self.lm_gen._streaming_state.cache.shape[2]
        window = self._to_device(_token_window(prompt.tokens, n, ring, lm.ungenerated_token_id))
        with torch.no_grad(), self._eager():
            self._rows.views.use(self.num_slots)  # the full states: the prefix goes into the full ring
            self._reset_rows(np.arange(row + 1) == row)
            self._rows.map.reset[row] = False
            rings = [layer.self_attn._streaming_state for layer in lm.transformer.layers]
            prefix = self._prompt_cache.get(key)
            self._prompts_since_step[prefix is not None] += 1
            if prefix is not None:  # the same prompt left these keys and values before
                self._prompt_cache.move_to_end(key)
            else:
                seq = tokens[None, :, :n]
                x = lm.text_emb(seq[:, 0])  # LMModel.forward_text's sum, in its order
                x = sum((lm.emb[k](seq[:, k + lm.audio_offset]) for k in range(1, lm.num_audio_codebooks)),
                        lm.emb[0](seq[:, lm.audio_offset])) + x  # fmt: skip
                if prompt.voice_embeddings is not None:
                    x[0, : len(prompt.voice_embeddings)] = prompt.voice_embeddings.to(x)
                prefix = self._prefill_runner.run(x)  # on a scratch row (prefill.py)
                self._keep_prompt(key, prefix)
            write_ring_prefix(rings, row, prefix)
            lm.transformer._streaming_state.offsets[row].fill_(n)
            state = self.lm_gen._streaming_state
            state.offsets[row].fill_(n)
            state.cache[row] = window  # every position the next steps read before they write it
            self._held[row, :, 0] = self._sine
            self._lagged[row].fill_(True)
        self._lead[slot] = 0  # the prompt's delay is behind it: every step answers
        forced = [row_tokens[1 : 1 + lm.dep_q] for row_tokens in prompt.forced_after]
        self._forced[slot] = [f for f in forced if (f >= 0).any()]

    def _keep_prompt(self, key: tuple[str, str], prefix: list[Any]) -> None:
        """Cache a prefill's ring prefix, the least recently used ones leaving to stay within
        ``--prompt-cache-mb`` (counted in the memory plan)."""
        size = sum(t.numel() * t.element_size() for t in prefix)
        if size > self.prompt_cache_bytes:
            return
        held = sum(t.numel() * t.element_size() for p in self._prompt_cache.values() for t in p)
        while self._prompt_cache and held + size > self.prompt_cache_bytes:
            _, old = self._prompt_cache.popitem(last=False)
            held -= sum(t.numel() * t.element_size() for t in old)
        self._prompt_cache[key] = prefix

    def _hold_back(self, codes: Any, size: int) -> Any:
        """The LM hears each prompted row's user codes one step late (prompts.py)."""
        torch = self._torch
        lagged = self._lagged[:size, None, None]
        held = self._held[:size]
        out = torch.where(lagged, held, codes)
        held.copy_(torch.where(lagged & self._mask_dev[:size, None, None], codes, held))
        return out

    def _due_forcing(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """The agent tokens a prompt still forces at this step, for ``_force_audio``."""
        self._forcing = None
        if not self._forced:
            return
        forced = self._forced
        due = [(int(r), forced[s].pop(0)) for s, r in zip(slots.tolist(), rows, strict=True) if forced.get(s)]
        for slot in [s for s, left in self._forced.items() if not left]:
            del self._forced[slot]
        if due:
            at = self._to_device(np.array([r for r, _ in due]))
            self._forcing = (at, self._to_device(np.stack([t for _, t in due])))

    def _to_device(self, array: np.ndarray) -> Any:
        """``array`` on the engine's device without waiting for the GPU's queue: through
        pinned memory (torch's caching host allocator), copied asynchronously."""
        host = self._torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _force_audio(self, audio_tokens: Any) -> None:
        """LMGen's audio hook: the depformer's tokens replaced where a prompt forces them."""
        if self._forcing is not None:
            at, tokens = self._forcing
            audio_tokens[at] = self._torch.where(tokens >= 0, tokens, audio_tokens[at])

    def end_input(self, slot: int, frames: int) -> None:
        """A translation model is told the input ended with its frame ``frames`` (families.py)."""
        if self.family.ends_on_eos:
            self._eoi_at[slot] = frames

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """Where ``slots`` are in the batched state now (row_buckets.py): tests and benchmarks
        read LMGen's batch output by it."""
        return self._rows.map.row_of[slots]

    # ----------------------------------------------------------------------- step
    def step(self, slots: np.ndarray, frames: np.ndarray) -> StepResult:
        torch = self._torch
        started = time.perf_counter()
        if self.family.prompted and self._unprompted:  # stepped before any prompt: the default one
            for slot in self._unprompted.intersection(slots.tolist()):
                self.prompt(slot, {})
        moves = self._rows.moves
        stops = self.pages.stops if self.pages is not None else 0
        with torch.no_grad(), self._no_compile():
            # the step runs rows [0, size), in a bucket whose graphs are captured
            rows, size, reset = self._rows.prepare(slots, self._capture.fit)
            if self.pages is not None:  # a row about to write into a page it does not hold takes one
                self.pages.grow(rows, self._steps[slots], slots)
                self.pages.sync()
            self._mimi_encode, self._mimi_decode = self._mimi_fns[size]
            if reset is not None:
                self._reset_rows(reset)
            exec_mask = self._exec
            exec_mask[:] = False
            exec_mask[rows] = True
            self._in_np[rows] = frames
            if self._in_dev is not self._in_host:
                self._in_dev[:size].copy_(self._in_host[:size], non_blocking=True)
            eoi_at = self._eoi_at[slots]
            end_rows = rows[eoi_at == self._steps[slots]]  # this step's end-of-input frames
            if len(end_rows):  # Mimi does not encode them: their codes say the input ended
                encode_mask = self._encode_host.numpy()
                encode_mask[:] = exec_mask
                encode_mask[end_rows] = False
                self._mask_dev.copy_(self._encode_host, non_blocking=True)
            else:
                self._mask_dev.copy_(self._exec_host, non_blocking=True)
            self._refresh_lm_mask()
            codes = self._mimi_encode(self._in_dev[:size])
            if self.family.first_frame_reset:
                self._reset_after_first_frame(slots, rows, size)
            if len(end_rows):
                codes[self._to_device(end_rows)] = self.mimi.cardinality
                self._mask_dev.copy_(self._exec_host, non_blocking=True)
                self._refresh_lm_mask()
            if self.family.prompted:
                codes = self._hold_back(codes, size)
                self._due_forcing(slots, rows)
            tokens = self.lm_gen.step(codes)
            assert tokens is not None  # support_out_of_sync: never None
            steps = self._steps[slots] + 1
            self._steps[slots] = steps
            ready = steps > self._lead[slots]  # rows past the model's delay
            decode = self._decode
            decode[:] = False
            decode[rows[ready]] = True
            if ready.any():
                self._mask_dev.copy_(self._decode_host, non_blocking=True)
                pcm = self._mimi_decode(tokens[:, 1:].clamp(min=0))
                self._out_host[:size].copy_(pcm[:, 0], non_blocking=True)
            self._text_host[:size].copy_(tokens[:, 0, 0], non_blocking=True)
            queued = time.perf_counter()  # the host's part: everything is queued on the GPU
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        audio = self._out_np[rows]  # fancy indexing: a copy, the buffers are reused
        audio[~ready] = 0.0
        failed: list[int] = []
        text = self._text(rows, ready, failed) if self.tokenizer is not None else {}
        finished = None
        if (eoi_at >= 0).any():  # past its end-of-input frame, a row ends at its end of text
            done = (eoi_at >= 0) & (steps > eoi_at) & ready
            done &= self._text_np[rows] == self.family.eos_text_id
            finished = np.flatnonzero(done).tolist() or None
        wall = time.perf_counter() - started
        timings = self.timings
        usual = timings["step_s"] / timings["steps"] if timings["steps"] else wall
        timings["steps"] += 1
        timings["step_s"] += wall
        timings["host_s"] += queued - started
        if wall > max(SLOW_STEP_S, 2 * usual) and not self._warming:  # a step that makes every session late
            log.warning(
                "moshi engine: a %.0f ms step (%.0f ms queueing it): %d rows in a bucket of %d, %d moved, "
                "%d reset; before it %d new prompts and %d cached", 1000 * wall, 1000 * (queued - started),
                len(rows), size, self._rows.moves - moves, 0 if reset is None else int(reset.sum()),
                *self._prompts_since_step,
            )  # fmt: skip
        self._prompts_since_step = [0, 0]
        stopped = self.pages.stops - stops if self.pages is not None else 0
        return StepResult(audio, text, finished, failed or None, stopped)

    def _refresh_lm_mask(self) -> None:
        """Under guidance the LM's modules read the slots' mask repeated (``_share_exec_mask``)."""
        if self._mask_lm is not self._mask_dev:
            self._mask_lm.view(2, -1).copy_(self._mask_dev.expand(2, -1))

    def _reset_after_first_frame(self, slots: np.ndarray, rows: np.ndarray, size: int) -> None:
        """moshi.server's first-frame rule, per slot: reset Mimi once a session's first frame
        is encoded, so its second is encoded as if it began the stream. LMGen discards the
        first frame's codes anyway; its decoder has not run yet, so the reset touches only
        the encoder's state."""
        first = rows[self._steps[slots] == 0]
        if len(first):
            mask = np.zeros(size, dtype=bool)
            mask[first] = True
            self.mimi.reset_streaming(self._to_device(mask))

    def _text(self, rows: np.ndarray, ready: np.ndarray, failed: list[int]) -> dict[int, str]:
        """The text piece of each row that sampled one. A row whose piece cannot be rendered
        is added to ``failed`` (its session ends alone, not the step): only ids the tokenizer
        has are looked up, and what it raises for one of them is that row's fault."""
        ids = self._text_np[rows]
        tokenizer = self.tokenizer
        assert tokenizer is not None
        vocab = tokenizer.get_piece_size()
        hits = np.flatnonzero(
            ready & (ids >= 0) & (ids < vocab) & (ids != self._skip_text[0]) & (ids != self._skip_text[1])
        )
        text = {}
        for i in hits.tolist():
            try:
                text[i] = tokenizer.id_to_piece(int(ids[i])).replace("\u2581", " ")
            except Exception:
                slot = self._rows.map.slot_of[rows[i]]
                log.exception("moshi engine: the text of slot %d could not be rendered", slot)
                failed.append(i)
        return text

    def stop(self) -> None:
        """Drop the models and their streaming state, so that a restart (the bridge's
        answer to a failed step) builds them anew without holding two copies."""
        if self.timings["steps"]:
            log.info(
                "moshi engine: %d steps, %.2f ms a step",
                self.timings["steps"],
                1000 * self.timings["step_s"] / self.timings["steps"],
            )
        self._prompt_cache.clear()
        self._prefill_runner = None
        self._move_identity = None
        self.mimi = self.lm_gen = None  # type: ignore[assignment]
        self._mimi_encode = self._mimi_decode = self._rows = self._mimi_fns = None  # type: ignore[assignment]
        self._reset_rows = None  # type: ignore[assignment]
        torch = getattr(self, "_torch", None)
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


class _PhaseClock:
    """Each call records the seconds since the one before under ``name`` (the GPU's queue
    drained first where there is one, so a phase is charged its own kernels)."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases = phases
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now


def _token_window(tokens: np.ndarray, n: int, ring: int, ungenerated: int) -> np.ndarray:
    """LMGen's token cache of a row whose prompt ends at position ``n`` (``Prompt.tokens``):
    positions ``n - 1 .. n + ring - 2``, each at its place in the ``ring``-long cache.

    The step at ``n`` reads position ``n`` as input and, for the streams without delay,
    ``n - 1`` as output; the user's delayed streams are read at ``n + 1 ..`` before any step
    writes them. Positions the prompt leaves to the model (-1) hold what a fresh row holds:
    a step writes them before they are read.
    """
    window = np.full((tokens.shape[1], ring), ungenerated, dtype=np.int64)
    for p in range(n - 1, n + ring - 1):
        known = tokens[p] >= 0
        window[known, p % ring] = tokens[p][known]
    return window


def _prompt_key(params: dict[str, Any]) -> tuple[str, str]:
    return (params.get("text_prompt") or "").strip(), params.get("voice_prompt") or ""


def _calibrate_codebooks(mimi: Any) -> None:
    """Fit random Mimi's codebooks to its own latents of noise, with the library's k-means.

    An untrained codebook is all zeros, so every input would encode to code 0 and the
    LM would never hear its user; random centroids fare no better, since a random
    encoder's latents are mostly its biases. One k-means pass per RVQ layer, as
    Mimi's training starts, makes the codes follow the input.
    """
    import torch
    from moshi.utils.compile import no_compile

    device = next(mimi.parameters()).device
    batch = 16
    frames = -(-max(64, mimi.cardinality) // batch)  # at least one latent per centroid
    dtype = next(mimi.parameters()).dtype
    x = torch.randn(batch, 1, frames * 1920, device=device, dtype=dtype)
    x = x * torch.rand(batch, 1, 1, device=device, dtype=dtype)
    quantizer = mimi.quantizer
    # eager: compiled, the encoder's RoPE had dynamo trace and compile it, 9-11 s of a start on
    # an H200, for one pass
    with torch.no_grad(), no_compile():
        latents = mimi._encode_to_unquantized_latent(x)
        quantizer.train()
        for _ in range(quantizer.total_codebooks):  # each call initialises the next layer
            quantizer(latents, mimi.frame_rate)
        quantizer.eval()


def moshi_engine_from_config(config: ServerConfig) -> MoshiEngine:
    return MoshiEngine(
        config.max_sessions,
        preset=config.moshi_preset,
        weights=config.moshi_weights,
        tokenizer=config.moshi_tokenizer,
        hf_repo=config.moshi_hf_repo,
        config=config.moshi_config,
        lora=config.moshi_lora,
        cfg_coef=config.moshi_cfg_coef,
        device=config.device,
        dtype=config.moshi_dtype,
        context=config.moshi_context,
        sampling=Sampling(
            greedy=config.moshi_greedy,
            temp=config.moshi_temp,
            temp_text=config.moshi_temp_text,
            top_k=config.moshi_top_k,
            top_k_text=config.moshi_top_k_text,
        ),
        seed=config.moshi_seed,
        voice_dir=config.voice_prompt_dir,
        prompt_cache_mb=config.prompt_cache_mb,
        threads=config.moshi_threads,
        cuda_graphs=config.moshi_cuda_graphs,
        warm_rows=config.moshi_warm_rows,
        compile=config.moshi_compile,
        attention=config.moshi_attention,
        kv_dtype=config.moshi_kv_dtype,
        depformer=config.moshi_depformer,
        mimi_attention=config.moshi_mimi_attention,
        fp32_matmul=config.moshi_fp32_matmul,
        mimi_graph=config.moshi_mimi_graph,
        mimi_convs=config.moshi_mimi_convs,
        kv_layout=config.moshi_kv_layout,
        kv_floor_s=config.moshi_kv_floor_s,
        kv_pages=config.moshi_kv_pages,
    )
