"""The live core and the simulator share their engine logic: driven by the same events, they
start, drain and stop the same workers, count alike, and build the same Load."""

from __future__ import annotations

import ast
import selectors
from multiprocessing import Pipe
from pathlib import Path

import pytest

from autotune.offline.costmodel import DeterministicCostModel
from autotune.offline.simulator import READY, SimConfig, Simulation
from engine import messages as m
from engine.batcher import Batch, Item
from engine.config import EngineConfig, Knobs
from engine.embed_jobs import EmbedJobs
from engine.loading import ModelInfo
from engine.scheduler import Scheduler
from engine.stats import Counters, LatencyHistograms
from engine.supervisor import WorkerHandle, WorkerSupervisor
from monitors.sampler import COUNTERS, LoadWindow

ROOT = Path(__file__).resolve().parent.parent
INFO = ModelInfo(hidden_size=8, max_length=32, eos_token_ids=(0,), pad_token_id=0, vocab_size=100)

# (what happens, value): process_count changes, a worker says it is ready, a stopped worker exits.
EVENTS = [
    ("process_count", 2),
    ("ready", 0),
    ("ready", 1),
    ("process_count", 4),
    ("ready", 2),
    ("process_count", 1),  # worker 3 is still starting: it drains first, then 2 and 1, which stop now
    ("ready", 3),          # a worker drained while starting stops once it has warmed up
    ("exit", 3),
    ("process_count", 2),
    ("exit", 1),
    ("exit", 2),
]


class LiveSide:
    """A WorkerSupervisor over real pipes: the zygote's end and each worker's end are ours."""

    def __init__(self):
        self.zygote_front, self.zygote = Pipe()
        self.selector = selectors.DefaultSelector()
        self.scheduler = Scheduler("embed", Knobs())
        config = EngineConfig(restart_backoff=(0.0, 0.0))
        self.supervisor = WorkerSupervisor(config, INFO, "cpu", self.zygote_front, self.scheduler, Counters(), self.selector, Knobs(), lambda e, s: None)
        self.supervisor.jobs = EmbedJobs(config, INFO, self.scheduler, self.supervisor.counters, LatencyHistograms(), self.supervisor)
        self.worker_ends: dict[int, object] = {}
        self.stopped: list[int] = []

    def apply(self, event: str, value: int, now: float) -> None:
        sup = self.supervisor
        if event == "process_count":
            sup.knobs = sup.knobs.replace(process_count=value)
        elif event == "ready":
            front, ours = Pipe()
            sup.workers[value].conn = front
            self.worker_ends[value] = ours
            ours.send(m.Ready(0.0))
            sup._on_worker_message(sup.workers[value])
        elif event == "exit":
            handle: WorkerHandle = sup.workers[value]
            handle.conn = None  # the pipe is ours; nothing to unregister
            self.worker_ends.pop(value)
            sup._on_worker_exit(handle, "process exited")
        sup.reconcile(now)
        while self.zygote.poll():
            fork = self.zygote.recv()
            assert isinstance(fork, m.Fork)
        for worker_id, ours in self.worker_ends.items():
            while ours.poll():
                msg = ours.recv()
                if isinstance(msg, m.Stop):
                    self.stopped.append(worker_id)

    def view(self) -> dict[int, str]:
        return {s.worker_id: s.state.value for s in self.scheduler.router.workers()}


class SimSide:
    def __init__(self):
        self.sim = Simulation([], DeterministicCostModel(0.01), SimConfig(knobs=Knobs()))
        self.stopped: list[int] = []

    def apply(self, event: str, value: int, now: float) -> None:
        sim = self.sim
        if event == "process_count":
            sim.knobs = sim.knobs.replace(process_count=value)
        elif event == "ready":
            sim._handle(READY, value, now)
        before = set(sim.workers)
        sim._reconcile(now)
        # The simulator stops a worker and sees it exit in the same step.
        self.stopped += sorted(before - set(sim.workers))

    def view(self) -> dict[int, str]:
        return {s.worker_id: s.state.value for s in self.sim.scheduler.router.workers()}


def test_live_supervisor_and_simulator_agree_on_the_same_events():
    live, sim = LiveSide(), SimSide()
    for step, (event, value) in enumerate(EVENTS):
        now = float(step)
        live.apply(event, value, now)
        if event != "exit":  # the simulator's workers exit when stopped
            sim.apply(event, value, now)
        assert live.stopped == sim.stopped, (step, event, value)
        live_view = {w: s for w, s in live.view().items() if w not in live.stopped}
        assert live_view == sim.view(), (step, event, value)
    assert live.stopped == [1, 2, 3] and sorted(sim.view()) == [0, 4]
    assert live.supervisor.counters.workers_started == 5


def test_counting_a_batch_is_one_code_for_both():
    batch = Batch(7, [Item(1, 0, 5, 0.0), Item(2, 0, 3, 0.0)], 5)
    counters = Counters()
    counters.count_dispatch(batch, pack_row_tokens=0)
    counters.count_batch_done(2, 0.5)
    assert (counters.batches, counters.items, counters.real_tokens, counters.padded_tokens) == (1, 2, 8, 10)
    assert (counters.batches_done, counters.items_done_squared, counters.item_model_seconds) == (1, 4, 1.0)


def test_load_window_turns_totals_into_rates():
    window = LoadWindow(10.0)
    zero = dict.fromkeys(COUNTERS, 0)
    assert window.load(0.0, zero, 3, 0.1, 4, {}).arrival_rate == 0.0
    load = window.load(2.0, {**zero, "requests": 10, "completed": 8, "batches": 2, "items": 8, "real_tokens": 60, "padded_tokens": 80}, 3, 0.1, 4, {})
    assert (load.arrival_rate, load.completion_rate, load.batch_size, load.batch_fill) == (5.0, 4.0, 4.0, 0.75)
    assert (load.queue_depth, load.pending_requests) == (3, 4)


@pytest.mark.parametrize("simulator, shared", [("simulator.py", {"count_dispatch", "count_batch_done"}),
                                               ("gen_simulator.py", {"admit", "preemptions", "prefills_in_chunks", "chunk_end"})])
def test_the_simulator_holds_no_copy_of_engine_logic(simulator, shared):
    """It calls the shared pieces (the embedding simulator the Counters' methods, the generation one
    engine.gen_admission, both the Scheduler's reconcile through sim_loop.py and the sampler's
    LoadWindow) and never drives the router's worker set or counters by hand."""
    offline = ROOT / "autotune" / "offline"
    tree = ast.Module(body=[*ast.parse((offline / simulator).read_text()).body, *ast.parse((offline / "sim_loop.py").read_text()).body], type_ignores=[])
    calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert {"reconcile", "load"} | shared <= calls
    on_router = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "router"}
    assert on_router and not {"add", "drain", "choose_to_retire", "idle_draining", "take_stoppable"} & on_router
    subscripts = [n for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "counters"]
    assert not subscripts
