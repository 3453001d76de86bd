"""``duplexserve bench moshi-prompts``: what a PersonaPlex prompt's prefill costs, engine alone.

A prompt is run between two steps on the engine thread (one forward of its frames for
the session's row, ``engine.prompt``), so what it costs is added to the next step of
every live session. This measures, on a prompted preset with random weights: the step
time of ``--live`` sessions; the prefill of a prompt of ``--text-tokens`` text tokens
and a ``.pt`` voice of ``--voice-frames`` frames, each one new (a forward); the same
prompts again (a copy of the cached keys and values). Each is timed as the live sessions
feel it: from the call to the end of the step that follows it (that step's tokens on the
host, the prompt's GPU work queued before it), beside the time the call holds the thread.
``--assets DIR`` also leaves the tokenizer and voice it made there, for a server run
(``--moshi-tokenizer DIR/spm.model --voice-prompt-dir DIR``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

FRAME = 1920
WORDS = ("support", "agent", "billing", "account", "order", "refund", "delivery", "please", "help",
         "customer", "service", "calm", "friendly")  # fmt: skip


def write_assets(folder: Path, lm: dict, voice_frames: int) -> str:
    """A SentencePiece model of the LM's ``text_card`` pieces (every sampled text id is a piece,
    so the text path runs as with the released tokenizer) and a ``.pt`` voice in NVIDIA's
    format (random embeddings, a token cache of PAD, silence and tone); returns the voice's name."""
    import torch

    from duplexserve.engine_bridge.moshi.prompts import SILENCE_TOKENS, SINE_TOKENS, TEXT_PAD
    from duplexserve.engine_bridge.moshi.toy_tokenizer import train

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spm.model").write_bytes(train(lm["text_card"], corpus(lm["text_card"])))
    streams, agent = lm["n_q"] + 1, lm["n_q"] // 2
    row = [TEXT_PAD, *(t % lm["card"] for t in SILENCE_TOKENS[:agent] + SINE_TOKENS[:agent])]
    cache = torch.tensor(row).view(1, streams, 1).repeat(1, 1, 4)
    embeddings = (
        torch.randn(voice_frames - 1, 1, 1, lm["dim"], generator=torch.Generator().manual_seed(0)) * 0.02
    )
    name = f"random-{voice_frames}.pt"
    torch.save({"embeddings": embeddings.to(torch.bfloat16), "cache": cache}, folder / name)
    return name


