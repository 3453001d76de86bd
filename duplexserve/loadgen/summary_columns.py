"""The summary's columns and what each means: printed under the table and in ``--help``, so a
reader of either knows what RTF or ``exec/frame`` measures without the docs."""

from __future__ import annotations

import textwrap

#: Each column of the summary table, in order, with its meaning.
SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("run", "protocol, paced or burst, c= sessions at once, n= sessions measured, audio per session"),
    ("guards", "ok: every answer frame came once and in order, and (unless --expect none) byte for byte "
               "as predicted; FAIL N: N sessions broke one (the lines below say how)"),
    ("sessions", "sessions measured (warm-up ones left out)"),
    ("frames", "80 ms answer frames received in all"),
    ("RTF min/med/max", "real-time factor of each session: (last answer frame received - first audio sent) "
                        "/ length of the answer; paced, just under 1 keeps up: the last message leaves "
                        "one message before the audio ends, so a session answered at once reads "
                        "1 - message/length, plus its last round trip/length (10 s in 80 ms messages: "
                        "0.992 + round trip/10 s); well above 1 fell behind; burst, below 1 is faster "
                        "than real time"),
    ("ready p50/p99/max ms", "connect to session ready (session.created or the handshake, the prompt run); "
                             "with --arrivals-per-s, of the sessions that joined later"),
    ("rt p50/p99/max ms", "round trip: answer frame i received - input frame i sent"),
    ("late p99 ms", "how far an answer frame came after its playback time (first answer + i x 80 ms)"),
    ("underruns", "answer frames a player with --playback-buffer-frames of buffer would have missed"),
    ("srv us/frame", "the server process's CPU time per frame, from its /metrics before and after "
                     "(- with --no-metrics)"),
    ("vcsw/frame", "the server's voluntary context switches per frame (waits: locks, threads, I/O)"),
    ("exec/frame", "the server's thread-pool submissions per frame (0: no frame left the event loop)"),
    ("wall us/frame", "the run's wall time / frames: the client and server together, all sessions"),
)

COLUMNS = tuple(name for name, _ in SUMMARY_COLUMNS)


def legend(width: int = 0) -> str:
    """The columns' meanings, a line each; ``width``: each wrapped to it, indented after its first line."""
    lines = (f"{name}: {meaning}" for name, meaning in SUMMARY_COLUMNS)
    if width:
        lines = (textwrap.fill(line, width, subsequent_indent="    ") for line in lines)
    return "\n".join(lines)
