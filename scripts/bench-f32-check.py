"""What refusing NaN, inf and huge float32 costs a 1920-sample frame on the zero-copy path
(codecs/pcm.py): each candidate check, timeit best of 7 x 100,000. Run from the repository root:
``PYTHONPATH=. python scripts/bench-f32-check.py`` (docs/benchmarks-history.md)."""

import timeit

import numpy as np

from duplexserve.codecs.pcm import f32_view

b = (np.random.default_rng(0).standard_normal(1920) * 0.1).astype("<f4").tobytes()
v = np.frombuffer(b, dtype="<f4")
B = np.float32(32768.0)
cands = {
    "np.frombuffer alone (before)": lambda: np.frombuffer(b, dtype="<f4"),
    "f32_view (frombuffer + vdot)": lambda: f32_view(b),
    "np.vdot(v, v) <= 2**30": lambda: np.vdot(v, v) <= 2.0**30,
    "np.isfinite(v).all()": lambda: np.isfinite(v).all(),
    "min/max within +-B": lambda: v.min() >= -B and v.max() <= B,
    "np.abs(v).max() <= B": lambda: np.abs(v).max() <= B,
}
for name, f in cands.items():
    t = min(timeit.repeat(f, number=100000, repeat=7)) / 100000
    print(f"{name:30s} {t * 1e6:.2f} us")
