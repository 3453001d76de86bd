"""Where a moshi engine's start goes (issue 56): ``engine.start()`` under cProfile, its phases
as the log prints them, then the functions that took the time. Run it twice on a fresh GPU
machine to see the compile caches' share: the first start compiles, the second reads them.

    python3 scripts/profile-start.py --preset hibiki-zero-3b --kv-dtype int8 --slots 336 --out OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

from duplexserve.engine_bridge.moshi.engine import MoshiEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="hibiki-zero-3b")
    p.add_argument("--kv-dtype", default="int8")
    p.add_argument("--slots", type=int, default=336)
    p.add_argument("--out", type=Path, help="write the profile here (start.prof, start.txt)")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    engine = MoshiEngine(args.slots, args.preset, kv_dtype=args.kv_dtype)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.runcall(engine.start)
    took = time.perf_counter() - started
    phases = ", ".join(f"{name} {s:.1f} s" for name, s in engine.start_phases.items())
    text = io.StringIO()
    print(f"started in {took:.1f} s under cProfile: {phases}", file=text)
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top // 2)
    print(text.getvalue())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(args.out / "start.prof")
        (args.out / "start.txt").write_text(text.getvalue())
    engine.stop()


if __name__ == "__main__":
    main()
