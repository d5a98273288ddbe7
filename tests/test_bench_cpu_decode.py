"""`bench cpu-decode` on a tiny checkpoint: the table's structure, and bytes per token from each format's stored sizes.

Sizes are computed here from the shapes (not through the runtime's own size code): an expert is gate_up_proj [2I, H]
and down_proj [H, I]; int8 keeps a float32 scale per row, int4 a (scale, zero) pair per group of 64 (32 where a
row is not a multiple of 64) in the compute dtype, nf4 a float32 absmax per 64 weights. No timing is asserted.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from fmoe_bench import cpu_decode, synthetic
from fmoe_bench.synthetic import build_synthetic
from fmoe_local.cpu_experts import INT8_BLOCKS_ON_CPU

H, INTER, J, K, LAYERS = 64, 32, 8, 2, 2
TINY = dict(
    model_type="qwen3_moe", hidden_size=H, intermediate_size=64, moe_intermediate_size=INTER, num_experts=J,
    num_experts_per_tok=K, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=384, max_position_embeddings=512,
)  # fmt: skip
FAKE_DRAM_GBPS = 10.0


def expected_expert_bytes(fmt: str, dtype_bytes: int) -> int:
    weights = [(2 * INTER, H), (H, INTER)]  # [out, in]
    if fmt == "bf16":  # unquantised: the compute dtype
        return sum(a * b for a, b in weights) * dtype_bytes
    if fmt == "int8":
        return sum(a * b + 4 * a for a, b in weights)
    if fmt == "int4":
        return sum(a * b // 2 + (b // (64 if b % 64 == 0 else 32)) * a * 2 * dtype_bytes for a, b in weights)
    if fmt == "nf4":
        return sum(math.ceil(a * b / 2) + 4 * math.ceil(a * b / 64) for a, b in weights)
    raise AssertionError(fmt)


def expected_resident_bytes(model_dir, dtype: torch.dtype, dense: str = "bf16") -> int:
    """Every non-expert weight of the plain model, its input embedding table counted as one row; with a packed
    `dense` format the attention projections and the output head (this model's linear layers; its router is not
    one) in their packed size: int8 a byte per weight and a float32 scale per row, int4 half a byte and a (scale,
    zero) pair per 64 weights in the compute dtype."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        out, size = p.shape[0], p.element_size()
        if dense != "bf16" and name.endswith(("_proj.weight", "lm_head.weight")):
            total += p.numel() + 4 * out if dense == "int8" else p.numel() // 2 + (p.shape[1] // 64) * out * 2 * size
            continue
        total += (p[0].numel() if name.endswith("embed_tokens.weight") else p.numel()) * size
    return total


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_synthetic(tmp_path_factory.mktemp("tiny-qwen3"), TINY, LAYERS, [cpu_decode.TEXT])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_count_each_format_at_its_stored_size(tiny_dir, tmp_path, dtype):
    settings = cpu_decode.DecodeSettings(tokens=3, rounds=2, dtype=dtype)
    drams = iter([FAKE_DRAM_GBPS, 2 * FAKE_DRAM_GBPS])
    rows, info = cpu_decode.benchmark(tiny_dir, settings, tmp_path / "q", dram=lambda: next(drams))
    assert [r.fmt for r in rows] == list(cpu_decode.FORMATS)
    assert info["dtype"] == dtype and info["dram_gbps"] == [FAKE_DRAM_GBPS, 2 * FAKE_DRAM_GBPS]
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    resident = {f: expected_resident_bytes(tiny_dir, getattr(torch, dtype), f) for f in ("bf16", "int8", "int4")}
    for r in rows:
        assert r.rounds == 2 and r.dtype == dtype and r.tok_s > 0 and r.experts_ms > 0
        native = "fp32 native" if dtype == "float32" else "bf16 native"
        assert r.kernel in ((native, INT8_BLOCKS_ON_CPU.name) if (r.fmt, dtype) == ("int8", "float32") else (native,))
        assert r.expert_bytes_per_token == K * LAYERS * expected_expert_bytes(r.fmt, size), r.fmt
        # dense format auto: the attention and the head packed as int8/int4 experts, unpacked beside bf16/nf4 ones
        # (int8's names its product: the faster one on this machine, dtype_verdicts.py; a token reads its codes once)
        dense, _, product = r.dense.partition(" ")
        assert dense == (r.fmt if r.fmt in ("int8", "int4") else "bf16")
        assert product in (("(openvino)", "(torch)") if r.fmt == "int8" else ("",))
        assert r.bytes_per_token == r.expert_bytes_per_token + resident[dense], r.fmt
        # the limit of each round is its own DRAM figure over the bytes; the median of the two rounds is their mean
        assert r.limit_tok_s == pytest.approx(1.5 * FAKE_DRAM_GBPS * 1e9 / r.bytes_per_token)
    by = {r.fmt: r for r in rows}
    assert by["int4"].expert_bytes_per_token < by["int8"].expert_bytes_per_token < by["bf16"].expert_bytes_per_token


