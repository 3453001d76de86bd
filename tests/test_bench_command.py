"""``duplexserve bench``: one subcommand per benchmark, each loaded only when chosen."""

from __future__ import annotations

import argparse
import importlib
import itertools
import subprocess
import sys

import pytest

from duplexserve.bench import command


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="duplexserve bench")
    command.add_arguments(parser)
    return parser.parse_args(argv)


def test_bare_bench_is_the_suite_and_its_options_go_before_or_after_the_names():
    assert vars(parse("--short")) == {"benchmark": None, "short": True}
    args = parse("--short", "burst", "ws", "--out", "x")
    assert (args.benchmark, args.more, args.short, args.out) == ("burst", ["ws"], True, "x")
    assert not hasattr(parse("rtf"), "short")  # unset: the suite fills in its defaults


def test_each_benchmark_keeps_its_own_options():
    args = parse("vllm-side-by-side", "run", "--reps", "1")
    assert (args.part, args.reps, args.out) == ("run", 1, "bench-out/vllm-omni")
    args = parse("moshi-rtf", "--sessions", "192", "--engine-process")
    assert (args.sessions, args.engine_process, args.preset) == ([192], True, "hibiki-2b-class")
    assert parse("moshi-rtf", "--sessions", "384,448").sessions == [384, 448]
    assert parse("codec-costs", "--opus-encoders").opus_encoders


def test_moshi_rtf_takes_serves_option_names_and_gives_the_serve_command_it_starts():
    """A setup reads the same in ``bench moshi-rtf`` and ``serve``: serve's names set the same
    options as the bench's own, and the serve command it prints is one ``serve`` parses into
    that setup (engine options at serve's defaults left out)."""
    from duplexserve.bench.moshi import serve_arguments
    from duplexserve.config import ServerConfig

    own = parse("moshi-rtf", "--preset", "hibiki-zero-3b", "--kv-dtype", "int8", "--tick-ms", "80")
    serves = parse("moshi-rtf", "--moshi-preset", "hibiki-zero-3b", "--moshi-kv-dtype", "int8",
                   "--engine-tick-ms", "80")  # fmt: skip
    assert vars(own) == vars(serves)
    args = parse("moshi-rtf", "--moshi-preset", "hibiki-zero-3b", "--moshi-kv-dtype", "int8",
                 "--sessions", "384,448", "--engine-process", "--mimi-convs", "fused-cl")  # fmt: skip
    argv = serve_arguments(args)
    assert argv == [
        "serve", "--engine", "moshi", "--moshi-preset", "hibiki-zero-3b", "--moshi-kv-dtype", "int8",
        "--moshi-mimi-convs", "fused-cl", "--max-sessions", "448", "--engine-process",
        "--port", "18990", "--idle-timeout-s", "120",
    ]  # fmt: skip
    serve_parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(serve_parser)
    config = ServerConfig.from_namespace(serve_parser.parse_args(argv[1:]))
    setup = (config.engine, config.moshi_preset, config.max_sessions, config.engine_process)
    assert setup == ("moshi", "hibiki-zero-3b", 448, True)
    engine = (config.moshi_kv_dtype, config.moshi_mimi_convs, config.moshi_attention)
    assert engine == ("int8", "fused-cl", "live")


def test_every_benchmark_names_functions_that_exist():
    for name, bench in command.BENCHMARKS.items():
        module = importlib.import_module(f"duplexserve.bench.{bench.module}")
        assert callable(getattr(module, bench.add)) and callable(getattr(module, bench.run)), name


