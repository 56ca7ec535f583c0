"""The batcher, router and scheduler as pure state machines: time is passed in, never read."""

import sys

from engine.batcher import Batcher, Item
from engine.config import Knobs
from engine.router import Router, WorkerState
from engine.scheduler import Scheduler


def item(request_id, length, arrival, index=0):
    return Item(request_id, index, length, arrival)


def test_batch_closes_when_full_without_waiting():
    b = Batcher(max_batch_size=3, batch_timeout=10.0)
    for i in range(3):
        b.add(item(i, 5, arrival=0.0))
    assert b.next_due() == 0.0
    batch = b.pop_batch(now=0.0)
    assert [x.request_id for x in batch.items] == [0, 1, 2]
    assert len(b) == 0


def test_batch_closes_after_timeout_with_what_it_has():
    b = Batcher(max_batch_size=8, batch_timeout=0.05)
    b.add(item(1, 5, arrival=1.00))
    b.add(item(2, 5, arrival=1.02))
    assert b.pop_batch(now=1.04) is None
    assert b.next_due() == 1.05
    batch = b.pop_batch(now=1.05)
    assert [x.request_id for x in batch.items] == [1, 2]


def test_similar_lengths_go_together_and_oldest_always_goes():
    b = Batcher(max_batch_size=2, batch_timeout=0.0)
    lengths = [100, 10, 98, 12, 11]
    for i, length in enumerate(lengths):
        b.add(item(i, length, arrival=i * 0.001))
    first = b.pop_batch(now=1.0)
    assert sorted(x.length for x in first.items) == [98, 100]  # oldest (100) + nearest length
    second = b.pop_batch(now=1.0)
    assert sorted(x.length for x in second.items) == [10, 11]
    assert first.fill > 0.98 and second.fill > 0.8


def test_requeue_puts_old_items_first_and_cancel_removes_a_request():
    b = Batcher(max_batch_size=2, batch_timeout=0.0)
    b.add(item(5, 4, arrival=2.0))
    b.add(item(6, 4, arrival=2.5))
    b.requeue([item(1, 4, arrival=1.0, index=0), item(1, 4, arrival=1.0, index=1)])
    assert b.oldest_arrival() == 1.0
    assert b.cancel(1) == 2
    assert [x.request_id for x in b.pop_batch(now=3.0).items] == [5, 6]


def test_router_picks_least_loaded_ready_worker_and_respects_capacity():
    r = Router(capacity=2)
    for w in (0, 1, 2):
        r.add(w)
    assert r.pick() is None  # nobody has warmed up
    r.mark_ready(0)
    r.mark_ready(1)
    r.assign(0, key=10, items=4)
    assert r.pick() == 1
    r.assign(1, key=11, items=4)
    r.assign(1, key=12, items=4)
    assert r.pick() == 0
    r.assign(0, key=13, items=1)
    assert r.pick() is None  # both full
    r.complete(1, 11)
    assert r.pick() == 1


def test_router_drains_starting_workers_first_then_newest():
    r = Router(capacity=2)
    for w in (0, 1, 2):
        r.add(w)
    r.mark_ready(0)
    r.mark_ready(1)
    assert r.choose_to_retire(1) == [2]
    assert r.choose_to_retire(2) == [2, 1]
    r.drain(1)
    assert r.state(1) is WorkerState.DRAINING
    assert [s.worker_id for s in r.active()] == [0, 2]
    assert r.idle_draining() == [1]
    r.assign(1, key=1, items=1)  # work it held before draining
    assert r.idle_draining() == []


def test_scheduler_dispatches_only_to_workers_with_room():
    s = Scheduler("embed", Knobs(max_batch_size=2, batch_timeout=0.0), max_inflight_batches=1)
    s.router.add(0)
    s.router.mark_ready(0)
    for i in range(5):
        s.submit(item(i, 3, arrival=0.0))
    first = s.schedule(now=0.0)
    assert len(first) == 1 and len(first[0].batch.items) == 2
    assert s.schedule(now=0.0) == []  # worker full: the rest waits and keeps batching
    assert s.next_wakeup() is None
    s.router.complete(0, first[0].batch.batch_id)
    assert len(s.schedule(now=0.1)) == 1
    assert s.queue_depth() == 1


