"""PNG plots of a run or a sweep (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from duplexserve.loadgen.results import RunResult


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(results: Sequence[RunResult], path: str | Path, title: str = "frame round trip") -> Path:
    """Cumulative distribution of frame round trips, one curve per run, log x axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        rt = np.sort(r.round_trips().astype(np.float64)) * 1e3
        if not len(rt):
            continue
        ax.plot(rt, np.arange(1, len(rt) + 1) / len(rt), label=r.label, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("round trip (ms)")
    ax.set_ylabel("fraction of frames")
    ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def rtf_per_session(results: Sequence[RunResult], path: str | Path, title: str = "RTF per session") -> Path:
    """Each session's RTF, sorted, per run; 1.0 is real time."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        rtf = np.sort(np.array([s.rtf for s in r.sessions], dtype=np.float64))
        ax.plot(np.arange(len(rtf)), rtf, marker=".", linestyle="-", linewidth=0.8, label=r.label)
    ax.axhline(1.0, color="red", linewidth=0.8, linestyle="--", label="real time")
    ax.set_xlabel("session (sorted by RTF)")
    ax.set_ylabel("RTF")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def sweep(
    series: dict[str, Sequence[tuple[int, float, float]]], path: str | Path, title: str = "sweep"
) -> Path:
    """RTF (median) and p99 round trip against concurrency; ``series`` maps a name to (c, rtf, p99 ms)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, points in series.items():
        pts = sorted(points)
        c = [p[0] for p in pts]
        ax1.plot(c, [p[1] for p in pts], marker="o", label=name)
        ax2.plot(c, [p[2] for p in pts], marker="o", label=name)
    ax1.axhline(1.0, color="red", linewidth=0.8, linestyle="--")
    ax1.set_xlabel("concurrent sessions")
    ax1.set_ylabel("median RTF")
    ax2.set_xlabel("concurrent sessions")
    ax2.set_ylabel("p99 round trip (ms)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def bars(values: dict[str, float], path: str | Path, ylabel: str, title: str) -> Path:
    """One bar per variant (for side-by-side costs)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(values)
    colors = ["#6b8e23", "#4682b4", "#cd5c5c", "#daa520"][: len(names)]
    ax.bar(names, [values[n] for n in names], color=colors)
    for i, n in enumerate(names):
        ax.text(i, values[n], f"{values[n]:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:  # type: ignore[no-untyped-def]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
