"""Copier: chunked copies, the CUDA path's staging and events (run on CPU tensors through fake streams), and the
cache's rule that a prefetch gives way to an on-demand load and never delays a hit."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fmoe_local.cache import ExpertCache
from fmoe_local.copier import Copier
from fmoe_local.host import TieredHostStore
from fmoe_local.stats import LayerCounters
from tests.fake_streams import FakeStreams
from tests.test_cache import RecordingPolicy, ValueHost

FORWARD = "MainThread"


def _expert(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((4, 5), value), "b": torch.full((3,), value)}


def _slots() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(2, 4, 5), "b": torch.zeros(2, 3)}


@pytest.mark.parametrize("chunk_bytes", [1, 12, 80, 1 << 20])
@pytest.mark.parametrize("streams", [None, "fake"])
def test_a_chunked_copy_lands_every_byte_in_its_slot_only(chunk_bytes, streams):
    fake = FakeStreams() if streams else None
    copier = Copier(torch.device("cpu"), chunk_bytes, fake)
    dst, slot = _slots(), SimpleNamespace(last_use=None, copy_event=None)
    pauses = []
    copier.copy(slot, dst, 1, _expert(7.0), pause=lambda: pauses.append(1))
    assert torch.equal(dst["a"][1], torch.full((4, 5), 7.0)) and torch.equal(dst["b"][1], torch.full((3,), 7.0))
    assert not dst["a"][0].any() and not dst["b"][0].any()
    assert len(pauses) == len(copier.chunks(dst, 1, _expert(7.0))) - 1  # between chunks, never before the first
    assert (slot.copy_event is not None) == bool(streams)


def test_the_cuda_path_waits_for_the_slots_last_reader_then_refills_staging_only_after_its_dma():
    fake = FakeStreams()
    copier = Copier(torch.device("cpu"), 40, fake)  # "a" is 80 bytes: 2 chunks, "b" 1 chunk → 3 staged copies
    last_use = fake.event()
    slot = SimpleNamespace(last_use=last_use, copy_event=None)
    copier.copy(slot, _slots(), 0, _expert(1.0))
    waits = [e for e in fake.log if e[0] == "wait_event"]
    assert waits == [("wait_event", "copy", last_use.number, FORWARD)]  # once, before the first chunk
    records = [e for e in fake.log if e[0] == "record"]
    syncs = [e for e in fake.log if e[0] == "synchronize"]
    # Two buffers in rotation: the third chunk refills the first buffer, after its event (the first chunk's DMA).
    assert [s[1] for s in syncs] == [records[0][1]]
    assert slot.copy_event.number == records[-1][1] and records[-1][2] == "copy"


@pytest.mark.parametrize("streams", [None, "fake"])
def test_the_host_stores_landing_rewrite_runs_after_every_chunk_on_the_copy_stream_before_its_event(streams):
    # A GPU slot's int4 codes are put into torch's layout by `land`: it must see the whole expert, and the copy's
    # event (what readers wait for) must come after it, on the same stream.
    fake = FakeStreams() if streams else None
    copier = Copier(torch.device("cpu"), 12, fake)
    dst, slot = _slots(), SimpleNamespace(last_use=None, copy_event=None)
    seen = []

    def land(rows):
        seen.append(({k: v.clone() for k, v in rows.items()}, fake.in_use() if fake else None))
        rows["a"].mul_(2)
        if fake:
            fake.log.append(("land",))

    copier.copy(slot, dst, 1, _expert(3.0), land=land)
    ((rows, stream),) = seen
    assert torch.equal(rows["a"], torch.full((4, 5), 3.0)) and torch.equal(rows["b"], torch.full((3,), 3.0))
    assert torch.equal(dst["a"][1], torch.full((4, 5), 6.0)) and not dst["a"][0].any()  # in place, its slot only
    if fake:
        assert stream == "copy"
        ops = [e[0] for e in fake.log]
        last_record = max(i for i, e in enumerate(fake.log) if e[0] == "record")
        assert ops.index("land") < last_record and slot.copy_event.number == fake.log[last_record][1]


def _slow_cache(capacity: int, streams=None, chunk_delay: float = 0.0):
    """A cache over ValueHost whose experts are 24 bytes copied in 4-byte chunks (6 per expert)."""
    host = ValueHost()
    cache = ExpertCache(
        host, capacity, torch.device("cpu"), RecordingPolicy(), LayerCounters(3, 4), copy_chunk_bytes=4,
        streams=streams, load_timeout_s=5,
    )  # fmt: skip
    order: list[tuple[tuple[int, int], int]] = []
    real = cache._copier.chunks

    def chunks(dst, index, src):
        value = int(src["w"].flatten()[0].item())
        pieces = real(dst, index, src)
        out = []
        for k, (to, frm) in enumerate(pieces):
            out.append((_Logged(to, order, (value // 10, value % 10), k, chunk_delay), frm))
        return out

    cache._copier.chunks = chunks
    return cache, order


class _Logged:
    """A destination chunk that logs (expert, chunk index) when written, after an optional delay."""

    def __init__(self, to, order, key, k, delay) -> None:  # noqa: ANN001
        self.to, self.order, self.key, self.k, self.delay = to, order, key, k, delay

    def copy_(self, frm, non_blocking: bool = False):  # noqa: ANN001, ANN201
        time.sleep(self.delay)
        self.order.append((self.key, self.k))
        return self.to.copy_(frm)


def _during_prefetch(cache, key, hold_s, access):  # noqa: ANN001, ANN202
    """Prefetch `key` on a thread; once its first chunk is written (and `hold_s` later), run `access()` here while
    the prefetch is mid-copy. Returns what `access` returned and how long it took."""
    started = threading.Event()
    real_copy = _Logged.copy_

    def first_chunk_signals(self, frm, non_blocking=False):  # noqa: ANN001, ANN202
        out = real_copy(self, frm)
        if self.key == key and self.k == 0:
            started.set()
            time.sleep(hold_s)
        return out

    _Logged.copy_ = first_chunk_signals
    try:
        prefetch = threading.Thread(target=cache.try_prefetch, args=key, name="prefetcher")
        prefetch.start()
        assert started.wait(5)
        t0 = time.perf_counter()
        result = access()
        waited = time.perf_counter() - t0
        prefetch.join(5)
    finally:
        _Logged.copy_ = real_copy
    return result, waited


def test_a_demand_load_overtakes_a_prefetch_already_copying():
    cache, order = _slow_cache(4, chunk_delay=0.02)
    # The forward pass misses expert 2 (an on-demand load) while the prefetch of (1, 0) is mid-copy.
    slots, _ = _during_prefetch(cache, (1, 0), 0.1, lambda: cache.acquire(0, [2]))
    demand = [i for i, (key, _) in enumerate(order) if key == (0, 2)]
    prefetched = [i for i, (key, _) in enumerate(order) if key == (1, 0)]
    assert len(demand) == 6 and len(prefetched) == 6
    # Every chunk of the demand load was copied before the prefetch's second chunk: the prefetch gave way.
    assert max(demand) < prefetched[1]
    assert torch.equal(cache.tensors["w"][slots[0]], torch.full((2, 3), 2.0))
    cache.close()


def test_a_prefetch_the_forward_pass_waits_for_does_not_give_way_to_itself():
    # The forward pass needs the very expert being prefetched (late) while it also loads another on demand: the
    # prefetch must go on, or the access would wait for the deadline.
    cache, _ = _slow_cache(4, chunk_delay=0.01)
    _, waited = _during_prefetch(cache, (0, 1), 0.05, lambda: cache.acquire(0, [1, 3]))  # 1 late, 3 a miss
    assert waited < 4  # far below the 5 s deadline: no deadlock between the prefetch and the demand
    assert cache.counters.late[0, 1] == 1 and cache.counters.misses[0, 3] == 1
    cache.close()


def test_a_prefetch_copy_in_progress_never_delays_a_hit():
    cache, _ = _slow_cache(4)
    cache.acquire(0, [0])  # resident now
    gate, started = threading.Event(), threading.Event()
    real_read = cache.host.read

    def stuck_read(layer, expert):  # noqa: ANN001, ANN202
        if (layer, expert) == (2, 2):
            started.set()
            gate.wait(10)  # a slow disk under the prefetch
        return real_read(layer, expert)

    cache.host.read = stuck_read
    prefetch = threading.Thread(target=cache.try_prefetch, args=(2, 2), name="prefetcher")
    prefetch.start()
    assert started.wait(5)
    done = threading.Event()
    forward = threading.Thread(target=lambda: (cache.acquire(0, [0]), done.set()), name="forward")
    forward.start()
    assert done.wait(2), "a hit waited for a prefetch's copy"
    gate.set()
    prefetch.join(5)
    assert cache.counters.hits[0, 0] == 1
    cache.close()


def test_on_the_cuda_path_the_forward_thread_never_waits_for_a_copy_on_the_host():
    fake = FakeStreams()
    cache, _ = _slow_cache(6, streams=fake)
    prefetch = threading.Thread(target=cache.try_prefetch, args=(1, 1), name="prefetcher")
    prefetch.start()
    prefetch.join(5)
    for layer, experts in ((0, [0, 1]), (1, [1, 2]), (2, [3]), (0, [0, 2])):
        slots = cache.acquire(layer, experts)
        assert not [e for e in fake.log if e[0] == "wait_event" and e[1] == "compute" and e[2] is None]
        for s in slots:  # as experts.py does, right before each expert computes
            cache.before_use(s)
        cache.release(slots)
    assert fake.by_thread("synchronize", FORWARD) == []
    # The compute stream waited for each slot's copy event before the layer used it, once per copy.
    copies = [e for e in fake.log if e[0] == "record" and e[2].startswith("copy")]
    compute_waits = [e for e in fake.log if e[0] == "wait_event" and e[1] == "compute"]
    assert len(compute_waits) == cache.counters.misses.sum() + cache.counters.prefetch_used == 6
    assert {w[2] for w in compute_waits} <= {c[1] for c in copies}
    cache.close()


def test_a_prefetch_does_not_pause_for_a_demand_load_that_needs_its_slot():
    # One slot, held by a prefetch mid-copy; the forward pass misses another expert: it can only take the slot once
    # the prefetch lands, so the prefetch must not wait for the demand load (before the fix: a 5 s deadline).
    cache, _ = _slow_cache(1, chunk_delay=0.01)
    slots, waited = _during_prefetch(cache, (1, 0), 0.05, lambda: cache.acquire(0, [2]))
    assert waited < 4
    assert torch.equal(cache.tensors["w"][slots[0]], torch.full((2, 3), 2.0))
    assert cache.counters.prefetch_wasted == 1  # the prefetched expert was evicted unused
    cache.close()


def test_a_pinned_host_expert_is_copied_straight_from_ram_with_no_staging_and_no_host_wait():
    fake = FakeStreams()
    copier = Copier(torch.device("cpu"), 40, fake)  # "a" in 2 chunks, "b" in 1
    block = torch.zeros(1024, dtype=torch.uint8)
    fake.register(block)
    src = {"a": block[:80].view(torch.float32).view(4, 5), "b": block[128:140].view(torch.float32)}
    src["a"].fill_(3.0), src["b"].fill_(4.0)
    slot, dst = SimpleNamespace(last_use=None, copy_event=None), _slots()
    copier.copy(slot, dst, 1, src)
    assert torch.equal(dst["a"][1], src["a"]) and torch.equal(dst["b"][1], src["b"])
    assert [e for e in fake.log if e[0] in ("pinned", "synchronize")] == []  # no staging buffer, nobody waited
    assert slot.copy_event is not None  # the compute stream still waits for the copy (cache.before_use)
    copier.copy(slot, dst, 0, _expert(5.0))  # an unpinned expert (the disk tier) is staged as before
    assert [e[0] for e in fake.log if e[0] == "pinned"] == ["pinned", "pinned"]


class _TieredValueHost(TieredHostStore):
    """ValueHost's experts (the value 10·l + e) behind the real RAM tier, so that they can be pinned."""

    def __init__(self) -> None:
        super().__init__(3, 4, {"w": (2, 3)}, torch.float32)

    def _fetch(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return {"w": torch.full((2, 3), float(10 * layer + expert))}


def test_the_cache_pins_host_experts_on_cuda_only_and_copies_them_without_staging():
    assert ExpertCache(_TieredValueHost(), 2, torch.device("cpu"), RecordingPolicy(), LayerCounters(3, 4)).pin_host(
        1 << 30
    ) == 0  # fmt: skip
    fake, host = FakeStreams(), _TieredValueHost()
    cache = ExpertCache(host, 2, torch.device("cpu"), RecordingPolicy(), LayerCounters(3, 4), streams=fake)
    assert cache.pin_host(4 * 64) == 4 * 64  # layer 0's four experts, each 24 bytes in a 64-byte stretch
    slots = cache.acquire(0, [1, 3])
    assert [float(cache.tensors["w"][s][0, 0]) for s in slots] == [1.0, 3.0]
    assert [e for e in fake.log if e[0] == "pinned"] == []  # straight from the pinned block
    cache.release(slots)
    slots = cache.acquire(2, [0])
    assert float(cache.tensors["w"][slots[0]][0, 0]) == 20.0
    assert [e[0] for e in fake.log if e[0] == "pinned"] == ["pinned", "pinned"]  # layer 2 was not pinned: staged


def _pinned_expert(fake: FakeStreams, floats: int) -> dict[str, torch.Tensor]:
    block = torch.zeros(floats * 4, dtype=torch.uint8)
    fake.register(block)
    return {"a": block.view(torch.float32)}


def test_a_cuda_prefetch_keeps_at_most_two_chunks_queued_so_that_its_pauses_are_timely():
    # Issuing a DMA takes microseconds: without waiting, a prefetch queues its whole expert on the copy engine
    # before the first pause, and a demand load issued "between chunks" still waits behind all of it (seen on an
    # H100: fmoe+copy 2.4x lru's time per token on Mixtral shapes, with the stall clock showing none of it).
    fake = FakeStreams()
    copier = Copier(torch.device("cpu"), 8, fake)  # 40 bytes of a pinned expert: 5 chunks, no staging
    src = _pinned_expert(fake, 10)
    slot, dst = SimpleNamespace(last_use=None, copy_event=None), {"a": torch.zeros(1, 10)}
    steps = []
    copier.copy(slot, dst, 0, src, pause=lambda: steps.append("pause"))
    records = [e[1] for e in fake.log if e[0] == "record"]
    syncs = [e[1] for e in fake.log if e[0] == "synchronize"]
    assert syncs == records[:3]  # chunk k waits for chunk k-2's event: at most two on the engine
    assert all(e[-1] == FORWARD for e in fake.log if e[0] == "synchronize")  # the copying thread (here: this one)
    # Each wait comes before the pause it makes timely.
    ops = [e[0] for e in fake.log if e[0] in ("synchronize", "record")]
    assert ops[:4] == ["record", "record", "synchronize", "record"]
    assert len(steps) == 4


def test_a_demand_load_is_never_held_back_by_a_chunk_limit():
    fake = FakeStreams()
    copier = Copier(torch.device("cpu"), 8, fake)
    slot, dst = SimpleNamespace(last_use=None, copy_event=None), {"a": torch.zeros(1, 10)}
    copier.copy(slot, dst, 0, _pinned_expert(fake, 10))  # no pause: an on-demand load
    assert [e for e in fake.log if e[0] == "synchronize"] == []


def test_demand_loads_and_prefetches_copy_on_streams_of_their_own():
    fake = FakeStreams()
    cache, _ = _slow_cache(6, streams=fake)
    prefetch = threading.Thread(target=cache.try_prefetch, args=(1, 1), name="prefetcher")
    prefetch.start()
    prefetch.join(5)
    slots = cache.acquire(0, [2])  # a miss: loaded on the loader thread
    cache.before_use(slots[0])
    streams = {e[-1]: e[2] for e in fake.log if e[0] == "record"}
    assert streams["prefetcher"] != streams["fmoe-loader"]
    waited = [e[2] for e in fake.log if e[0] == "wait_event" and e[1] == "compute"]
    loader_events = [e[1] for e in fake.log if e[0] == "record" and e[-1] == "fmoe-loader"]
    assert waited == [loader_events[-1]]  # the compute stream waited for the demand copy alone
    cache.close()


def test_a_slot_is_not_overwritten_before_its_unused_previous_copy_is_done():
    # Copies into one slot may come from two streams now: an expert prefetched and evicted unused was never waited
    # for by the compute stream, so the next copy into its slot must wait for that copy's event itself.
    fake = FakeStreams()
    copier = Copier(torch.device("cpu"), 1 << 20, fake)
    slot, dst = SimpleNamespace(last_use=None, copy_event=None), _slots()
    copier.copy(slot, dst, 0, _expert(1.0), pause=lambda: None)
    previous = slot.copy_event
    other = threading.Thread(target=copier.copy, args=(slot, dst, 0, _expert(2.0)), name="loader")
    other.start()
    other.join(5)
    waits = [e for e in fake.log if e[0] == "wait_event" and e[-1] == "loader"]
    assert waits == [("wait_event", "copy2", previous.number, "loader")]
    assert torch.equal(dst["a"][0], torch.full((4, 5), 2.0))


def test_on_cuda_a_prefetch_waits_for_the_demand_copy_on_the_wire_not_only_its_issue():
    # A demand load is "running" on the host only while its DMA is issued (microseconds); a prefetch that went on
    # then shared the link with it, and the forward pass waited twice as long for every miss.
    fake = FakeStreams()
    cache, _ = _slow_cache(4, streams=fake, chunk_delay=0.002)
    slots, _ = _during_prefetch(cache, (1, 0), 0.1, lambda: cache.acquire(0, [2]))
    demand_copy = [e[1] for e in fake.log if e[0] == "record" and e[-1] == "fmoe-loader"][-1]
    assert ("synchronize", demand_copy, "prefetcher") in fake.log
    # ...before the prefetch issued its next chunk
    at = fake.log.index(("synchronize", demand_copy, "prefetcher"))
    prefetch_records = [i for i, e in enumerate(fake.log) if e[0] == "record" and e[-1] == "prefetcher"]
    assert any(i > at for i in prefetch_records)
    assert torch.equal(cache.tensors["w"][slots[0]], torch.full((2, 3), 2.0))
    cache.close()
