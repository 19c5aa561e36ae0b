"""The host-staging layer (`nnstat.background`): pooled host buffers handed back with an event,
results resolved on first read and completed in order, reader threads and their error relay."""

from __future__ import annotations

import threading

import pytest
import torch

from nnstat.background.deferred import Deferred, InFlight, InOrder
from nnstat.background.transfer import HostBuffers, LocalCopy, start_copy
from nnstat.background.worker import Job, Reader, Relay


class FakeEvent:
    """Stands in for a CUDA event: not complete until `synchronize` (which records the wait)."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_a_buffer_is_reused_only_once_the_event_it_was_given_back_with_has_completed():
    pool = HostBuffers(pin=False)
    buf = pool.take(8, torch.float64)
    event = FakeEvent()
    pool.give(buf[:3], after=event)  # a view gives the whole buffer back
    again = pool.take(5, torch.float64)
    assert again.data_ptr() == buf.data_ptr() and again.numel() == 8
    assert event.waited  # handed out again only after the device was done reading it
    other = pool.take(5, torch.float32)  # another dtype: a new buffer
    assert other.dtype == torch.float32 and other.data_ptr() != buf.data_ptr()


def test_a_pool_keeps_at_most_keep_free_buffers_and_knows_its_own():
    pool = HostBuffers(pin=False, keep=2, minimum=4)
    bufs = [pool.take(1) for _ in range(3)]
    assert all(b.numel() == 4 for b in bufs)  # the minimum size
    for b in bufs:
        pool.give(b)
    assert not pool.owns(bufs[0]) and pool.owns(bufs[1]) and pool.owns(bufs[2])
    assert not pool.owns(torch.empty(4))
    taken = {pool.take(4).data_ptr() for _ in range(2)}
    assert taken == {bufs[1].data_ptr(), bufs[2].data_ptr()}


def test_deferred_settles_on_first_read_and_raises_the_missing_message_when_it_could_not():
    calls = []
    d = Deferred(lambda: calls.append(1) or d.set({"a": 1.0}), "no values")
    assert not d.ready and calls == []
    assert d["a"] == 1.0 and dict(d) == {"a": 1.0} and d.copy() == {"a": 1.0}
    assert calls == [1]  # settled once
    failed = Deferred(lambda: None, "step 3 failed (raised before)")
    with pytest.raises(RuntimeError, match="step 3 failed"):
        len(failed)


def test_in_order_completes_arrived_entries_oldest_first_and_stops_after_upto():
    LocalCopy.ready = False
    try:
        queue, done = InOrder(), []
        handles = [Deferred(lambda: None, f"missing {i}") for i in range(3)]
        for i, h in enumerate(handles):
            queue.append(InFlight(start_copy([torch.tensor(float(i))], None), i, [h], i))
        queue.drain(lambda e: done.append(e.number), wait=False)
        assert done == []  # nothing has arrived: polling waits for nothing
        # `upto` is matched by identity: comparing the unfilled mappings would read them
        queue.drain(lambda e: done.append(e.number), wait=True, upto=handles[1])
        assert done == [0, 1] and len(queue) == 1 and queue.holds(handles[2])
    finally:
        LocalCopy.ready = True
    queue.drain(lambda e: done.append(e.number), wait=False)
    assert done == [0, 1, 2] and not queue.holds(handles[2])


def test_in_order_notes_which_entry_failed_and_drops_it():
    queue = InOrder()
    queue.append(InFlight(start_copy([torch.ones(1)], None), None, [], 7))

    def fail(entry: InFlight) -> None:
        raise ValueError("bad rows")

    with pytest.raises(ValueError, match="bad rows") as e:
        queue.drain(fail, wait=True, note=lambda f: f"(entry {f.number})")
    assert len(queue) == 0
    if hasattr(e.value, "add_note"):  # Python >= 3.11
        assert "(entry 7)" in e.value.__notes__


def test_relay_keeps_the_first_error_and_job_reraises_it_in_the_collecting_thread():
    relay = Relay()
    for exc in (KeyError("first"), ValueError("second")):
        with relay.catching():
            raise exc
    with pytest.raises(KeyError, match="first"):
        relay.raise_error()
    job = Job(lambda: 1 / 0)
    threading.Thread(target=job.run).start()
    with pytest.raises(ZeroDivisionError):
        job.result()
    assert isinstance(job.error, ZeroDivisionError)


def test_reader_stays_at_most_depth_items_ahead_and_reraises_where_the_item_would_come():
    filled = []

    def items():
        yield from range(3)
        raise OSError("damaged shard")

    reader = Reader(items(), lambda x: filled.append(x) or x, depth=2, name="test-reader")
    got = []
    with pytest.raises(OSError, match="damaged shard"):
        for x in reader:
            if x == 0:
                for _ in range(500):  # the thread runs ahead: wait until it has read two items
                    if len(filled) >= 2:
                        break
                    threading.Event().wait(0.01)
                threading.Event().wait(0.1)
                assert filled == [0, 1]  # two items read, none more before one is done
            got.append(x)
            reader.done()
    reader.close()
    assert got == [0, 1, 2]


def test_reader_close_stops_the_thread_and_closes_the_iterator_when_the_consumer_stops():
    closed = []

    def items():
        try:
            yield from range(100)
        finally:
            closed.append(True)

    reader = Reader(items(), lambda x: x, depth=2, name="test-reader")
    first = next(iter(reader))
    reader.close()
    assert first == 0 and closed == [True] and not reader._thread.is_alive()
