"""``duplexserve loadgen``: drive a server, print the summary, write JSON and plots."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from duplexserve.loadgen.drivers import available
from duplexserve.loadgen.expect import server_expect
from duplexserve.loadgen.summary_columns import legend

#: The console's width when the output is not a terminal and $COLUMNS does not say: a wider
#: summary turns to one row per figure, a column per run, every value whole.
PIPED_WIDTH = 120
#: The width of the columns' legend in ``--help``.
HELP_WIDTH = 79


def _count(value: str) -> str:
    """A count, or a multiple of the concurrency written like ``2x``."""
    text = value.strip().lower()
    number = text[:-1] if text.endswith("x") else text
    try:
        if float(number) < 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or a multiple like 2x, got {value!r}") from None
    return text


def resolve(count: str, concurrency: int) -> int:
    if count.endswith("x"):
        return max(0, round(float(count[:-1]) * concurrency))
    return int(float(count))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = f"The summary's columns (printed under it too):\n{legend(HELP_WIDTH)}"
    p.add_argument("url", help="server address, e.g. ws://127.0.0.1:8998 (the protocol's path is added)")
    p.add_argument("--protocol", default="native", choices=available(), help="client driver")
    p.add_argument("-c", "--concurrency", default="8",
                   help="sessions at once; a comma list (64,96,128) runs a sweep")
    p.add_argument("-n", "--sessions", type=_count, default="1x",
                   help="measured sessions in all, or a multiple of the concurrency (2x)")
    p.add_argument("--warmup", type=_count, default="0",
                   help="warm-up sessions run first and not measured (1x: one batch)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, help="audio per session in seconds")
    length.add_argument("--frames", type=int, help="audio per session in 80 ms frames (default 125)")
    p.add_argument("--message-ms", type=int, default=80,
                   help="audio per message in ms, any whole number: 20 and 40 as browsers and phones send, "
                        "80 one model frame, 160 two")
    p.add_argument("--mode", choices=("paced", "burst"), default="paced",
                   help="paced: real time on an absolute schedule; burst: as fast as the socket takes it")
    p.add_argument("--input-format", default="pcm_f32le",
                   help="audio sent: pcm_f32le, pcm_s16le, g711_ulaw, g711_alaw or opus (docs/protocol.md)")
    p.add_argument("--input-rate", type=int, default=24000, help="sample rate of the audio sent")
    p.add_argument("--output-format", default="pcm_f32le", help="audio asked of the server")
    p.add_argument("--output-rate", type=int, default=24000, help="sample rate asked of the server")
    p.add_argument("--wav", help="audio to send (looped or cut to length); default a generated signal")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated signal and of the send times")
    p.add_argument("--processes", type=int, default=1, help="client processes")
    p.add_argument("--ramp-s", type=float, help="spread session starts over this long (default: auto: "
                   "paced, concurrency / 150 s and at least 0.1 s, about 150 handshakes a second, so that "
                   "the connection storm does not dominate the latency measured; burst, 0, all at once)")
    p.add_argument("--expect", choices=("auto", "echo", "silence", "none"), default="auto",
                   help="what the server's engine answers, checked byte for byte unless none; auto: "
                        "echo against the synthetic engine or an echo floor, none against a real model "
                        "(whose answers are counted and timed only), as the server's GET /ready tells")
    p.add_argument("--delay-frames", type=int, default=0,
                   help="the synthetic engine's --delay-frames (its echo comes this many frames late)")
    p.add_argument("--playback-buffer-frames", type=int, default=1,
                   help="player buffer for counting underruns (see docs/benchmarks.md)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="connect and final-answer timeout")
    p.add_argument("--drop-every", type=float, default=0.0,
                   help="native: cut each session's TCP connection at random moments about this often "
                        "(seconds), resume it and go on; guards check every frame came once, in order")
    p.add_argument("--follow-moves", action="store_true",
                   help="native: follow session.moved (a drained replica's sessions moving to a peer): "
                        "resume at the same URL with its token, send again what the server did not take")
    p.add_argument("--text-prompt", default="",
                   help="every session's text prompt (PersonaPlex's persona; Realtime: its instructions); "
                        "{session} in it becomes the session's number, a prompt the server has not seen")
    p.add_argument("--voice-prompt", default="",
                   help="every session's voice prompt, a name the server lists at GET /v1/voices (NATF2.pt)")
    p.add_argument("--arrivals-per-s", type=float, default=0.0,
                   help="paced: sessions joining a second, each replacing one that ends, the concurrency "
                        "staying live (session lengths follow from it; --frames/--seconds are ignored)")
    p.add_argument("--loss", type=float, default=0.0,
                   help="webrtc: share of the RTP packets sent that this side drops (0.05: 5%%; "
                        "needs --expect none, the server's concealment is not predictable)")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="webrtc: hold each RTP packet sent 0 to this long, so packets overtake each other")
    p.add_argument("--opus-complexity", type=int, default=5,
                   help="webrtc: the server's --opus-complexity (its answers are replayed with it)")
    p.add_argument("--webrtc-output-fec", action="store_true",
                   help="webrtc: the server runs with --webrtc-output-fec (its answers are replayed with it)")
    p.add_argument("--webrtc-packet-ms", type=int, default=80, choices=(20, 40, 80),
                   help="webrtc: the Opus packets asked of the server (the offer's a=maxptime; not above "
                        "the server's own --webrtc-packet-ms)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plots", help="write PNG plots into this folder")
    p.add_argument("--no-progress", action="store_true", help="no live display")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape the server's /metrics")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console  # the [loadgen] extra: where it is missing, cli.py says so

    if args.plots:
        import matplotlib  # noqa: F401  (missing: said before the run, not after it)

    from duplexserve.loadgen import plots
    from duplexserve.loadgen.report import LiveView, print_report, write_json
    from duplexserve.loadgen.runner import LoadSpec, run_load

    # Piped into a file, every value whole: no terminal to fit, the table as wide as it needs.
    console = Console(width=None if Console().is_terminal or "COLUMNS" in os.environ else PIPED_WIDTH)
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        console.print(f"bad --concurrency {args.concurrency!r}", style="red", markup=False)
        return 2
    expect = args.expect
    if expect == "auto":
        expect, why = server_expect(args.url, args.timeout_s)
        console.print(f"--expect {expect}: {why}", markup=False)
    frames = args.frames if args.frames else round(args.seconds * 12.5) if args.seconds else 125
    results = []
    for concurrency in levels:
        spec = LoadSpec(
            url=args.url, protocol=args.protocol, concurrency=concurrency,
            sessions=resolve(args.sessions, concurrency), warmup=resolve(args.warmup, concurrency),
            frames=frames, message_ms=args.message_ms, paced=args.mode == "paced",
            input_format=args.input_format, input_rate=args.input_rate,
            output_format=args.output_format, output_rate=args.output_rate, wav=args.wav,
            seed=args.seed, processes=args.processes, ramp_s=args.ramp_s, expect=expect,
            delay_frames=args.delay_frames, playback_buffer_frames=args.playback_buffer_frames,
            timeout_s=args.timeout_s, scrape_metrics=not args.no_metrics, drop_every=args.drop_every,
            follow_moves=args.follow_moves,
            text_prompt=args.text_prompt, voice_prompt=args.voice_prompt, arrivals_per_s=args.arrivals_per_s,
            loss=args.loss, jitter_ms=args.jitter_ms, opus_complexity=args.opus_complexity,
            opus_output_fec=args.webrtc_output_fec, webrtc_packet_ms=args.webrtc_packet_ms,
        )
        try:
            spec.validate()
        except ValueError as exc:
            console.print(str(exc), style="red", markup=False)
            return 2
        with LiveView(console, not args.no_progress) as view:
            results.append(run_load(spec, view.update))
    print_report(console, results)
    if args.json:
        write_json(args.json, results)
        console.print(f"wrote {args.json}")
    if args.plots:
        out = Path(args.plots)
        written = [plots.latency_cdf(results, out / "latency_cdf.png"),
                   plots.rtf_per_session(results, out / "rtf_per_session.png")]
        if len(results) > 1:
            points = [(r.config["concurrency"], r.summary()["rtf_median"], r.summary()["rt_p99_ms"])
                      for r in results]
            written.append(plots.sweep({"server": points}, out / "sweep.png", "RTF and p99 by concurrency"))
        console.print("plots: " + ", ".join(str(p) for p in written))
    return 0 if all(r.guards_ok for r in results) else 1
