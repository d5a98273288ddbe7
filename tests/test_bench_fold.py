import numpy as np
import pytest

from fmoe_bench.fold import fold, parse_fold
from fmoe_bench.replay import build_schedule
from fmoe_bench.synthetic import fold_trace
from fmoe_local.traces import DECODE, Trace


def _trace() -> Trace:
    # 2 requests of 3 tokens, 2 layers, 6 experts, top-3 recorded.
    ids = np.array([[[0, 3, 5], [1, 2, 4]]] * 6, np.int16)
    ids[1, 0] = [2, 5, 1]
    probs = np.array([[[0.5, 0.3, 0.2], [0.4, 0.35, 0.25]]] * 6, np.float32)
    return Trace(
        "src",
        2,
        6,
        3,
        np.repeat([7, 9], 3).astype(np.int32),
        np.arange(6, dtype=np.int32),
        np.full(6, DECODE, np.int8),
        ids,
        probs,
    )


def test_fold_sums_experts_modulo_and_selects_the_folded_top_k() -> None:
    t = fold(_trace(), 3, 2)
    assert (t.num_layers, t.num_experts, t.top_k) == (2, 3, 2)
    # Row 0, layer 0: experts 0 (0.5), 3 (0.3) → folded 0 gets 0.8; 5 (0.2) → folded 2.
    assert t.probs[0, 0] == pytest.approx([0.8, 0.0, 0.2])
    assert t.topk_ids[0, 0].tolist() == [0, 2] and t.topk_probs[0, 0] == pytest.approx([0.8, 0.2])
    # Row 1, layer 0: experts 2 (0.5), 5 (0.3) → folded 2 gets 0.8; 1 (0.2) → folded 1.
    assert t.topk_ids[1, 0].tolist() == [2, 1]
    # The same fold as the live benchmark's forced routing, request and pass structure unchanged.
    live = fold_trace(_trace(), 2, 3, 2)
    assert np.array_equal(t.probs, live.probs) and np.array_equal(t.topk_ids, live.ids)
    assert t.requests() == _trace().requests() and np.array_equal(t.iter_ids, _trace().iter_ids)
    schedule = build_schedule(t)
    assert schedule.shape.num_experts == 3 and schedule.needed[0][0] == (0, 2)


def test_fold_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="only merge experts"):
        fold(_trace(), 8, 2)
    with pytest.raises(ValueError, match="top-3 or fewer"):
        fold(_trace(), 3, 4)


def test_parse_fold() -> None:
    assert parse_fold("8x2") == (8, 2) and parse_fold("16X4") == (16, 4)
    for bad in ("8", "8x", "x2", "8x9", "0x0", "ax2"):
        with pytest.raises(ValueError, match="EXPERTSxTOPK|top-k"):
            parse_fold(bad)
