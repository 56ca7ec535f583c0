"""The generate policy's bets: a move whose gain depends on the CPU and the model (a layout that
trades threads for workers, a larger batch) is made, judged on the first window measured wholly
after it, and undone, not to be made again for a while, when it did not pay. Pure: the times are
the observations'."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

from engine.config import Knobs
from monitors.observation import Observation
from policies.gen_load import bet_measure, ms

BetKind = Literal["threads", "workers", "rows"]


@dataclass(frozen=True, slots=True)
class Bet:
    kind: BetKind
    """"threads" (fewer workers, more threads each), "workers" (more workers, fewer threads each) or
    "rows" (a larger max_batch_size)."""
    metric: str
    """What judges it: "itl" (ITL p50 must fall) or "cost" (busy core-seconds per output token must fall)."""
    before: Knobs
    moved: Knobs
    measure: float
    """The metric before the move."""
    settled: float | None = None
    """When the policy was first asked after the move: the controller asks nothing while workers
    start or drain, so the knobs stood from then on, and a window later it can be judged."""

    def needed_fall(self, layout_gain: float, rows_gain: float) -> float:
        """The share by which the metric must fall for the bet to stay. A layout: `layout_gain`. A
        larger batch: `rows_gain` of what it would be if a step cost the same whatever its rows (1 -
        rows before / rows after), so one more growth step asks for less where batches are already
        large (a GPU's), and nothing gained (a CPU whose cores the rows already fill) fails it."""
        if self.kind != "rows":
            return layout_gain
        return rows_gain * (1 - self.before.max_batch_size / self.moved.max_batch_size)

    def standing(self, knobs: Knobs) -> bool:
        """The knobs the bet moved are still as it left them."""
        if self.kind == "rows":
            return knobs.max_batch_size == self.moved.max_batch_size
        return (knobs.process_count, knobs.threads_per_process) == (self.moved.process_count, self.moved.threads_per_process)

    def undo(self, knobs: Knobs) -> Knobs:
        if self.kind == "rows":
            return knobs.replace(max_batch_size=self.before.max_batch_size)
        return knobs.replace(process_count=self.before.process_count, threads_per_process=self.before.threads_per_process)


class Bets:
    """The open bet (one at a time) and, per kind, until when a bet that did not pay is not made again."""

    def __init__(self, layout_gain: float, rows_gain: float, retry_seconds: float):
        self.layout_gain, self.rows_gain, self.retry_seconds = layout_gain, rows_gain, retry_seconds
        self.open: Bet | None = None
        self._no_bet_until: dict[str, float] = dict.fromkeys(get_args(BetKind), float("-inf"))

    def settle(self, now: float) -> None:
        """Called on every decision: the first one after a move starts the bet's clock."""
        if self.open is not None and self.open.settled is None:
            self.open = replace(self.open, settled=now)

    def blocked(self, kind: BetKind, now: float) -> str:
        """Why a bet of this kind is not made now ("" when it may be)."""
        left = self._no_bet_until[kind] - now
        return f"did not pay last time ({left:.0f} s before trying again)" if left > 0 else ""

    def make(self, observation: Observation, kind: BetKind, metric: str, knobs: Knobs, moved: Knobs) -> None:
        measure = bet_measure(observation, metric, knobs)
        if moved != knobs and measure is not None:
            self.open = Bet(kind, metric, knobs, moved, measure)

    def judge(self, observation: Observation, knobs: Knobs, served: bool, filled: bool, pace_lost: str = "") -> tuple[Knobs, str] | None:
        """Hold while the bet waits for a whole window measured after it; then keep it if its metric
        fell by the share needed, or if `served` (what it was made for holds now), or
        else go back and block its kind for retry_seconds. A larger batch the load no longer
        `filled` (the burst that asked for it has passed) goes back without a verdict: it costs
        nothing then, and the next queue grows it again, to be judged on a full batch. A larger
        batch that put the ITL objective over (`pace_lost` says how) goes back and is blocked
        whatever its cost per token did: it was made on ITL's headroom, and spent more than that."""
        bet = self.open
        if bet is None:
            return None
        if not bet.standing(knobs):
            self.open = None
            return None  # something else changed those knobs since: nothing to judge
        if bet.settled is None or observation.time < bet.settled + observation.window_seconds:
            what = "a layout move" if bet.kind != "rows" else "a larger batch"
            return knobs, f"{what} is being judged: holding until a whole window is measured after it"
        self.open = None
        if bet.kind == "rows" and not filled:
            return bet.undo(knobs), f"the larger batch ({bet.moved.max_batch_size} rows) is not filled any more: back to {bet.before.max_batch_size} until a queue asks again"
        if bet.kind == "rows" and pace_lost:
            self._no_bet_until[bet.kind] = observation.time + self.retry_seconds
            return bet.undo(knobs), (f"{pace_lost} on {bet.moved.max_batch_size} rows: the larger batch cost the pace; "
                                     f"back to {bet.before.max_batch_size}, not again for {self.retry_seconds:g} s")
        now = bet_measure(observation, bet.metric, knobs)
        if now is None:
            return None
        needed = bet.needed_fall(self.layout_gain, self.rows_gain)
        if now <= (1 - needed) * bet.measure or served:
            return None
        self._no_bet_until[bet.kind] = observation.time + self.retry_seconds
        shown = (f"ITL p50 {ms(now)}", ms(bet.measure)) if bet.metric == "itl" else (f"{now * 1000:.0f} core-ms per token", f"{bet.measure * 1000:.0f}")
        where = (f"{bet.moved.max_batch_size} rows" if bet.kind == "rows" else f"{bet.moved.process_count} × {bet.moved.threads_per_process}")
        return bet.undo(knobs), (f"{shown[0]} on {where} against {shown[1]} before: more {bet.kind} did not pay (by {needed:.0%}); "
                                 f"back, not again for {self.retry_seconds:g} s")
