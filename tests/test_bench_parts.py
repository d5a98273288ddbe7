import pytest

from fmoe_bench.fold import fold
from fmoe_bench.parts import first_requests, learned_first, parse_counts, request_range, select_requests
from fmoe_bench.replay import ReplayResult

from .test_oracle import synthetic_trace


def test_halves_split_at_floor_half_and_slices_are_pythons() -> None:
    assert request_range(127, "first-half") == range(63) and request_range(127, "second-half") == range(63, 127)
    assert request_range(33, "first-half") == range(16) and request_range(33, "second-half") == range(16, 33)
    assert request_range(33, "all") == range(33)
    assert list(request_range(10, "2:5")) == [2, 3, 4] and list(request_range(10, "-3:")) == [7, 8, 9]
    assert list(request_range(10, ":2")) == [0, 1]


@pytest.mark.parametrize(
    ("spec", "sentence"),
    [("5:5", "selects no request"), ("third", "a slice of request indices"), ("a:b", "two whole numbers")],
)
def test_a_part_that_names_nothing_is_a_sentence(spec: str, sentence: str) -> None:
    with pytest.raises(ValueError, match=sentence):
        request_range(10, spec)


def test_selected_requests_are_the_named_ones_and_say_so() -> None:
    trace = synthetic_trace(0, requests=5, length=3)
    second = select_requests(trace, "second-half")
    assert [s for s, _, _ in second.requests()] == [2, 3, 4] and second.num_rows == 9
    assert second.model == "synthetic, requests 2–4 of 5 (second-half)"
    assert select_requests(trace, "1:2").model == "synthetic, requests 1–1 of 5"
    assert select_requests(trace, "all") is trace


def test_counts_parse_sorted_once_and_refuse_nonsense() -> None:
    assert parse_counts("200,10, 50,10") == [10, 50, 200]
    for bad in ("ten", "0,5", ""):
        with pytest.raises(ValueError, match="first-requests"):
            parse_counts(bad)


def test_first_requests_pool_the_first_n_and_say_all_past_the_end() -> None:
    r = ReplayResult("t", "p", request_hits=[1, 3, 0], request_accesses=[4, 4, 2])
    got = first_requests(r, [1, 2, 10])
    assert [f["hit_rate"] for f in got] == [0.25, 0.5, 0.4]
    assert [(f["requests"], f["all"]) for f in got] == [(1, False), (2, False), (3, True)]


def test_learned_first_puts_every_learned_request_before_the_measured_ones() -> None:
    learned, measured = synthetic_trace(1, requests=3, length=2), synthetic_trace(2, requests=2, length=4)
    both = learned_first(learned, measured)
    seqs = [s for s, _, _ in both.requests()]
    assert len(seqs) == 5 and len(set(seqs)) == 5  # the measured trace's ids moved past the learned ones
    assert both.num_rows == learned.num_rows + measured.num_rows
    assert (both.topk_ids[learned.num_rows :] == measured.topk_ids).all()
    assert len(list(both.iterations())) == 3 * 2 + 2 * 4
    other = fold(measured, 2, 1)
    with pytest.raises(ValueError, match="same shape"):
        learned_first(learned, other)