def corpus(pieces: int) -> list[str]:
    """Lines of :data:`WORDS` and of made-up words, enough distinct text for ``pieces`` pieces
    (32,000: about 15 s of training)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    made_up = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(2 * pieces)]
    words = [*WORDS, *made_up]
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(max(400, pieces // 2))]


def text_of(tokenizer, tokens: int) -> str:
    """Words until the wrapped text is ``tokens`` tokens long (as the engine encodes it)."""
    from duplexserve.engine_bridge.moshi.prompts import wrap_system

    rng = random.Random(1)
    words: list[str] = []
    while len(tokenizer.encode(wrap_system(" ".join(words)))) < tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def main(args: argparse.Namespace) -> None:
    from duplexserve.engine_bridge.moshi.engine import MoshiEngine
    from duplexserve.engine_bridge.moshi.presets import get_preset

    preset = get_preset(args.preset)
    lm = preset.lm
    folder = Path(args.assets) if args.assets else Path(tempfile.mkdtemp(prefix="moshi-prompts-"))
    voice = write_assets(folder, lm, args.voice_frames)
    lives = [int(n) for n in args.live.split(",")]
    engine = MoshiEngine(
        max(lives), args.preset, tokenizer=str(folder / "spm.model"), voice_dir=str(folder),
        kv_dtype=args.kv_dtype, device=args.device,
    )  # fmt: skip
    t = time.perf_counter()
    engine.start()
    print(f"built {args.preset} in {time.perf_counter() - t:.1f} s", flush=True)
    torch = engine._torch
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    text = text_of(engine.tokenizer, args.text_tokens - 2)
    prompts = [{"text_prompt": f"{text} {WORDS[i % len(WORDS)]} {i}", "voice_prompt": voice}
               for i in range(args.prompts)]  # fmt: skip
    params = prompts[0]
    frames_of = engine._build_prompt(params).frames
    rng = np.random.default_rng(0)
    rows = []
    for live in lives:
        slots = np.arange(live)
        for slot in slots.tolist():
            engine.open(slot, {})
            engine.prompt(slot, params)
        frames = (rng.standard_normal((live, FRAME)) * 0.05).astype(np.float32)
        for _ in range(5):
            engine.step(slots, frames)
        sync()
        alone = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step(slots, frames)
            alone.append(time.perf_counter() - t0)
        timed: dict[str, tuple[list[float], list[float]]] = {"new": ([], []), "seen": ([], [])}
        engine._prompt_cache.clear()
        allocator = _allocator(torch, engine.device)
        profiler = _profiler(torch) if args.profile else contextlib.nullcontext()
        waits: list[str] = []
        with profiler as prof, host_waits(torch, waits, on=bool(args.profile)):
            _prompt_round(engine, prompts, live, slots, frames, timed, sync)
        if args.profile:
            head = f"# {args.preset} {args.kv_dtype}, {live} live: {2 * len(prompts)} prompt calls"
            with open(args.profile, "a") as f:
                f.write(f"{head}\n{_inside(prof, 'engine.prompt')}\n")
                for where, count in collections.Counter(waits).most_common():
                    f.write(f"# {count} waits for the GPU from the engine thread at:\n{where}\n")
        allocator = {k: v - allocator.get(k, 0) for k, v in _allocator(torch, engine.device).items()}
        step = float(np.median(alone))
        for slot in slots.tolist():
            engine.close(slot)
        row: dict[str, Any] = {"live": live, "prompt_frames": frames_of, "step_ms_p50": 1000 * step,
                               "step_ms_p99": 1000 * float(np.percentile(alone, 99)),
                               "allocator": allocator}  # fmt: skip
        for kind, name in (("new", "prefill"), ("seen", "cached")):
            host, through = timed[kind]  # cached: empty where --prompt-cache-mb held too few to see one again
            row[f"{name}_host_ms_p50"] = 1000 * float(np.median(host)) if host else float("nan")
            row[f"{name}_and_step_ms_p50"] = 1000 * float(np.median(through)) if through else float("nan")
            row[f"{name}_and_step_ms_max"] = 1000 * max(through, default=float("nan"))
            row[f"{name}_adds_ms_p50"] = row[f"{name}_and_step_ms_p50"] - 1000 * step
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "preset": args.preset,
        "kv_dtype": args.kv_dtype,
        "text_tokens": args.text_tokens,
        "voice_frames": args.voice_frames,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    head = ("live", "prompt", "step p50", "prefill host", "+ step p50", "max", "adds", "cached host",
            "+ step p50", "adds")  # fmt: skip
    print("".join(f"{h:>13}" for h in head))
    for r in rows:
        cells = [r["live"], r["prompt_frames"], r["step_ms_p50"], r["prefill_host_ms_p50"],
                 r["prefill_and_step_ms_p50"], r["prefill_and_step_ms_max"], r["prefill_adds_ms_p50"],
                 r["cached_host_ms_p50"], r["cached_and_step_ms_p50"], r["cached_adds_ms_p50"]]  # fmt: skip
        print("".join(f"{c:>13}" if isinstance(c, int) else f"{c:>11.1f}ms" for c in cells))


def _prompt_round(
    engine: Any, prompts: list[dict], live: int, slots: Any, frames: Any, timed: dict, sync: Any
) -> None:
    """Each prompt, then each again, on a slot that ends and opens anew, each timed with
    the step after it (``timed``: new / seen -> (call, call and step))."""
    record = engine._torch.profiler.record_function
    for i, prompt in enumerate(prompts * 2):  # a session ends, a new one takes its slot with a prompt
        slot = i % live
        engine.close(slot)
        engine.open(slot, {})
        host, through = timed["seen" if engine.prompt_cached(prompt) else "new"]
        sync()
        t0 = time.perf_counter()
        with record("engine.prompt"):
            engine.prompt(slot, prompt)  # returns once the prompt's work is queued on the GPU
        host.append(time.perf_counter() - t0)
        engine.step(slots, frames)  # ends when its tokens are on the host, the prompt's work before it
        through.append(time.perf_counter() - t0)


def _allocator(torch: Any, device: Any) -> dict[str, int]:
    """The CUDA caching allocator's counts that mean a wait for the GPU: cudaMalloc and
    cudaFree calls, and retries after freeing its cache (each a device-wide sync)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    return {k: int(stats.get(k, 0)) for k in keys}


def _inside(prof: Any, label: str, rows: int = 30) -> str:
    """The host time of the ops under every ``label`` range, by op (self time): what the
    thread did while it held the live sessions' next step."""
    spent: dict[str, list[float]] = {}
    stack = [e for e in prof.events() if e.name == label]
    total = sum(e.cpu_time_total for e in stack)
    while stack:
        event = stack.pop()
        stack.extend(event.cpu_children)
        if event.name != label:
            entry = spent.setdefault(event.name, [0.0, 0])
            entry[0] += event.self_cpu_time_total
            entry[1] += 1
    lines = [f"{label}: {total / 1000:.1f} ms of host time in all"]
    for name, (us, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{us / 1000:10.2f} ms {calls:7d} calls  {name}")
    return "\n".join(lines)


@contextlib.contextmanager
def host_waits(torch: Any, waits: list[str], on: bool) -> Iterator[None]:
    """Where the engine thread waits for the GPU (CUDA's sync debug mode warns at each such
    call; the warning's Python stack goes into ``waits``)."""
    if not on or not torch.cuda.is_available():
        yield
        return

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        stack = [line for line in traceback.format_stack()[:-2] if "duplexserve" in line or "moshi" in line]
        waits.append(f"{message}\n" + "".join(stack[-6:]))

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _profiler(torch: Any) -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="personaplex-7b")
    p.add_argument("--live", default="64,128", help="live sessions, each prompted, a row each")
    p.add_argument("--text-tokens", type=int, default=200)
    p.add_argument("--voice-frames", type=int, default=100, help="frames of the .pt voice (8 s)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--prompts", type=int, default=8, help="new prompts per row, then each again (what the cache holds)"
    )
    p.add_argument("--kv-dtype", default="int8", choices=("bf16", "int8"))
    p.add_argument("--device", default="auto")
    p.add_argument("--assets", default="", help="leave the tokenizer and the voice here")
    p.add_argument("--out", default="")
    p.add_argument(
        "--profile", default="",
        help="append here the engine thread's time in the prompt calls by op, and where it waited on the GPU",
    )  # fmt: skip
