"""A generation worker's batch decisions as pure arithmetic on sequence lengths: who joins the
running batch, when a prompt is prefilled in chunks, how far a chunk goes, and how many of the
youngest rows a step preempts. The worker's runner (engine/generation.py) and the simulator
(autotune/offline/gen_simulator.py) both decide through these functions, so the simulated batch
is the live one.

The batch is one dense, left-padded cache: rows × columns token slots, where columns is the
longest row's cached length (shorter rows are padded on the left; columns nobody uses are
trimmed). A row's cached length is its prompt plus the tokens it has made, less the newest one
(not yet fed back). No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

KV_RESERVE = 16
"""Token slots per row an admission leaves free for the decode steps that follow it."""
IDLE_PREFILL_TOKENS = 2048
"""A step's prompt-token budget while no row decodes (unless the knob is larger): no stream's next
token waits on that step, and every chunk would read the weights again; capped so that one
step's attention stays small."""


def step_budget(chunk: int | None, running: int) -> int | None:
    """Prompt tokens this step may prefill: the chunk knob while `running` rows decode beside the
    prefill; while none do, at least IDLE_PREFILL_TOKENS (no knob, whole prompts, stays so)."""
    if running or not chunk:
        return chunk
    return max(chunk, IDLE_PREFILL_TOKENS)


def admit(waiting: Sequence[int], rows: int, columns: int, max_running: int, kv_tokens: int | None, chunk: int | None) -> int:
    """How many waiting sequences (their context lengths, in queue order) join the batch now.

    FIFO: the head waits rather than be overtaken, so nothing starves. One joins while there is
    a free row, the batch it makes keeps KV_RESERVE slots per row under the cap, and the step's
    prefill stays within `chunk` tokens (the first one may go on in chunks)."""
    admitted, tokens = 0, 0
    for length in waiting:
        if rows >= max_running:
            break
        wider = max(columns, length)
        if kv_tokens is not None and rows and (rows + 1) * (wider + KV_RESERVE) > kv_tokens:
            break  # an empty batch always takes the head: requests are checked against the ceiling
        tokens += length
        if admitted and chunk and tokens > chunk:
            break
        admitted, rows, columns = admitted + 1, rows + 1, wider
    return admitted


def prefills_in_chunks(admitted: Sequence[int], chunk: int | None) -> bool:
    """A lone admitted prompt longer than the chunk is prefilled a chunk per step, on its own."""
    return len(admitted) == 1 and bool(chunk) and admitted[0] > chunk


def chunk_end(done: int, length: int, chunk: int | None) -> int:
    """Where the next chunk of a partly prefilled prompt ends (the chunk knob may have gone to 0: the rest)."""
    return min(length, done + (chunk or length))


def footprint_after_decode(cached: Sequence[int], joining: int, joining_width: int, partial: int | None) -> int:
    """Slots once a decode step adds a column to the running rows (`cached` > 0 of them), the
    `joining` prefilled rows (as wide as `joining_width`) have merged, and a partial prompt of
    `partial` tokens has joined in full."""
    rows, columns = len(cached) + joining, max(max(cached) + 1, joining_width)
    if partial is not None:
        rows, columns = rows + 1, max(columns, partial)
    return rows * columns


def preemptions(cached: Sequence[int], joining: int, joining_width: int, partial: int | None, kv_tokens: int | None) -> int:
    """How many of the youngest running rows (`cached`, oldest first) to preempt before a decode
    step so the cache fits the cap; a row alone with nothing joining always stays."""
    if kv_tokens is None:
        return 0
    kept = len(cached)
    while kept and footprint_after_decode(cached[:kept], joining, joining_width, partial) > kv_tokens and (kept > 1 or joining or partial is not None):
        kept -= 1
    return len(cached) - kept
