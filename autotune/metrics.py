"""GET /metrics: Prometheus text exposition, built at scrape time from what the engine keeps.

A custom collector reads the engine's cumulative counters and latency histograms and the
sampler's latest Observation, so serving a request costs no extra metric work. The front
process's own series (process_*, python_gc_*, python_info) come from prometheus-client's
standard collectors, as every Python exporter has them.
"""

from __future__ import annotations

import numpy as np
import gc

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine.stats import LatencyHistograms

# Every 8th fine bucket edge: powers of two from ~20 µs to ~2700 s (exact, no re-binning error).
_COARSE = np.arange(LatencyHistograms.PER_OCTAVE - 1, LatencyHistograms.COUNT, LatencyHistograms.PER_OCTAVE)


class SelftuneCollector(Collector):
    def __init__(self, telemetry):
        self.telemetry = telemetry

    def collect(self):
        reading = self.telemetry.reading()
        yield from self._requests(reading)
        yield from self._knobs(reading.stats)
        yield from self._kv_cache(reading.stats)
        yield from self._model()
        observation = self.telemetry.latest
        if observation is not None:
            yield from self._workers(observation)
            yield from self._host(observation)
            yield from self._numa(observation)
            yield from self._gpus(observation)

    def _requests(self, reading):
        stats = reading.stats
        c = stats.counters
        outcomes = CounterMetricFamily("selftune_requests", "Requests by outcome", labels=["outcome"])
        for outcome, value in (("completed", c.completed), ("failed", c.failed), ("cancelled", c.cancelled), ("shed", c.shed), ("rejected", reading.rejected), ("timed_out", reading.timed_out)):
            outcomes.add_metric([outcome], value)
        yield outcomes
        yield _counter("selftune_batches", "Batches sent to workers", c.batches)
        yield _gauge("selftune_gc_frozen_objects", "Objects the front process froze out of garbage collection after start-up", gc.get_freeze_count())
        yield _counter("selftune_batch_items", "Items (inputs or sequences) sent in batches", c.items)
        yield _counter("selftune_padded_tokens", "Token slots in embedding batches, padding included", c.padded_tokens)
        yield _counter("selftune_real_tokens", "Input tokens sent to the workers: embedding inputs, or generation prompts", c.real_tokens)
        yield _counter("selftune_generated_tokens", "Tokens generated", c.generated_tokens)
        yield _counter("selftune_worker_deaths", "Workers that died unexpectedly", c.worker_deaths)
        yield _gauge("selftune_queue_depth", "Items waiting in the batcher", stats.queue_depth)
        yield _gauge("selftune_queue_oldest_wait_seconds", "Wait of the oldest queued item", stats.oldest_wait_seconds)
        yield _gauge("selftune_pending_requests", "Requests in the engine", stats.pending_requests)
        histogram = HistogramMetricFamily("selftune_request_duration_seconds", "Request latency by stage", labels=["stage"])
        bounds = reading.upper_bounds
        for stage, (counts, total) in reading.latency.items():
            cumulative = np.cumsum(counts)
            buckets = [(_le(bounds[i]), float(cumulative[i])) for i in _COARSE]
            buckets.append(("+Inf", float(cumulative[-1])))
            histogram.add_metric([stage], buckets, sum_value=total)
        yield histogram

    def _knobs(self, stats):
        knobs = GaugeMetricFamily("selftune_knob", "Current value of each concurrency knob", labels=["name"])
        for name, value in stats.knobs.as_dict().items():
            knobs.add_metric([name], float(value))
        yield knobs
        placement = GaugeMetricFamily("selftune_worker_placement_info", "Where each worker runs (value is always 1)", labels=["worker", "cpus", "node", "gpu"])
        for w in (stats.placement or {}).get("workers", []):
            placement.add_metric([str(w["worker"]), w["cpus"], str(w["node"]), str(w["gpu"])], 1)
        yield placement

    def _kv_cache(self, stats):
        """Generation workers: running and waiting sequences, KV token slots, preemptions."""
        rows = [w for w in stats.workers if w.kv_tokens_total or w.running_sequences or w.waiting_sequences]
        if not rows:
            return
        families = (
            ("running_sequences", GaugeMetricFamily, "selftune_worker_running_sequences", "Sequences in the worker's running batch"),
            ("waiting_sequences", GaugeMetricFamily, "selftune_worker_waiting_sequences", "Sequences waiting in the worker for room"),
            ("kv_tokens_used", GaugeMetricFamily, "selftune_worker_kv_cache_used_tokens", "Token slots the worker's KV cache holds (rows x columns)"),
            ("kv_tokens_total", GaugeMetricFamily, "selftune_worker_kv_cache_capacity_tokens", "Token slots the worker's KV cache may hold"),
            ("preemptions", CounterMetricFamily, "selftune_worker_preemptions", "Sequences preempted to keep the KV cache within its cap"),
        )
        for field, kind, name, doc in families:
            family = kind(name, doc, labels=["worker"])
            for w in rows:
                family.add_metric([str(w.worker_id)], float(getattr(w, field)))
            yield family

    def _model(self):
        """What runs: the model, device and dtype (and how the dtype was chosen), and the
        dtype's measured fidelity and speed against fp32 on the start-up probe set."""
        engine = getattr(self.telemetry, "engine", None)
        if engine is None or getattr(engine, "source", None) is None:
            return
        choice = engine.dtype_choice or {}
        labels = ["model", "task", "device", "dtype", "requested_dtype", "dtype_mode", "backend"]
        info = GaugeMetricFamily("selftune_model_info", "The served model, device, dtype and backend (value is always 1)", labels=labels)
        info.add_metric([engine.source.name, engine.config.task, str(engine.device), str(engine.dtype),
                         str(choice.get("requested", engine.config.dtype)), str(choice.get("mode", "")), str(choice.get("backend", "torch"))], 1)
        yield info
        for key, name, doc in (
            ("min_cosine", "selftune_model_dtype_min_cosine", "Worst cosine of the served dtype's embeddings to fp32's on the start-up probe set (1 for fp32)"),
            ("bf16_min_cosine", "selftune_model_bf16_min_cosine", "Worst cosine of bf16's embeddings to fp32's on the start-up probe set, as probed"),
            ("bf16_speedup", "selftune_model_bf16_speedup_ratio", "bf16's probe batch (generation: decode step) speed over fp32's, measured interleaved at start-up"),
            ("bf16_token_agreement", "selftune_model_bf16_token_agreement_ratio",
             "Generation: share of the probe positions where bf16's greedy next token is fp32's or a near tie of it"),
            ("onnxruntime_min_cosine", "selftune_model_onnxruntime_min_cosine", "Worst cosine of ONNX Runtime's embeddings to torch fp32's on the start-up probe set, as probed"),
            ("onnxruntime_speedup", "selftune_model_onnxruntime_speedup_ratio", "ONNX Runtime's probe batch speed over torch fp32's, measured interleaved at start-up"),
        ):
            if choice.get(key) is not None:
                yield _gauge(name, doc, float(choice[key]))

    def _workers(self, observation):
        families = {
            "busy": GaugeMetricFamily("selftune_worker_busy_ratio", "Share of the window spent in the model", labels=["worker"]),
            "cpu": GaugeMetricFamily("selftune_worker_cpu_ratio", "CPU time per wall second (1.0 = one core)", labels=["worker"]),
            "rss": GaugeMetricFamily("selftune_worker_resident_memory_bytes", "Resident set size", labels=["worker"]),
            "uss": GaugeMetricFamily("selftune_worker_unique_memory_bytes", "Memory only this worker holds (USS)", labels=["worker"]),
            "threads": GaugeMetricFamily("selftune_worker_threads", "OS threads", labels=["worker"]),
            "load": GaugeMetricFamily("selftune_worker_load", "Batches or sequences the worker holds", labels=["worker"]),
        }
        for w in observation.workers:
            label = [str(w.worker_id)]
            families["busy"].add_metric(label, w.busy_fraction)
            families["load"].add_metric(label, w.load)
            for key, value in (("cpu", None if w.cpu_percent is None else w.cpu_percent / 100), ("rss", w.rss_bytes), ("uss", w.uss_bytes), ("threads", w.threads)):
                if value is not None:
                    families[key].add_metric(label, value)
        yield from families.values()

    def _host(self, observation):
        host = observation.host
        if host is None:
            return
        if host.cpus is not None:
            cpu = GaugeMetricFamily("selftune_host_cpu_utilization_ratio", "Per-core busy share since the last sample", labels=["cpu"])
            steal = GaugeMetricFamily("selftune_host_cpu_steal_ratio", "Per-core share stolen by the hypervisor", labels=["cpu"])
            for util in host.cpus:
                cpu.add_metric([str(util.cpu)], util.busy)
                if util.steal is not None:
                    steal.add_metric([str(util.cpu)], util.steal)
            yield cpu
            yield steal
        if host.mem_available_bytes is not None:
            yield _gauge("selftune_host_memory_available_bytes", "MemAvailable from /proc/meminfo", host.mem_available_bytes)
        if host.mem_total_bytes is not None:
            yield _gauge("selftune_host_memory_total_bytes", "MemTotal from /proc/meminfo", host.mem_total_bytes)
        if host.load_avg is not None:
            yield _gauge("selftune_host_load1", "1-minute load average", host.load_avg[0])
        if host.ctx_switches_per_s is not None:
            yield _gauge("selftune_host_context_switches_per_second", "Context switches per second", host.ctx_switches_per_s)

    def _numa(self, observation):
        total = GaugeMetricFamily("selftune_numa_memory_total_bytes", "Memory of the NUMA node", labels=["node"])
        free = GaugeMetricFamily("selftune_numa_memory_free_bytes", "Free memory of the NUMA node", labels=["node"])
        cpus = GaugeMetricFamily("selftune_numa_cpus", "CPUs in the NUMA node", labels=["node"])
        for node in observation.numa:
            label = [str(node.id)]
            if node.mem_total_bytes is not None:
                total.add_metric(label, node.mem_total_bytes)
            if node.mem_free_bytes is not None:
                free.add_metric(label, node.mem_free_bytes)
            cpus.add_metric(label, len(node.cpus))
        yield from (total, free, cpus)

    def _gpus(self, observation):
        gpu = observation.gpu
        if gpu is None or not gpu.devices:
            return
        fields = {
            "selftune_gpu_utilization_ratio": ("GPU busy share", "utilization_gpu", 0.01),
            "selftune_gpu_memory_used_bytes": ("GPU memory used", "memory_used_bytes", 1),
            "selftune_gpu_memory_total_bytes": ("GPU memory", "memory_total_bytes", 1),
            "selftune_gpu_power_watts": ("GPU power draw", "power_watts", 1),
            "selftune_gpu_temperature_celsius": ("GPU temperature", "temperature_c", 1),
            "selftune_gpu_sm_clock_hertz": ("GPU SM clock", "sm_clock_mhz", 1e6),
        }
        for name, (doc, attribute, scale) in fields.items():
            family = GaugeMetricFamily(name, doc, labels=["gpu"])
            for device in gpu.devices:
                value = getattr(device, attribute)
                if value is not None:
                    family.add_metric([str(device.index)], value * scale)
            yield family


def _le(bound: float) -> str:
    return f"{bound:.6g}"


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """The registry behind GET /metrics."""

    def __init__(self, telemetry):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SelftuneCollector(telemetry))
        for standard in (ProcessCollector, PlatformCollector, GCCollector):
            standard(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
