"""Server configuration: one dataclass, exposed as CLI flags and ``DUPLEXSERVE_*`` variables.

Each field carries its help text, so ``duplexserve serve --help`` documents every
setting and the environment names are derived, never written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from duplexserve.option_table import GROUPS, group_of

ENV_PREFIX = "DUPLEXSERVE_"
#: The namespace attribute holding the fields whose flag was given (a set; absent: none).
GIVEN = "_given_on_command_line"
#: ``--max-sessions auto``: resolved before serving to the slots that fit by the moshi
#: engine's memory plan on the GPU (duplexserve/check/plan.py); no part below sees it.
AUTO_SESSIONS = 0


def _opt(
    default: Any, help: str, choices: tuple[str, ...] | None = None, parse: Callable[[str], Any] | None = None
) -> Any:
    """A setting; ``parse`` reads its flag and variable when the default's type cannot."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse})


class SettingError(argparse.ArgumentTypeError, ValueError):
    """A setting's value out of its range; argparse shows its text (not "invalid ... value")."""


def int_or_auto(text: str) -> int:
    """``--max-sessions``: a count of at least 1, or ``auto`` (:data:`AUTO_SESSIONS`, never typed)."""
    if text.strip().lower() == "auto":
        return AUTO_SESSIONS
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise SettingError(f"{text!r} is no session count: a whole number from 1 up, or auto")
    return count


def model_names(text: str) -> tuple[str, ...]:
    """``--served-model-name``: names separated by commas or spaces (one token of the flag, or
    the whole variable); empty: none, any model a client names is served."""
    return tuple(name for name in re.split(r"[,\s]+", text) if name)


class _Names(argparse.Action):
    """``--served-model-name a b,c``: every token's names, one tuple."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, tuple(name for names in values for name in names))
        _Noted._note(namespace, self.dest)


def tcp_port(text: str) -> int:
    """``--port``: 0..65535 (0: one the system picks, as the tests use it); uvicorn's
    OverflowError otherwise, after the model's load."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise SettingError(f"{text!r} is no TCP port: a whole number from 1 to 65535 (0: any free one)")
    return port


