from pathlib import Path

import numpy as np
import pytest

from fmoe_local.traces import DECODE, PREFILL, Trace, TraceRecorder, load_trace, save_trace
from tests.shared_data import SHARED_DATA

SHARED = SHARED_DATA / "traces"
L, J, K, H = 3, 8, 2, 5


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def _recorded(rng: np.random.Generator, embeddings: bool = True) -> tuple[TraceRecorder, list]:
    rec = TraceRecorder("tiny", L, J, K)
    passes = []
    for seq, sizes in ((7, (4, 1, 1)), (3, (2, 1))):
        for i, t in enumerate(sizes):
            probs = _softmax(rng.normal(size=(t, L, J)))
            emb = rng.normal(size=(t, H)).astype(np.float32) if embeddings else None
            rec.add(seq, PREFILL if i == 0 else DECODE, probs, emb)
            passes.append((seq, probs, emb))
        rec.label(seq, label=f"lab{seq}", text=f"prompt {seq}")
    return rec, passes


def test_recorder_round_trip(tmp_path: Path) -> None:
    rec, passes = _recorded(np.random.default_rng(0))
    assert len(rec) == 9
    path = tmp_path / "t.trace"  # any suffix: the file is written exactly where asked
    rec.save(path)
    t = load_trace(path)
    assert (t.model, t.num_layers, t.num_experts, t.top_k, t.embed_dim) == ("tiny", L, J, K, H)
    assert t.seq_ids.tolist() == [7] * 6 + [3] * 3
    assert t.phase.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1]
    assert t.seq_labels == ["lab7", "lab3"] and t.seq_texts == ["prompt 7", "prompt 3"]
    np.testing.assert_array_equal(t.probs, np.concatenate([p for _, p, _ in passes]))
    np.testing.assert_array_equal(t.embeddings, np.concatenate([e for _, _, e in passes]))
    # top-K derived from the distributions: the K largest, in descending order
    best = np.sort(t.probs, axis=2)[:, :, ::-1][:, :, :K]
    np.testing.assert_allclose(t.topk_probs, best)
    np.testing.assert_allclose(np.take_along_axis(t.probs, t.topk_ids.astype(np.int64), 2), best)
    assert [(it.seq_id, it.stop - it.start, it.phase) for it in t.iterations()] == [
        (7, 4, 0),
        (7, 1, 1),
        (7, 1, 1),
        (3, 2, 0),
        (3, 1, 1),
    ]
    assert t.requests() == [(7, 0, 6), (3, 6, 9)]


def test_topk_only_becomes_sparse_distribution(tmp_path: Path) -> None:
    ids = np.array([[[1, 4, -1], [0, 7, 2]]], np.int16)  # [T=1, L=2, k=3]
    vals = np.array([[[0.5, 0.25, 0.9], [0.1, 0.6, 0.2]]], np.float32)
    t = Trace("m", 2, J, 2, np.zeros(1, np.int32), np.zeros(1, np.int32), np.ones(1, np.int8), ids, vals)
    save_trace(t, tmp_path / "s.npz")
    t = load_trace(tmp_path / "s.npz")
    assert t.probs is None and t.embeddings is None and t.seq_labels is None
    d = t.distributions(0, 1)
    expected = np.zeros((1, 2, J), np.float32)
    expected[0, 0, [1, 4]] = [0.5, 0.25]  # the -1 slot is dropped, not written to expert J-1
    expected[0, 1, [0, 7, 2]] = [0.1, 0.6, 0.2]
    np.testing.assert_array_equal(d, expected)
    # the model's K=2 of k=3 recorded: the two most probable
    assert t.selected(0, 1)[0].tolist() == [[1, 4], [7, 2]]


def test_subset_keeps_whole_requests() -> None:
    rec, _ = _recorded(np.random.default_rng(1))
    t = rec.to_trace().subset([1])
    assert t.seq_ids.tolist() == [3, 3, 3] and t.seq_labels == ["lab3"]
    assert t.embeddings.shape == (3, H)


