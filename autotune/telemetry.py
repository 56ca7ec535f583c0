"""Wires the monitors to a running engine: the sampler thread and the latest Observation."""

from __future__ import annotations

import logging
import threading
import time

from engine.engine import Engine
from engine.http.state import ServerState
from engine.stats import LatencyHistograms
from monitors.gpu import GpuMonitor
from monitors.observation import Observation
from monitors.sampler import EngineReading, Sampler

log = logging.getLogger("selftune.telemetry")


class Telemetry:
    """Samples every `interval` seconds on its own thread; `latest` is the newest Observation."""

    def __init__(self, engine: Engine, state: ServerState | None = None, interval: float = 1.0, window: float = 10.0, gpu: GpuMonitor | None = None):
        self.engine = engine
        self.state = state
        self.interval = interval
        self.sampler = Sampler(self.reading, window_seconds=window, gpu=gpu)
        self.latest: Observation | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listeners: list = []
        """Callables given each new Observation (the controller subscribes here)."""

    def reading(self) -> EngineReading:
        state = self.state
        return EngineReading(
            stats=self.engine.stats(),
            latency=self.engine.latency.snapshot(),
            upper_bounds=LatencyHistograms.upper_bounds(),
            rejected=state.admission.rejected if state else 0,
            timed_out=state.timed_out if state else 0,
        )

    def sample_now(self) -> Observation:
        observation = self.sampler.sample(time.monotonic())
        self.latest = observation
        for listener in list(self.listeners):
            listener(observation)
        return observation

    def start(self) -> "Telemetry":
        self._thread = threading.Thread(target=self._run, name="selftune-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_now()
            except Exception:
                log.exception("sampling failed; the next interval tries again")
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))