def torch_device(text: str) -> str:
    """``--device``: what the moshi engine hands torch (auto, cpu, cuda, cuda:N), refused here
    rather than by torch.device in the engine thread, after the preflight."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise SettingError(f"{text!r} is no device: auto, cpu, cuda or cuda:N (N: the GPU's index)")
    return text


def folder(text: str) -> str:
    """A folder that must exist (empty: none), refused before any model loads."""
    if text and not os.path.isdir(text):
        what = "is not a folder" if os.path.exists(text) else "does not exist"
        raise SettingError(f"{text} {what}")
    return text


@dataclass
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8998, "TCP port to listen on (0: one the system picks)", parse=tcp_port)
    ws: str = _opt(
        "fast",
        "WebSocket implementation: fast (uvicorn's sans-I/O protocol with our callback fast path,"
        " server/transports/websocket/protocol.py) or one of uvicorn's own, over plain ASGI"
        " (docs/benchmarks.md)",
        ("fast", "websockets-sansio", "websockets"),
    )
    log_level: str = _opt("info", "log level", ("critical", "error", "warning", "info", "debug"))
    model: str = _opt("", "model name reported to clients that name none (default: the first "
                      "--served-model-name, else named after the engine)")
    served_model_name: tuple[str, ...] = _opt(
        (), "the model names clients may ask for (?model=, GET /v1/models), as vLLM's flag; any other is "
        "refused model_not_found. None: a client's name is served and echoed (OpenAI's SDKs name theirs)",
        parse=model_names,
    )

    # Engine.
    engine: str = _opt("synthetic", "engine behind the bridge", ("synthetic", "moshi", "vllm-omni"))
    synthetic_mode: str = _opt("echo", "synthetic engine mode", ("echo", "silence"))
    delay_frames: int = _opt(0, "synthetic engine: output frame i answers input frame i - delay")
    text_every: int = _opt(5, "synthetic engine: emit a text.delta every N frames (0: never)")
    step_base_ms: float = _opt(0.0, "synthetic step model: fixed wait per step, GIL released")
    step_per_session_ms: float = _opt(0.0, "synthetic step model: extra wait per session in the batch")
    host_ms_per_session: float = _opt(
        0.0, "synthetic step model: Python work per session per step, holding the GIL"
    )
    moshi_preset: str = _opt(
        "tiny", "moshi engine: a released architecture with random weights, when no checkpoint is named"
    )
    moshi_hf_repo: str = _opt(
        "", "moshi engine: checkpoint OWNER/NAME[@REVISION] from the local Hugging Face cache (offline: a "
        "missing file is an error, never a download)"
    )
    moshi_weights: str = _opt(
        "", "moshi engine: checkpoint folder laid out like its Hugging Face repository (nothing is "
        "downloaded)"
    )
    moshi_config: str = _opt(
        "", "moshi engine: config.json replacing the checkpoint's (moshi's --config-path)"
    )
    moshi_lora: str = _opt("", "moshi engine: LoRA adapter (safetensors) fused into the LM at load")
    moshi_cfg_coef: float = _opt(
        1.0, "moshi engine: classifier-free guidance of a conditioned LM (Hibiki), the negative being "
        "\"very_bad\" as in moshi; 1: off. Doubles each session's KV cache"
    )
    device: str = _opt("auto", "moshi engine: torch device (auto, cpu, cuda, cuda:N)", parse=torch_device)
    moshi_tokenizer: str = _opt(
        "", "moshi engine: SentencePiece model of the text tokens (prompts in, text out); empty: the "
        "checkpoint's own, or a tiny preset's toy one (docs/moshi-engine.md)",
    )
    moshi_context: int = _opt(0, "moshi engine: LM context (KV cache) in frames; 0: the model's own")
    moshi_dtype: str = _opt(
        "auto", "moshi engine: LM weights dtype (auto: bfloat16 on GPU, float32 on CPU; float64: "
        "Mimi too, for exact comparisons)",
        ("auto", "bfloat16", "float16", "float32", "float64"),
    )
    moshi_greedy: bool = _opt(False, "moshi engine: greedy decoding instead of sampling (tests)")
    moshi_temp: float | None = _opt(
        None, "moshi engine: audio sampling temperature (unset: the checkpoint's lm_gen_config, else 0.8)",
        parse=float,
    )
    moshi_temp_text: float | None = _opt(
        None, "moshi engine: text sampling temperature (unset: the checkpoint's, else 0.7)", parse=float
    )
    moshi_top_k: int | None = _opt(
        None, "moshi engine: audio top-k (unset: the checkpoint's, else 250)", parse=int
    )
    moshi_top_k_text: int | None = _opt(
        None, "moshi engine: text top-k (unset: the checkpoint's, else 25)", parse=int
    )
    moshi_seed: int = _opt(0, "moshi engine: seed of the random weights and of sampling")
    voice_prompt_dir: str = _opt(
        "",
        "moshi engine, PersonaPlex: the folder of voice prompts sessions may name (NVIDIA's voices.tgz"
        " .pt files, or .wav), each loaded once at start",
        parse=folder,
    )
    max_prompt_bytes: int = _opt(
        16 << 10, "the longest text prompt (PersonaPlex's text_prompt, Realtime instructions), UTF-8 "
        "bytes: a longer one is refused on the event loop (invalid_prompt, 1007) before it reaches the "
        "engine, which tokenizes the rest and refuses one past the model's context"
    )
    prompt_cache_mb: int = _opt(
        1024,
        "moshi engine, PersonaPlex: GPU memory for the keys and values of prompts already run (MiB), so"
        " a session with a prompt seen before copies them instead of running it; counted in the plan",
    )
    moshi_threads: int = _opt(0, "moshi engine: torch CPU threads (0: torch's default)")
    moshi_cuda_graphs: bool = _opt(True, "moshi engine: CUDA graphs, as the moshi library uses them")
    moshi_compile: str = _opt(
        "off",
        "moshi engine on CUDA: off: its RoPE and SiLU gate as duplexserve's kernels, one each, no"
        " torch.compile; on: the library's torch.compile of them, as Kyutai runs it, whose dynamo trace"
        " takes a start or restart 7-19 s longer (docs/moshi-engine.md, Start-up and restart)",
        ("on", "off"),
    )
    moshi_warm_rows: int = _opt(
        0,
        "moshi engine: 0: every bucket's CUDA graphs captured before the engine is ready; N: the buckets"
        " of up to N rows and the largest, the others while no session is open, a step needing one not"
        " captured yet running in the smallest captured bucket that holds its rows, never eagerly"
        " (docs/moshi-engine.md, Start-up and restart)",
    )
    moshi_attention: str = _opt(
        "live",
        "moshi engine: LM attention over each session's live KV prefix (live) or the library's"
        " over the whole ring (stock)",
        ("live", "stock"),
    )
    moshi_kv_dtype: str = _opt(
        "bf16",
        "moshi engine: the LM's KV ring in the model's dtype (bf16) or int8 with a scale per slot and"
        " head: half the memory a session, not exact (docs/moshi-engine.md)",
        ("bf16", "int8"),
    )
    moshi_kv_layout: str = _opt(
        "ring",
        "moshi engine, live attention: a ring of the whole context reserved for every slot from its"
        " first frame (ring, measured on GPUs), or the LM's KV in pages a call takes as it ages and"
        " gives back at its end, a slot reserving only its floor (paged: bit for bit the ring's on the"
        " CPU, not yet measured on a GPU); prompted models and guidance keep the ring"
        " (docs/moshi-engine.md, Paged KV)",
        ("paged", "ring"),
    )
    moshi_kv_floor_s: float = _opt(
        60.0,
        "moshi engine, paged KV: the context every slot is promised (seconds, in whole pages of 512"
        " frames): the slot count is what these floors fit, and when the pages run out a call stops"
        " growing there (never ended), counted and logged",
    )
    moshi_kv_pages: int = _opt(
        0,
        "moshi engine, paged KV: the pool's pages, the sink page included (0: every byte the memory"
        " plan leaves on a GPU, every slot's full context on the CPU); at least 1 + slots x floor pages",
    )
    moshi_mimi_attention: str = _opt(
        "live",
        "moshi engine: Mimi's transformers attend over their ring with one small kernel a layer (live:"
        " CUDA with Triton; float32 like stock, not bit for bit) or with the library's position table,"
        " mask and SDPA (stock; what the CPU always runs)",
        ("live", "stock"),
    )
    moshi_fp32_matmul: str = _opt(
        "float32",
        "moshi engine: Mimi's float32 matmuls in full float32 as Kyutai runs them, or on the tensor"
        " cores as TF32 (10-bit mantissa, as torch already runs Mimi's convolutions; faster at large"
        " batch, not exact: docs/moshi-engine.md)",
        ("float32", "tf32"),
    )
    moshi_mimi_graph: str = _opt(
        "whole",
        "moshi engine: Mimi's CUDA graphs as the library captures them (parts: encoder, decoder and"
        " transformers; the frame-rate convolutions and the quantizer launched op by op from the"
        " host) or decode and the quantizer's encode each one graph more (whole: the same kernels,"
        " fewer host launches a step, outputs bit for bit the same; docs/moshi-engine.md)",
        ("parts", "whole"),
    )
    moshi_mimi_convs: str = _opt(
        "fused",
        "moshi engine: Mimi's streaming convolutions with their bias, ELU, kept samples and residual"
        " sums each folded into one pass (fused: CUDA with Triton; outputs bit for bit the library's)"
        " or op by op as the library runs them (stock; what the CPU always runs); fused-cl: fused, the"
        " inputs written channels last so that cuDNN converts none between layouts",
        ("stock", "fused", "fused-cl"),
    )
    moshi_depformer: str = _opt(
        "lean",
        "moshi engine: the depformer's attention over the live slots of its ring without a mask (lean:"
        " the same keys and values, stock's tokens in float64 on the CPU; on CUDA one small kernel a"
        " layer, 17 -> 9 ms a step at 384 slots, docs/benchmarks.md) or as the library runs it (stock:"
        " a position table and a masked SDPA per layer and codebook)",
        ("stock", "lean"),
    )
    vllm_omni_model: str = _opt("", "vllm-omni engine: model (HF id or local path) DuplexOmniEngine serves")
    vllm_omni_deploy_config: str = _opt("", "vllm-omni engine: deploy YAML (session_mode: duplex)")
    vllm_omni_args: str = _opt("", "vllm-omni engine: JSON object of further DuplexOmni keyword arguments")
    vllm_omni_session: str = _opt(
        "", "vllm-omni engine: JSON object merged into every session's Realtime session payload"
    )
    vllm_omni_input_rate: int = _opt(24000, "vllm-omni engine: the rate the model takes pcm_f32le at")
    vllm_omni_standin: bool = _opt(
        False, "vllm-omni engine, tests and benchmarks: vLLM-Omni's real engine on the CPU, model stood in "
        "by an echo (docs/vllm-omni.md)"
    )
    engine_process: bool | None = _opt(
        None, "run the engine in a process of its own (shared memory), so its Python never holds the "
        "server's GIL (unset: on for the moshi engine on a GPU, off otherwise)"
    )
    engine_spare: str = _opt(
        "on",
        "with the engine in a process of its own: keep a second one spawned, its imports done, "
        "waiting, so that a restart after the engine process dies skips the spawn and the imports "
        "(host memory of one idle process, no GPU memory; docs/moshi-engine.md, Start-up)",
        ("off", "on"),
    )

    # Codecs (docs/codecs.md says what runs where, and why).
    codec_threads: int = _opt(2, "threads for transcoding that releases the GIL (resampling above 96 kHz)")
    codec_processes: int = _opt(
        2, "worker processes holding Opus codec state (off the loop process); 0: Opus runs on the loop"
    )
    opus_complexity: int = _opt(
        5, "Opus output: libopus encoder complexity, 0 (cheapest) to 10, application AUDIO (docs/codecs.md); "
        "ignored when libopus cannot be loaded and sphn encodes"
    )
    codec_batch_ms: float = _opt(
        2.0, "codec worker requests wait up to this long to leave together (one sendmsg, one worker "
        "wake-up and one reply for many sessions' frames); 0: at the end of each loop iteration"
    )
    opus_ahead_s: float = _opt(
        10.0, "Opus input: a connection's decoded audio may run this far ahead of its wall clock (from "
        "its first message), and this much above what its bytes justify (--opus-ms-per-byte); beyond "
        "either it is closed invalid_audio (1003), counted as budget opus_samples (docs/reliability.md)"
    )
    opus_ms_per_byte: float = _opt(
        20.0, "Opus input: at most this much decoded audio per byte received, over a connection (honest "
        "streams carry under 2 ms a byte, DTX silence in 20 ms frames about 10; one-byte packets of 120 ms "
        "25 to 57)"
    )

    engine_coalesce_ms: float = _opt(
        1.0,
        "when the engine wakes from idle, wait this long before stepping so one step serves the "
        "frames of many sessions (fewer thread hand-offs per frame); 0 steps at once",
    )
    engine_tick_ms: float = _opt(
        0.0,
        "step the engine on a clock of this period, every session with a frame in each step "
        "(docs/architecture.md: one step per frame instead of cohorts, at up to one frame of "
        "latency; 80 is one frame); 0: step whenever a frame is pending (lower latency: the "
        "H200 runs in docs/benchmarks.md)",
    )
    engine_gather: str = _opt(
        "off",
        "stepping at once: under load (a step over a quarter of a frame), let a step wait, up to "
        "its own duration, for the frames due within it, so one step serves the cohorts that "
        "stepping at once would step apart, for an engine whose step costs its whole batch "
        "whatever frames it holds (the moshi engine; docs/moshi-engine.md, Gathering)",
        ("off", "on"),
    )

    # Admission and bounds.
    max_sessions: int = _opt(
        256, "sessions served at once (engine slots); more get 1013. auto (moshi engine on a GPU): as "
        "many as fit in the GPU's free memory after the weights, by the engine's memory plan "
        "(duplexserve check shows it)",
        parse=int_or_auto,
    )
    queue_size: int = _opt(256, "bound of the janus queue into the engine thread")
    inflight_frames: int = _opt(
        8, "frames of one session handed to the engine and not yet answered, at most"
    )
    max_pending_frames: int = _opt(
        64, "frames of one session buffered before the engine; past it, reading pauses"
    )
    max_output_frames: int = _opt(
        256, "frames queued toward one client; a client that falls further behind is closed"
    )
    max_message_bytes: int = _opt(1 << 20, "largest WebSocket message accepted (1009 beyond)")
    max_output_event_bytes: int = _opt(
        4 << 20, "replies and other events queued toward one client that does not read, in bytes (each "
        "counted as the message it answers plus 64); past it the client is closed slow_consumer"
    )
    ws_max_frames_per_s: int = _opt(
        5000, "WebSocket frames (messages, fragments, control frames) one connection may send a second, "
        "--ws-budget-burst-s ahead; past it the connection is closed 1008 (0: no limit)"
    )
    ws_max_control_frames_per_s: int = _opt(
        50, "WebSocket control frames (ping, pong, close) one connection may send a second, "
        "--ws-budget-burst-s ahead; past it the connection is closed 1008 (0: no limit)"
    )
    ws_max_bytes_per_s: int = _opt(
        32 << 20, "bytes one WebSocket connection may send a second, --ws-budget-burst-s ahead; past "
        "it the connection is closed 1008 (0: no limit)"
    )
    ws_max_parse_ms_per_s: float = _opt(
        25.0, "ms of the event loop's CPU one WebSocket connection may spend a second handling its text "
        "(JSON) messages, a second of it at once; past it the connection is closed 1008 (0: no limit)"
    )
    ws_max_address_parse_ms_per_s: float = _opt(
        100.0, "the same for all WebSocket connections of one address (not loopback, not a proxy of "
        "--forwarded-allow-ips; IPv6 by /64) together (0: no limit)"
    )
    ws_budget_burst_s: float = _opt(
        4.0, "how many seconds of its rate a WebSocket connection may send at once (the buckets' depth)"
    )
    overload_lag_ms: float = _opt(
        50.0, "the event loop counts as overloaded past this lag, 4 probes in a row (a timer due every 50 "
        "ms running late): new HTTP requests but a reserve of probes, and new sessions, are shed "
        "(docs/reliability.md)"
    )
    overload_gil_wait_ms: float = _opt(
        20.0, "the same past this wait of an engine step's answer for the GIL (--engine-process)"
    )
    overload_parse_share: float = _opt(
        0.5, "the same past this share of the loop's time handling WebSocket text (JSON) messages, all "
        "connections together: the global ceiling on parse work (0: none)"
    )
    idle_timeout_s: float = _opt(30.0, "close a session that sends nothing for this long")
    max_session_s: float = _opt(0.0, "longest session in seconds (0: no limit)")
    max_sessions_per_client: int = _opt(
        -1, "sessions one client may hold at once (WebSockets and WebRTC calls alike); the client is the "
        "peer's address, or the one a proxy of --forwarded-allow-ips names, an IPv6 one counted by its "
        "--client-ipv6-prefix network. -1: a quarter of --max-sessions (at least 1) for every client but "
        "this host's own connections (every hop loopback: a benchmark, a probe); 0: no limit; N: N for "
        "every client, loopback included",
    )
    client_ipv6_prefix: int = _opt(
        64, "the per-client quotas count an IPv6 client by its network of this many bits (64: one "
        "subscriber's /64, whose every address is the same client; 128: each address its own)",
    )
    forwarded_allow_ips: str = _opt(
        "", "comma-separated proxies (IPs or CIDRs, * for any peer) whose X-Forwarded-For names the client, "
        "read from the right: the first entry that is no proxy named here is the client (* trusts the peer, "
        "no entry: its rightmost entry counts); empty: no peer is trusted, X-Forwarded-For, Forwarded and "
        "X-Real-IP are never read",
    )
    handshake_timeout_s: float = _opt(
        10.0, "close a connection whose request head (the first or any later one on a kept-alive "
        "connection, a WebSocket handshake's included) is not complete this long after it began"
    )
    max_connections_per_client: int = _opt(
        -1, "connections one client (keyed as --max-sessions-per-client keys it; not loopback, not a "
        "proxy of --forwarded-allow-ips) may hold at once; past it a new one is closed unread. -1: an "
        "eighth of the connections the descriptor limit allows (RLIMIT_NOFILE less a reserve), at most "
        "1024; 0: no limit (docs/reliability.md)",
    )
    drain_max_s: float = _opt(
        10.0, "duplex/1: after input.end, how long a model that ends its answer on its own (Hibiki's "
        "translation, until its end of text) may go on on silence, at most"
    )
    drain_grace_s: float = _opt(
        30.0, "on SIGTERM: stop admitting, let sessions finish this long, then close the rest"
    )
    resume_grace_s: float = _opt(
        30.0, "duplex/1: keep a session whose connection dropped this long for a resume (0: no resume)"
    )
    max_detached: int = _opt(
        -1, "duplex/1: most sessions kept detached for a resume at once; past it the one detached "
        "longest ends (resume_evicted), as it does when a new session finds every slot taken "
        "(-1: a quarter of --max-sessions, at least 1)",
    )
    max_detached_per_client: int = _opt(
        -1, "duplex/1: of those, most one client (as --max-sessions-per-client counts it) may keep; past it "
        "its own detached longest ends (resume_evicted), and past --max-detached that of the client "
        "holding the most, so one client's drops evict only its own (-1: a quarter of --max-detached, at "
        "least 1)",
    )
    late_frame_ms: float = _opt(
        200.0, "an output frame handed to the socket more than this after its input arrived is late "
        "(duplexserve_frames_late_total, session.closed late_frames)"
    )
    engine_stall_s: float = _opt(
        10.0, "an engine step running longer than this is a stall: its sessions fail, the engine is rebuilt"
    )
    replica_id: str = _opt(
        "", "behind a proxy of several replicas: this replica's name, put before every resume token "
        "(NAME.random) so that the proxy routes a resume to the replica holding the session "
        "(docker/nginx/duplexserve.conf); letters, digits and '-'",
    )
    peer_url_template: str = _opt(
        "", "duplex/1 behind a proxy with no affinity: where the replica a resume token names listens, "
        "{replica} standing for its --replica-id (ws://{replica}:8998 on compose; "
        "ws://{replica}.duplexserve-headless.NAMESPACE.svc:8998 on Kubernetes); with --peer-secret, a "
        "resume for another replica is relayed to it (docs/protocol.md). Else such a resume fails "
        "(resume_failed)",
    )
    peer_secret: str = _opt(
        "", "the secret replicas send each other on a forwarded resume (the same on every replica); a "
        "forwarded resume without it is refused, and none is forwarded while it is empty",
    )
    peers: str = _opt(
        "", "duplex/1 live migration: comma-separated --replica-id names of the peers that take this "
        "replica's sessions when it drains (the compose services; the StatefulSet's pod names on "
        "Kubernetes, or ordinals:N for NAME-0 to NAME-(N-1), NAME being this replica's id without its "
        "ordinal), reached by --peer-url-template and authenticated by --peer-secret (moves are off "
        "without both); empty: sessions drain in place (docs/protocol.md, \"Moved to another replica\")",
    )
    move_timeout_s: float = _opt(
        5.0, "live migration: a session's move to a peer that has not answered in this long fails, "
        "and the session goes on here",
    )
    refuse_with_http_503: bool = _opt(
        False,
        "when full or draining, answer the WebSocket upgrade with HTTP 503 instead of accepting and "
        "closing with 1013, so a proxy in front (nginx proxy_next_upstream http_503) tries another replica",
    )

    # OpenAI Realtime: how continuous model speech is cut into responses (docs/protocols.md).
    realtime_speech_dbfs: float = _opt(
        -45.0, "OpenAI Realtime: an output frame louder than this (RMS, dBFS) is speech and opens a response"
    )
    realtime_silence_ms: int = _opt(480, "OpenAI Realtime: this much silent output ends a response")

    # WebRTC (POST /v1/realtime/calls; docs/protocols.md).
    ice_servers: str = _opt(
        "", "WebRTC: STUN/TURN servers for deployments behind NAT, as a JSON list of RTCIceServer objects "
        "([{\"urls\": \"turn:turn.example.com:3478\", \"username\": \"u\", \"credential\": \"p\"}]) or plain "
        "comma-separated URLs; empty: host candidates only (never a public default)"
    )
    ice_host_addresses: str = _opt(
        "", "WebRTC: comma-separated addresses offered as host candidates (127.0.0.1 included if named); "
        "empty: every interface's address except loopback, as aioice gathers them"
    )
    webrtc_jitter_frames: int = _opt(
        3, "WebRTC: the jitter buffer's depth in 20 ms packets: how long the model's clock runs behind the "
        "first packet, so that packets this much late or early are still played in order"
    )
    webrtc_packet_ms: int = _opt(
        80, "WebRTC: the Opus packets the server sends, 20, 40 or 80 ms (one model frame: a quarter of the "
        "per-packet work of 20 ms); a peer's a=maxptime lowers it"
    )
    webrtc_ptime_ms: int = _opt(
        40, "WebRTC: the Opus packets asked of peers, 20, 40 or 80 ms (a=ptime in the answer, which browsers "
        "follow): 40 halves the packets to receive, unprotect and decode against browsers' default 20, and a "
        "lost one is rebuilt half from concealment, half from the next packet's FEC; a=maxptime lowers it"
    )
    webrtc_connect_timeout_s: float = _opt(
        10.0, "WebRTC: a call whose peer connection is not up (ICE and DTLS) this long after its answer ends "
        "(connect_timeout), its slot and UDP socket freed"
    )
    webrtc_output_fec: bool = _opt(
        False, "WebRTC: in-band FEC in the Opus the server sends (browsers rebuild lost packets from it; "
        "costs up to 4x the encoding CPU)"
    )

    # Security.
    api_keys: str = _opt(
        "", "comma-separated API keys, needed for sessions, calls, /v1/voices, /v1/realtime/ice_servers and "
        "the API docs (/docs, /redoc, /openapi.json); empty: no authentication (a list that names no key, "
        "\" \" or \",\", is refused)"
    )
    api_keys_file: str = _opt(
        "", "a file of API keys, one a line (# comments), in place of --api-keys: re-read within seconds of "
        "a change (a Kubernetes Secret volume, a bind mount), so keys rotate without a restart"
    )
    allowed_origins: str = _opt(
        "", "comma-separated Origins browsers may connect from besides this server's own (a page whose "
        "Origin names the host the request was sent to: the talk page); * : any. Checked on WebSocket "
        "upgrades and the HTTP API, and answered with CORS headers"
    )
    metrics_auth: bool = _opt(False, "/metrics needs an API key too (when --api-keys names any)")

    # Behaviour switches used by tests and benchmarks.
    synthetic_faults: bool = _opt(
        False,
        "tests only: the synthetic engine raises on a frame whose first sample is 1000 and hangs "
        "on one whose first sample is -1000",
    )
    offload_every_frame: bool = _opt(
        False,
        "benchmark only: hop to a thread pool for the audio conversion and for the queue put "
        "on every frame, as vLLM-Omni's frontend did",
    )

    @property
    def model_name(self) -> str:
        """What clients that name no model are told they talk to: --model, the first
        --served-model-name, or what the engine settings say."""
        if self.model or self.served_model_name:
            return self.model or self.served_model_name[0]
        if self.engine == "synthetic":
            return f"synthetic-{self.synthetic_mode}"
        if self.engine == "moshi":
            named = self.moshi_hf_repo.partition("@")[0] or self.moshi_weights.rstrip("/")
            return os.path.basename(named) if named else self.moshi_preset
        return self.vllm_omni_model or self.engine

    @property
    def model_owner(self) -> str:
        """Who publishes the served model, for ``GET /v1/models``: the checkpoint's organisation."""
        repo = self.moshi_hf_repo if self.engine == "moshi" else self.vllm_omni_model
        owner, slash, _ = repo.partition("@")[0].partition("/")
        return owner if slash and owner else "duplexserve"

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, notes: Mapping[str, str] | None = None) -> None:
        """Add one flag per field; defaults come from the environment when set there. ``notes``
        adds to a field's help what only a part this module may not import knows (the presets).
        The flags are grouped as option_table.py says; those given are noted (:data:`GIVEN`)."""
        groups = {g.title: parser.add_argument_group(g.title, g.description) for g in GROUPS}
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env = ENV_PREFIX + f.name.upper()
            try:
                default = _from_env(env, f.default, f.metadata["parse"])
            except ValueError as exc:
                parser.exit(2, f"{parser.prog}: error: {env}={os.environ[env]!r}: {exc}\n")
            if f.metadata["choices"] and default not in f.metadata["choices"]:  # argparse checks flags only
                parser.exit(2, f"{parser.prog}: error: {env}={default!r}: not one of "
                               f"{', '.join(f.metadata['choices'])}\n")
            group = group_of(f.name)
            if group.title not in groups:
                groups[group.title] = parser.add_argument_group(group.title, group.description)
            note = f"; {notes[f.name]}" if notes and f.name in notes else ""
            help_text = f"{f.metadata['help']}{note} [env {env}; default %(default)s]"
            if isinstance(f.default, bool) or f.type == "bool | None":
                groups[group.title].add_argument(
                    flag, action=_Noted.switch, default=default, help=help_text
                )
            else:
                many = {"nargs": "+", "action": _Names} if isinstance(f.default, tuple) else {}
                many.setdefault("action", _Noted.store)
                groups[group.title].add_argument(
                    flag,
                    type=f.metadata["parse"] or type(f.default),
                    default=default,
                    choices=f.metadata["choices"],
                    help=help_text,
                    **many,
                )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    @property
    def engine_in_process(self) -> bool:
        """``--engine-process`` as set, else on for the moshi engine on a GPU: there, under
        load, an engine thread's many torch calls fight the event loop for the GIL
        (docs/moshi-engine.md)."""
        if self.engine_process is not None:
            return self.engine_process
        return self.engine == "moshi" and self._on_gpu()

    def _on_gpu(self) -> bool:
        return self.device == "cuda" or (self.device == "auto" and os.path.exists("/dev/nvidiactl"))

    def validate(self) -> None:
        if self.api_keys and not any(k.strip() for k in self.api_keys.split(",")):
            raise ValueError(
                f"--api-keys {self.api_keys!r} names no key: give at least one, or leave it empty for no "
                "authentication"
            )
        if self.api_keys and self.api_keys_file:
            raise ValueError("--api-keys and --api-keys-file: give one of them")
        if self.max_sessions == AUTO_SESSIONS:
            if self.engine != "moshi" or not self._on_gpu():
                where = f"with --engine {self.engine}" if self.engine != "moshi" else "on the CPU"
                raise ValueError(
                    "--max-sessions auto needs the moshi engine on a GPU (it sizes the slots by the GPU's "
                    f"free memory); {where} pass a number instead, e.g. --max-sessions 8"
                )
        elif self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1 (or auto)")
        if self.queue_size < 1 or self.inflight_frames < 1:
            raise ValueError("queue_size and inflight_frames must be at least 1")
        if self.max_pending_frames < 1 or self.max_output_frames < 1:
            raise ValueError("max_pending_frames and max_output_frames must be at least 1")
        if self.max_output_event_bytes < 1:
            raise ValueError("max_output_event_bytes must be at least 1")
        if min(self.ws_max_frames_per_s, self.ws_max_control_frames_per_s, self.ws_max_bytes_per_s) < 0:
            raise ValueError("the WebSocket budgets are rates: 0 (no limit) or more")
        if self.ws_budget_burst_s <= 0:
            raise ValueError("ws_budget_burst_s must be positive")
        if self.delay_frames < 0 or self.text_every < 0:
            raise ValueError("delay_frames and text_every cannot be negative")
        if self.model and self.served_model_name and self.model not in self.served_model_name:
            raise ValueError(f"--model {self.model!r} is not among --served-model-name "
                             f"{' '.join(self.served_model_name)}: name it there too")
        if self.engine == "vllm-omni" and not (self.vllm_omni_model or self.vllm_omni_standin):
            raise ValueError("--engine vllm-omni needs --vllm-omni-model (or --vllm-omni-standin)")
        if self.engine == "vllm-omni" and self.engine_process:
            raise ValueError("--engine vllm-omni runs its own orchestrator thread and processes: "
                             "--engine-process does not apply")
        if self.engine_tick_ms < 0:
            raise ValueError("engine_tick_ms is a period in ms (0: step at once)")
        if not re.fullmatch(r"[A-Za-z0-9-]*", self.replica_id):
            raise ValueError(f"--replica-id {self.replica_id!r}: letters, digits and '-' only")
        for peer in filter(None, (p.strip() for p in self.peers.split(","))):
            if not re.fullmatch(r"[A-Za-z0-9-]+|ordinals:[0-9]+", peer):
                raise ValueError(f"--peers: {peer!r} is no replica name (letters, digits and '-') "
                                 "nor ordinals:N")
        if self.peer_url_template and "{replica}" not in self.peer_url_template:
            raise ValueError(f"--peer-url-template {self.peer_url_template!r}: no {{replica}} in it")
        if self.resume_grace_s < 0 or self.late_frame_ms <= 0:
            raise ValueError("resume_grace_s cannot be negative and late_frame_ms must be positive")
        if self.drain_max_s <= 0:
            raise ValueError("drain_max_s must be positive")
        if self.max_connections_per_client < -1:
            raise ValueError("max_connections_per_client: -1 (automatic), 0 (none) or more")
        if self.max_sessions_per_client < -1:
            raise ValueError("max_sessions_per_client: -1 (a quarter of max_sessions), 0 (none) or more")
        trusted_proxies(self.forwarded_allow_ips)  # raises for an entry that is no address
        if self.max_prompt_bytes < 1 or self.webrtc_connect_timeout_s <= 0:
            raise ValueError("max_prompt_bytes and webrtc_connect_timeout_s must be positive")
        if self.max_detached < -1 or self.max_detached_per_client < -1:
            raise ValueError("max_detached and max_detached_per_client must be -1 (a quarter) or at least 0")
        if not 1 <= self.client_ipv6_prefix <= 128:
            raise ValueError("client_ipv6_prefix must be 1..128 (bits of an IPv6 address)")
        if self.codec_threads < 1 or self.codec_processes < 0:
            raise ValueError("codec_threads must be at least 1 and codec_processes at least 0")
        if not 0 <= self.opus_complexity <= 10:
            raise ValueError("opus_complexity must be 0..10")
        if not 0 <= self.codec_batch_ms <= 20:
            raise ValueError("codec_batch_ms must be 0..20")
        if self.opus_ahead_s <= 0 or self.opus_ms_per_byte <= 0:
            raise ValueError("opus_ahead_s and opus_ms_per_byte must be positive")
        if self.webrtc_packet_ms not in (20, 40, 80):
            raise ValueError("webrtc_packet_ms must be 20, 40 or 80")
        if self.webrtc_ptime_ms not in (20, 40, 80):
            raise ValueError("webrtc_ptime_ms must be 20, 40 or 80")
        if not 1 <= self.webrtc_jitter_frames <= 50:
            raise ValueError("webrtc_jitter_frames must be 1..50 (20 ms packets)")