def test_serve_imports_neither_loadgen_nor_bench():
    code = (
        "import sys\n"
        "import duplexserve.server.run as run\n"
        "from duplexserve import cli\n"
        "run.serve = lambda config, sock: sock.close()\n"
        "cli.main(['serve', '--port', '0'])\n"
        "tools = ('duplexserve.loadgen', 'duplexserve.bench')\n"
        "print(sorted(m for m in sys.modules if m.startswith(tools)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_moshi_rtf_runs_each_count_twice_on_one_server_and_counts_each_run_apart(tmp_path):
    """``--sessions 1,2 --runs 2``: one server start (of 2 slots), a summary a run, each from
    its own clients and the server's counters over that run only (the synthetic engine)."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rtf.jsonl"
    argv = ["moshi-rtf", "--synthetic-step-ms", "5", "--sessions", "1,2", "--seconds", "2", "--runs", "2",
            "--port", str(port), "--out", str(out)]  # fmt: skip
    cmd = [sys.executable, "-m", "duplexserve", "bench", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    serve = "duplexserve serve --engine synthetic --step-base-ms 5 --max-sessions 2"
    serve += f" --port {port} --idle-timeout-s 120"
    assert done.stdout.splitlines()[0] == f"serve command: {serve}"
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(run["serve"] == serve for run in runs)
    assert [run["sessions"] for run in runs] == [1, 1, 2, 2]
    assert runs[0]["startup_s"] > 0 and all(run["startup_s"] == 0 for run in runs[1:])
    for run in runs:
        assert run["complete_sessions"] == run["sessions"] and not run["errors"], run
        assert run["frames"] == run["sessions"] * 25  # 2 s of 80 ms frames, each session's own
        assert run["steps"] >= 25  # at least a step a frame of its 2 s
    # the server's counters over each run alone: a run is not the one before plus its own
    for a, b in (runs[:2], runs[2:]):
        assert abs(a["steps"] - b["steps"]) <= 10, (a["steps"], b["steps"])


def test_moshi_step_breakdown_builds_the_listed_engines_or_every_combination():
    from duplexserve.bench import moshi_step

    parser = argparse.ArgumentParser()
    moshi_step.add_arguments(parser)
    combos = moshi_step.breakdown_builds(parser.parse_args(["breakdown", "--depformer", "lean,stock"]))
    rest = ("live", "float32", "whole", "fused")
    assert combos == [
        ("stock", "lean", *rest), ("stock", "stock", *rest), ("live", "lean", *rest), ("live", "stock", *rest)
    ]
    library, ours = "stock/stock/stock/float32/parts/stock", "live/lean/live/float32/whole/fused"
    assert moshi_step.breakdown_builds(parser.parse_args(["breakdown", "--builds", f"{library},{ours}"])) == [
        tuple(library.split("/")), tuple(ours.split("/"))
    ]
    with pytest.raises(SystemExit):
        moshi_step.breakdown_builds(parser.parse_args(["breakdown", "--builds", "stock/lean"]))


def test_moshi_step_kernels_counts_what_the_lean_depformer_leaves_out():
    """``bench moshi-step kernels``: one depformer step of tiny-zero, two layers deep, launches
    the Triton kernels the engine's CUDA path would (its norms, each with the residual add before
    it, and one ring read a layer and codebook step), none of the library's one-tensor ``cat``s or
    ring-end moves, and under half stock moshi's kernels."""
    from duplexserve.bench import moshi_step

    parser = argparse.ArgumentParser()
    moshi_step.add_arguments(parser)
    stock, lean = moshi_step.cmd_kernels(
        parser.parse_args(["kernels", "--preset", "tiny-zero", "--depformer-layers", "2"])
    )
    steps = 2 * 16  # layers x codebook steps
    assert stock["triton"] == {} and stock["torch_ops"]["aten::cat"] >= 3 * steps
    # every residual add but the last layer's feed-forward one goes into the norm after it
    assert lean["triton"] == {"rms_norm": 16, "add_rms_norm": 2 * steps - 16, "ring_attention": steps}
    assert lean["torch_ops"]["aten::add"] == 16 + 2 * 16  # and two a codebook step outside the layers
    assert lean["torch_ops"].get("aten::cat", 0) <= 1 and "aten::add_" not in lean["torch_ops"]
    assert lean["kernels"] < stock["kernels"] / 2


def test_moshi_step_sass_reads_the_int8_kernels_loop():
    """``bench moshi-step sass``: the int8 tensor-core kernel compiled for sm_90 here, its main
    loop on the tensor cores, no spill, and the accumulators' rescale a block the usual tile skips."""
    pytest.importorskip("triton")
    from duplexserve.bench import moshi_step

    parser = argparse.ArgumentParser()
    moshi_step.add_arguments(parser)
    ring, paged = moshi_step.cmd_sass(parser.parse_args(["sass", "--kv-dtype", "int8"]))
    for row in (ring, paged):
        opcodes = dict(row["top_opcodes"])
        assert row["kernel"] == "512/16/1/3/mma" and row["stack_bytes"] == 0 and opcodes["HMMA"] > 0
        assert row["loop_skippable"] > 0
        assert row["loop_common_path"] + row["loop_skippable"] == row["loop_instructions"]
    # paged KV: a chunk's page found before the loop, the loop no longer than the ring's
    assert (ring["paged"], paged["paged"]) == (False, True)
    assert paged["loop_instructions"] <= ring["loop_instructions"]


def test_moshi_step_moves_times_a_slots_export_and_import_at_each_age():
    """``bench moshi-step moves``: the state's bytes grow with the age by one KV slot a frame
    of every layer (at a 64-frame context, capped there), and each call is timed."""
    from duplexserve.bench import moshi_step

    parser = argparse.ArgumentParser()
    moshi_step.add_arguments(parser)
    args = ["moves", "--preset", "tiny", "--batches", "2", "--ages", "4,14,100", "--context", "64"]
    young, older, full = moshi_step.cmd_moves(parser.parse_args([*args, "--steps", "1"]))
    per_frame = 2 * 2 * 64 * 4  # layers x K and V x dim x float32
    assert abs(older["bytes"] - young["bytes"] - 10 * per_frame) <= 64  # the header, padded to 8 bytes
    assert abs(full["bytes"] - young["bytes"] - (64 - 4) * per_frame) <= 64
    assert all(row[key] > 0 for row in (young, older) for key in ("export_ms", "import_ms", "step_ms"))