def test_recorder_rejects_inconsistent_input() -> None:
    rec = TraceRecorder("m", L, J, K)
    with pytest.raises(ValueError, match="probs must be"):
        rec.add(0, PREFILL, np.zeros((1, L, J + 1)))
    rec.add(0, PREFILL, np.zeros((1, L, J)))
    with pytest.raises(ValueError, match="every forward pass or for none"):
        rec.add(0, DECODE, np.zeros((1, L, J)), np.zeros((1, H)))
    rec.add(1, PREFILL, np.zeros((1, L, J)))
    with pytest.raises(ValueError, match="already finished"):
        rec.add(0, DECODE, np.zeros((1, L, J)))


def test_load_rejects_other_versions(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", format_version=np.int32(2))
    with pytest.raises(ValueError, match="not a routing trace"):
        load_trace(tmp_path / "x.npz")


@pytest.mark.skipif(not SHARED.exists(), reason="shared traces not available")
def test_shared_traces_load() -> None:
    for path in sorted(SHARED.glob("*.npz")):
        t = load_trace(path)
        assert (t.num_layers, t.num_experts, t.top_k) == (26, 64, 6)
        d = t.distributions(0, 2)
        assert ((d > 0).sum(-1) == 6).all()
        assert len(t.requests()) == np.unique(t.seq_ids).shape[0]


def test_a_save_that_fails_midway_leaves_the_previous_trace_whole(tmp_path: Path, monkeypatch) -> None:
    rec, _ = _recorded(np.random.default_rng(1))
    path = tmp_path / "run.npz"
    rec.save(path)
    before = path.read_bytes()

    def dies_halfway(f, **arrays):  # noqa: ANN001, ANN202 - np.savez_compressed's signature
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("No space left on device")

    monkeypatch.setattr(np, "savez_compressed", dies_halfway)
    with pytest.raises(OSError, match="No space"):
        rec.save(path)
    assert path.read_bytes() == before and load_trace(path).seq_ids.size == 9  # still the whole previous trace
    assert [p.name for p in tmp_path.iterdir()] == ["run.npz"]  # no temporary file left behind


def test_checkpoints_space_out_as_saves_grow_slow(tmp_path: Path, monkeypatch) -> None:
    from fmoe_local import traces

    now = [0.0]
    monkeypatch.setattr(traces, "_clock", lambda: now[0])
    saves: list[float] = []

    def slow_save(trace: Trace, path: Path) -> None:  # each save "takes" one second of the fake clock
        saves.append(now[0])
        now[0] += 1.0

    monkeypatch.setattr(traces, "save_trace", slow_save)
    rec, _ = _recorded(np.random.default_rng(2))
    assert rec.checkpoint(tmp_path / "t.npz")  # the first one always saves
    assert not rec.checkpoint(tmp_path / "t.npz")  # nothing new
    rec.label(3, text="again")
    now[0] += traces.SAVE_INTERVAL_PER_SAVE_S - 0.5
    assert not rec.checkpoint(tmp_path / "t.npz") and rec.unsaved  # a 1 s save is due 20 s after the last one
    now[0] += 0.5
    assert rec.checkpoint(tmp_path / "t.npz") and not rec.unsaved
    assert saves == [0.0, 1.0 + traces.SAVE_INTERVAL_PER_SAVE_S]


def test_the_runtime_saves_the_requests_a_checkpoint_skipped_when_it_closes(tiny_model_dir, tmp_path, monkeypatch):
    from fmoe_local import traces
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.runtime import Runtime

    ticks = iter(range(10**6))  # every reading is a second later, so each save "takes" 1 s: only the first is due
    monkeypatch.setattr(traces, "_clock", lambda: float(next(ticks)))
    path = tmp_path / "run.npz"
    config = RuntimeConfig(device="cpu", policy="lru", record_trace=str(path), sampling=Sampling(max_new_tokens=3))
    with Runtime.load(tiny_model_dir("mixtral"), config) as runtime:
        for prompt in ("first", "second", "third"):
            runtime.generate([{"role": "user", "content": prompt}])
        assert len(load_trace(path).requests()) == 1  # saved after the first request only
    saved = load_trace(path)
    assert len(saved.requests()) == 3 and "third" in saved.seq_texts[-1]