class _Noted:
    """argparse's actions, each noting its field in the namespace's :data:`GIVEN` when its flag
    is on the command line: a default, even one equal to it, is not chosen (options.py)."""

    @staticmethod
    def _note(namespace: argparse.Namespace, dest: str) -> None:
        vars(namespace).setdefault(GIVEN, set()).add(dest)

    class store(argparse._StoreAction):
        def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
            super().__call__(parser, namespace, values, option)
            _Noted._note(namespace, self.dest)

    class switch(argparse.BooleanOptionalAction):
        def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
            super().__call__(parser, namespace, values, option)
            _Noted._note(namespace, self.dest)


def trusted_proxies(spec: str) -> list[str]:
    """``--forwarded-allow-ips`` as uvicorn takes it; a ValueError for an entry that is not an
    address, a network or ``*`` (uvicorn would take it as a name no peer ever has, silently)."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    for entry in entries:
        if entry != "*":
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"--forwarded-allow-ips: {entry!r} is no IP address or network") from None
    return entries


_BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")


def _from_env(name: str, default: Any, parse: Callable[[str], Any] | None = None) -> Any:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if parse is not None:
        return parse(raw)
    if isinstance(default, bool) or default is None:  # None without a parse: a bool | None switch
        if raw.strip().lower() not in _BOOL_WORDS:  # read as off, it would be ignored without a word
            raise ValueError(f"a switch: one of {', '.join(_BOOL_WORDS)}")
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(raw)