def test_auto_gives_each_format_the_dtype_a_load_of_it_would_choose(tiny_dir, monkeypatch):
    from fmoe_local import dtype_verdicts

    def resolve(name, device, stored, expert_format):  # noqa: ANN001, ANN202 - dtype_verdicts.resolve_dtype's call
        return torch.bfloat16 if expert_format in ("int8", "int4") else torch.float32

    monkeypatch.setattr(dtype_verdicts, "resolve_dtype", resolve)
    got = [cpu_decode.compute_dtype("auto", tiny_dir, fmt) for fmt in cpu_decode.FORMATS]
    assert got == ["float32", "bfloat16", "bfloat16", "float32"]
    assert cpu_decode.compute_dtype("float32", tiny_dir, "int4") == "float32"  # an explicit dtype stays


def test_summary_takes_each_rounds_share_of_its_own_limit():
    tb = cpu_decode.TokenBytes(experts=600, resident=400)
    samples = [
        cpu_decode.Sample("int8", tok_s=2.0, experts_s=0.5, dram_gbps=1e-6, bytes=tb),  # limit 1 tok/s
        cpu_decode.Sample("int8", tok_s=3.0, experts_s=0.5, dram_gbps=2e-6, bytes=tb),  # limit 2 tok/s
        cpu_decode.Sample("int8", tok_s=8.0, experts_s=0.1, dram_gbps=4e-6, bytes=tb, note="spill"),  # limit 4 tok/s
    ]
    (row,) = cpu_decode.summarise(samples, {"int8": "bfloat16"})
    assert row.tok_s == 3.0 and row.limit_tok_s == pytest.approx(2.0)
    assert row.of_limit == pytest.approx(2.0)  # ratios 2, 1.5, 2
    # experts' limit: 600 bytes at 1, 2, 4 kB/s = 0.6, 0.3, 0.15 s against 0.5, 0.5, 0.1 s
    assert row.experts_of_limit == pytest.approx(1.2) and row.experts_ms == pytest.approx(500.0)
    assert row.note == "spill"


def test_command_builds_once_then_reuses_the_checkpoint_and_prints_the_table(tmp_path, monkeypatch, capsys):
    from fmoe_local import bandwidth

    monkeypatch.setitem(synthetic.SYNTHETIC, "tiny", TINY)
    monkeypatch.setattr(bandwidth, "dram_read_gbps", lambda: FAKE_DRAM_GBPS)
    argv = ["--shape", "tiny", "--layers", "1", "--formats", "int4,bf16", "--tokens", "2", "--rounds", "1"]
    argv += ["--dtype", "float32", "--work-dir", str(tmp_path), "--json", str(tmp_path / "out.json")]
    assert cpu_decode.main(argv) == 0
    first = capsys.readouterr()
    assert "built the synthetic checkpoint" in first.err
    lines = [line for line in first.out.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| format | dense weights | computes in | tok/s | MB / token") and len(lines) == 4
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["int4", "bf16"]
    assert [line.split("|")[2].strip() for line in lines[2:]] == ["int4", "bf16"]
    assert [line.split("|")[3].strip() for line in lines[2:]] == ["float32", "float32"]
    saved = json.loads((tmp_path / "out.json").read_text())
    assert [r["fmt"] for r in saved["rows"]] == ["int4", "bf16"] and saved["info"]["dtype"] == "float32"
    assert cpu_decode.main(argv) == 0
    assert "reusing the synthetic checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, said",
    [(["--formats", "fp8"], "Unknown format 'fp8'"), (["--policy", "nope"], "Unknown policy 'nope'")],
)
def test_command_refuses_unknown_names_before_building_anything(tmp_path, capsys, argv, said):
    assert cpu_decode.main([*argv, "--work-dir", str(tmp_path)]) == 2
    assert said in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