def test_scheduler_sends_generation_sequences_up_to_max_batch_size_per_worker():
    s = Scheduler("generate", Knobs(max_batch_size=3, batch_timeout=0.5))
    s.router.add(0)
    s.router.mark_ready(0)
    for i in range(5):
        s.submit(item(i, 3, arrival=0.0))
    dispatched = s.schedule(now=0.0)  # no batch timeout for sequences
    assert [len(d.batch.items) for d in dispatched] == [1, 1, 1]
    assert s.queue_depth() == 2


def test_queue_timeout_sheds_what_waited_its_limit_and_wakes_the_core_for_it():
    s = Scheduler("generate", Knobs(max_batch_size=1), queue_timeout=2.0)
    s.router.add(0)
    s.router.mark_ready(0)
    for i, arrival in enumerate((0.0, 0.5, 1.0, 3.0)):
        s.submit(item(i, 3, arrival))
    assert [d.batch.items[0].request_id for d in s.schedule(now=0.0)] == [0]
    assert s.next_wakeup() == 2.5  # the worker is full, but the oldest waiting item reaches its limit then
    assert s.shed(now=2.4) == []
    assert [x.request_id for x in s.shed(now=2.5)] == [1]  # at the limit exactly: shed
    s.router.complete(0, 0)
    assert [x.request_id for x in s.shed(now=3.2)] == [2]  # shed even though the worker has room now
    assert [d.batch.items[0].request_id for d in s.schedule(now=3.2)] == [3]
    assert s.queue_depth() == 0 and s.shed(now=100.0) == []
    off = Scheduler("generate", Knobs(max_batch_size=1))
    off.submit(item(0, 3, arrival=0.0))
    assert off.shed(now=1e9) == [] and off.next_wakeup() is None  # no worker, no limit: nothing to wake for


def test_expire_takes_every_item_at_or_past_the_limit_and_keeps_the_order_of_the_rest():
    b = Batcher(max_batch_size=8, batch_timeout=1.0)
    for i, arrival in enumerate((1.0, 0.9, 2.0, 1.5)):  # 0.9 was submitted after 1.0 (a faster tokenization)
        b.add(item(i, 4, arrival))
    assert b.expire(before=0.95) == []  # the head is younger: nothing is looked at
    assert [x.request_id for x in b.expire(before=1.5)] == [0, 1, 3]
    assert len(b) == 1 and b.oldest_arrival() == 2.0


def test_deferrable_items_say_when_an_arrival_needs_a_turn_of_its_own():
    s = Scheduler("embed", Knobs(max_batch_size=4, batch_timeout=0.5), max_inflight_batches=1)
    s.submit(item(0, 3, arrival=0.0))
    assert s.deferrable_items() == 0  # no ready worker: a crash loop must see every arrival
    s.router.add(0)
    s.router.mark_ready(0)
    assert s.deferrable_items() == 2  # a timer is due at 0.5; a fourth item would fill the batch now
    s.submit(item(1, 3, arrival=0.1))
    s.submit(item(2, 3, arrival=0.2))
    assert s.deferrable_items() == 0
    s.submit(item(3, 3, arrival=0.3))
    [first] = s.schedule(now=0.3)  # full: it goes at once
    assert s.deferrable_items() == 0  # nothing waits, so no turn is due for a newcomer
    s.submit(item(4, 3, arrival=0.4))
    assert s.deferrable_items() == sys.maxsize  # the worker is busy: its result brings the next turn
    s.router.complete(0, first.batch.batch_id)
    assert s.deferrable_items() == 2
    generate = Scheduler("generate", Knobs(max_batch_size=4))
    generate.router.add(0)
    generate.router.mark_ready(0)
    generate.submit(item(0, 3, arrival=0.0))
    assert generate.deferrable_items() == 0  # sequences are not deferred