def test_moshi_step_puts_the_rows_at_their_age_past_their_pending_resets():
    """Every row is due a reset after the warm-up and after each resize: set before the
    step that takes it, the age would be lost and the breakdown would time newborn rows."""
    import numpy as np

    from duplexserve.bench import moshi_step
    from tests.test_moshi_row_buckets import make_engine

    engine = make_engine()
    for slots in (np.arange(6), np.arange(3)):  # the warm-up's resets, then a resize's
        if len(slots) != engine.num_slots:
            engine.resize(len(slots))
        frames = np.zeros((len(slots), engine.frame_samples), np.float32)
        moshi_step.at_age(engine, slots, frames, 7)
        engine.step(slots, frames)
        offsets = engine.lm_gen.lm_model.transformer._streaming_state.offsets
        assert offsets[engine.rows_of(slots)].tolist() == [8] * len(slots)


def test_moshi_first_traffic_walks_every_batch_size_up_and_down_and_never_idles():
    """The schedule: N at once, leaving one at a time; then N - 2 joining and leaving one at
    a time, the batch never empty between the first start and the last end, never past N."""
    from duplexserve.bench.moshi_first_traffic import schedule

    n, step = 12, 0.05
    plan = schedule(n, burst_s=1.0, step_s=step)
    assert [p for p, _, _ in plan] == ["burst"] * n + ["walk"] * (n - 2)
    edges = sorted({t for _, start, seconds in plan for t in (start, start + seconds)})
    mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    live = [sum(start <= t < start + seconds for _, start, seconds in plan) for t in mids]
    assert min(live) >= 1 and max(live) == n
    peak = live.index(n)
    walk = live[live.index(1, peak) :]  # from the burst's last session on
    top = walk.index(n - 2)
    assert set(range(1, n - 1)) <= set(walk[: top + 1])  # up through every count
    assert set(range(1, n - 1)) <= set(walk[top:]) and walk[-1] == 1  # and down again


def test_moshi_first_traffic_runs_against_a_fresh_server_at_its_defaults(tmp_path):
    """One fresh server (the synthetic engine), no warm-up batch: every session completes
    and the summary counts late frames by phase, long steps, and start to ready."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "first.jsonl"
    argv = ["moshi-first-traffic", "--synthetic-step-ms", "5", "--sessions", "4", "--burst-s", "1",
            "--step-s", "0.1", "--port", str(port), "--out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "duplexserve", "bench", *argv], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert run["serve"].endswith(f"--max-sessions 4 --port {port} --idle-timeout-s 120")
    assert run["sessions"] == run["complete_sessions"] == 6 and run["errors"] == 0, run
    assert run["startup_s"] > 0 and run["steps"] > 0
    assert set(run["steps_over_ms"]) == {"80", "100", "200"}
    assert run["late_frames"] == run["burst_late_frames"] + run["walk_late_frames"]


def test_moshi_rtf_mixed_draws_long_tailed_calls_that_keep_about_n_open():
    """``--mixed-mean-s``: lognormal lengths of that mean (a tail past three times it), Poisson
    arrivals keeping about N open, calls cut at the run's end."""
    import numpy as np

    from duplexserve.bench.moshi import mixed_calls, peak_live

    calls = mixed_calls(200, 480.0, 180.0, 1.0, seed=0)
    starts, lengths = np.array(calls).T
    assert (starts[:200] < 2.0).all() and (starts + lengths <= 480.0 + 1e-9).all() and lengths.min() >= 1.0
    open_at = [((starts <= t) & (starts + lengths > t)).sum() for t in (120, 240, 360)]
    assert all(150 < n < 250 for n in open_at), open_at
    assert 200 <= peak_live(calls) < 260
    uncut = np.array(mixed_calls(200, 1e6, 180.0, 1.0, seed=0))[:, 1]  # nothing cut: the draw itself
    assert 160 < uncut.mean() < 200 and (uncut > 600).mean() > 0.02


def test_moshi_rtf_mixed_runs_calls_of_many_lengths_through_the_server(tmp_path):
    """A mixed run against the synthetic engine: every call streams its own length to the end,
    none refused, and the summary says what the workload was."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rtf.jsonl"
    argv = ["moshi-rtf", "--synthetic-step-ms", "5", "--sessions", "3", "--seconds", "6",
            "--mixed-mean-s", "2", "--slots", "12", "--port", str(port), "--out", str(out)]  # fmt: skip
    cmd = [sys.executable, "-m", "duplexserve", "bench", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--max-sessions 12" in done.stdout.splitlines()[0]
    (run,) = [json.loads(line) for line in out.read_text().splitlines()]
    mixed = run["mixed"]
    assert mixed["calls"] > 3 and mixed["slots"] == 12 and mixed["length_s_max"] <= 6
    assert run["complete_sessions"] == mixed["calls"] and not run["errors"] and run["sessions_refused"] == 0
    assert run["kv_context_stops"] == 0
