"""Prometheus metrics, read from plain counters at scrape time.

The hot path only bumps integer attributes; nothing per frame takes a metrics lock.
Histograms are observed once per engine step, on the engine thread.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from duplexserve.engine_bridge.bridge import RESTART_CAUSES, StepOutput
from duplexserve.server.core.audio_refusals import AudioRefusalCollector
from duplexserve.server.core.budgets import BudgetCollector
from duplexserve.server.core.orchestrator import Orchestrator
from duplexserve.server.core.turnaround import BUCKETS as TURNAROUND_BUCKETS
from duplexserve.server.gc_pauses import GcPauses

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.2)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 512)
#: Session end reasons exported from the start, at 0: an alert's rate() over them has a series
#: before the first session ends (the error ones are what deploy/kubernetes alerts on).
ALWAYS_ENDED = ("completed", "engine_error", "internal_error")
LOOP_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16)


class ServerCollector(Collector):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orch = orchestrator

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        orch, counts, bridge = self.orch, self.orch.counts, self.orch.bridge.counts
        live = orch.sessions()
        yield GaugeMetricFamily(
            "duplexserve_sessions_detached", "sessions waiting for a resume, holding their slot",
            orch.resume.detached,
        )
        resumes = CounterMetricFamily(
            "duplexserve_session_resumes",
            "resume outcomes: resumed, expired, refused, evicted",
            labels=["outcome"],
        )
        rc = orch.resume.counts
        for outcome, value in (
            ("resumed", rc.resumed), ("expired", rc.expired), ("refused", rc.refused), ("evicted", rc.evicted)
        ):
            resumes.add_metric([outcome], value)
        yield resumes
        turn = orch.turnaround
        cumulative = turn.buckets.cumsum().tolist()
        bounds = [*(str(b) for b in TURNAROUND_BUCKETS), "+Inf"]
        yield HistogramMetricFamily(
            "duplexserve_frame_turnaround_seconds",
            "input message received to output frame handed to the socket (flushed every 256 frames)",
            buckets=list(zip(bounds, cumulative, strict=True)), sum_value=turn.sum_s,
        )
        yield CounterMetricFamily(
            "duplexserve_frames_late", "output frames whose turnaround was over --late-frame-ms",
            value=turn.late,
        )
        yield GaugeMetricFamily("duplexserve_sessions_active", "sessions holding a slot", orch.active)
        # The fleet's capacity for autoscaling and dashboards: sum(active) / sum(max) (deploy/).
        yield GaugeMetricFamily(
            "duplexserve_max_sessions", "engine slots: the most sessions held at once", orch.engine.num_slots
        )
        yield GaugeMetricFamily(
            "duplexserve_draining", "1 from SIGTERM on: no new sessions, live ones finish", int(orch.draining)
        )
        yield from orch.readiness.collect()
        yield GaugeMetricFamily("duplexserve_ready", "1 when new sessions are admitted", int(orch.ready))
        yield GaugeMetricFamily(
            "duplexserve_engine_queue_depth", "items in the engine queue", orch.bridge.qsize()
        )
        for name, help_text, value in (
            ("sessions_accepted", "sessions admitted", counts.sessions_accepted),
            ("sessions_rejected", "sessions refused (full or draining)", counts.sessions_rejected),
            ("sessions_closed", "sessions ended", counts.sessions_closed),
            ("frames_in", "input frames accepted", counts.frames_in + sum(s.frames_in for s in live)),
            ("frames_out", "output frames answered", counts.frames_out + sum(s.frames_out for s in live)),
            ("frames_dropped", "accepted frames never answered", counts.frames_dropped),
            ("queue_fast_puts", "frames handed to the engine without waiting", bridge.fast_puts),
            ("queue_puts", "janus puts (one per loop iteration with items)", bridge.queue_puts),
            ("queue_full_waits", "frames that waited on the loop for room in the engine queue",
             bridge.full_waits),
            ("queue_slow_puts", "engine queue puts sent through the executor overflow", bridge.slow_puts),
            ("executor_submissions", "thread-pool hops made by the server", bridge.executor_submissions),
            ("loop_wakeups", "wake-ups of the loop by the engine thread", bridge.loop_wakeups),
            ("engine_steps", "engine steps", bridge.steps),
            ("engine_frames", "frames the engine stepped", bridge.frames_stepped),
            ("engine_catchup_steps", "clock steps for frames that missed their tick", bridge.catch_up_steps),
            ("engine_catchup_frames", "frames that missed their tick", bridge.catch_up_frames),
            ("engine_gather_waits", "waits of a step for frames due within it (--engine-gather)",
             bridge.gather_waits),
            ("engine_gather_wait_seconds", "time steps waited for frames due within them",
             bridge.gather_wait_s),
            ("engine_errors", "engine failures", bridge.engine_errors),
            ("engine_restarts", "engine restarts after a failure or a stall", bridge.engine_restarts),
            ("engine_kv_context_stops", "calls whose KV context stopped growing for want of memory (paged"
             " KV; they go on at the context they hold)", bridge.kv_context_stops),
        ):
            yield CounterMetricFamily(f"duplexserve_{name}", help_text, value=value)
        by_reason = CounterMetricFamily(
            "duplexserve_sessions_ended", "sessions ended, by their session.closed reason", labels=["reason"]
        )
        for reason, value in sorted({**dict.fromkeys(ALWAYS_ENDED, 0), **counts.ended}.items()):
            by_reason.add_metric([reason], value)
        yield by_reason
        failures = CounterMetricFamily(
            "duplexserve_output_failures",
            "sessions ended with internal_error because their output could not be rendered "
            "(stage: engine, a text piece; loop, handing the answer to the session)",
            labels=["stage"],
        )
        failures.add_metric(["engine"], bridge.output_failures)
        failures.add_metric(["loop"], counts.output_failures)
        yield failures
        ended = CounterMetricFamily(
            "duplexserve_engine_restart_sessions_ended",
            "sessions ended with engine_error because the engine that held their model state failed "
            "and was restarted, by cause (step_failed, engine_died, stalled)",
            labels=["cause"],
        )
        for cause in RESTART_CAUSES:
            ended.add_metric([cause], bridge.sessions_ended_by_restart[cause])
        yield ended
        usage = resource.getrusage(resource.RUSAGE_SELF)
        yield CounterMetricFamily(
            "duplexserve_voluntary_context_switches", "voluntary context switches, all threads",
            value=usage.ru_nvcsw,
        )
        yield CounterMetricFamily(
            "duplexserve_involuntary_context_switches", "involuntary context switches, all threads",
            value=usage.ru_nivcsw,
        )
        yield CounterMetricFamily(
            "duplexserve_cpu_seconds", "process CPU time, user + system",
            value=usage.ru_utime + usage.ru_stime,
        )


class CodecProcessesCollector(Collector):
    """CPU of the Opus codec worker processes, which ``duplexserve_cpu_seconds`` leaves out."""

    def __init__(self, cpu_seconds: Callable[[], float]) -> None:
        self.cpu_seconds = cpu_seconds

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "duplexserve_codec_processes_cpu_seconds", "codec worker processes CPU time, user + system",
            value=self.cpu_seconds(),
        )


class Metrics:
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(ServerCollector(orchestrator))
        self.registry.register(BudgetCollector())
        self.registry.register(AudioRefusalCollector())
        self.step_seconds = Histogram(
            "duplexserve_engine_step_seconds", "engine step duration",
            buckets=STEP_BUCKETS, registry=self.registry,
        )
        self.batch_size = Histogram(
            "duplexserve_engine_batch_size", "sessions per engine step",
            buckets=BATCH_BUCKETS, registry=self.registry,
        )
        self.loop_pickup = self._loop_histogram(
            "duplexserve_loop_pickup_seconds",
            "an engine step's results waiting for the event loop to take them",
        )
        self.answer_dispatch = self._loop_histogram(
            "duplexserve_answer_dispatch_seconds",
            "the event loop handing one wake-up's answers to the sessions and their sockets",
        )
        self.tick_lag = self._loop_histogram(
            "duplexserve_engine_tick_lag_seconds",
            "how late after its tick a clock step started (the step before ran long, or a catch-up)",
        )
        self.catch_up_arrival = self._loop_histogram(
            "duplexserve_engine_catchup_arrival_seconds",
            "how long after its due time the latest frame of a catch-up step arrived",
        )
        self.gil_wait = self._loop_histogram(
            "duplexserve_engine_gil_wait_seconds",
            "an engine step's answer waiting for the GIL before the engine thread ran on (engine process)",
        )
        self.gc_pauses = GcPauses(self.registry)

    def _loop_histogram(self, name: str, documentation: str) -> Histogram:
        """A wait of the loop or the engine thread: 0.1 ms to 160 ms (``LOOP_BUCKETS``)."""
        return Histogram(name, documentation, buckets=LOOP_BUCKETS, registry=self.registry)

    def observe_delivery(self, pickup_s: float, dispatch_s: float) -> None:
        self.loop_pickup.observe(pickup_s)
        self.answer_dispatch.observe(dispatch_s)

    def observe_step(self, out: StepOutput) -> None:
        self.step_seconds.observe(out.duration_s)
        self.batch_size.observe(len(out.slots))
        self.gil_wait.observe(out.gil_wait_s)
        if out.catch_up:
            self.catch_up_arrival.observe(out.arrived_past_due_s)
        elif out.tick_lag_s is not None:
            self.tick_lag.observe(out.tick_lag_s)
