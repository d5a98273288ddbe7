"""Expert formats: packing and dequantising, the stored layout, sizes, and the packed host store and cache slots."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fmoe_local import expert_formats as ef
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.runtime import Runtime


def _weights(out_f: int = 48, in_f: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("fmt", "tolerance"), [("int8", 0.01), ("int4", 0.1), ("nf4", 0.2)])
def test_dequantised_weights_are_close_to_the_original_and_deterministic(fmt, tolerance):
    w = _weights()
    param = ef.layout(fmt, {"w": tuple(w.shape)})["w"]
    stored = ef.pack(param, w, torch.float32)
    dense = ef.unpack(param, stored, torch.float32)
    assert dense.shape == w.shape and dense.dtype == torch.float32
    # Relative to each row's (int8) or block's (nf4) largest magnitude; 4-bit levels are ~0.17 apart at most.
    assert (dense - w).abs().max() <= tolerance * w.abs().max()
    assert not torch.equal(dense, w)
    again = ef.unpack(param, ef.pack(param, w, torch.float32), torch.float32)
    assert torch.equal(dense, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_int4_and_int8_products_compute_the_dequantised_weights(dtype):
    # What a CPU device runs (PackedRows' products) is the product with the weights every other path dequantises.
    w, x = _weights(64, 128), _weights(3, 128, seed=1).to(dtype)
    for fmt in ("int8", "int4"):
        param = ef.layout(fmt, {"w": (64, 128)})["w"]
        stored = {f"w.{k}": v for k, v in ef.pack(param, w, dtype).items()}
        dense = ef.PackedRows(stored, {"w": param}, dtype)["w"]
        product = ef.PackedRows(ef.to_cpu_layout({"w": param}, dict(stored)), {"w": param}, dtype, products=True)["w"]
        assert isinstance(product, ef.Int8Weight if fmt == "int8" else ef.Int4Weight)
        got, want = product.linear(x, None), x @ dense.t()
        assert got.dtype == dtype
        # The same sums, accumulated in another order (and in float32 for bf16 rather than rounded per product).
        assert torch.allclose(got.float(), want.float(), rtol=0.02 if dtype == torch.bfloat16 else 1e-4, atol=0.05)


def test_int4_keeps_each_groups_ends_within_half_a_step():
    w = _weights(16, 96)  # 96 is no multiple of 64: groups of 32
    param = ef.layout("int4", {"w": (16, 96)})["w"]
    stored = ef.pack(param, w, torch.float32)
    assert stored["q"].shape == (16, 48) and stored["sz"].shape == (3, 16, 2)
    dense = ef.unpack(param, stored, torch.float32).reshape(16, 3, 32)
    groups = w.reshape(16, 3, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    assert ((dense - groups).abs().amax(-1) <= step / 2 + 1e-5).all()


def test_nf4_keeps_block_maxima_exactly_and_handles_a_partial_block():
    w = _weights(3, 37)  # 111 weights: one full block of 64 and a partial one, an odd count of codes
    param = ef.layout("nf4", {"w": (3, 37)})["w"]
    stored = ef.pack(param, w, torch.float32)
    assert stored["q"].shape == (56,) and stored["absmax"].shape == (2,)
    dense = ef.unpack(param, stored, torch.float32).reshape(-1)
    flat = w.reshape(-1)
    for start in (0, 64):
        block = flat[start : start + 64]
        i = block.abs().argmax()
        assert dense[start + i] == block[i]  # ±1.0 is an NF4 level: the block's largest weight is exact


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_nf4_bytes_are_bitsandbytes_layout():
    # A bitsandbytes-quantised tensor read through our nf4 dequantising gives bitsandbytes' own dequantisation.
    import bitsandbytes.functional as bnb

    w = _weights(32, 64)
    q, state = bnb.quantize_4bit(w, blocksize=ef.NF4_BLOCK, quant_type="nf4")
    assert torch.allclose(state.code, torch.tensor(ef.NF4_CODE))
    param = ef.layout("nf4", {"w": (32, 64)})["w"]
    ours = ef.unpack(param, {"q": q.reshape(-1), "absmax": state.absmax}, torch.float32)
    assert torch.equal(ours, bnb.dequantize_4bit(q, state))
    # And our packing chooses the same levels bitsandbytes does.
    mine = ef.pack(param, w, torch.float32)
    assert torch.equal(mine["q"], q.reshape(-1)) and torch.equal(mine["absmax"], state.absmax)


def test_layout_packs_weights_and_keeps_biases_dense():
    shapes = {"gate_up_proj": (64, 32), "gate_up_proj_bias": (64,), "down_proj": (32, 64)}
    stored = ef.stored_shapes(ef.layout("nf4", shapes), torch.bfloat16)
    assert stored["gate_up_proj.q"] == ((1024,), torch.uint8)
    assert stored["gate_up_proj.absmax"] == ((32,), torch.float32)
    assert stored["gate_up_proj_bias"] == ((64,), torch.bfloat16)
    assert ef.stored_shapes(ef.layout("bf16", shapes), torch.bfloat16)["down_proj"] == ((32, 64), torch.bfloat16)


def test_sizes_follow_the_format():
    bf16 = 3 * 4096 * 14336 * 2  # one Mixtral-8x7B expert
    assert ef.bytes_per_expert(bf16, "bf16") == bf16 == ef.bytes_per_expert(bf16, "auto")
    assert ef.bytes_per_expert(bf16, "int8") == bf16 // 2
    assert ef.bytes_per_expert(bf16, "nf4") == int(bf16 * 4.5 / 16) == ef.bytes_per_expert(bf16, "int4")
    with pytest.raises(ValueError, match="Known formats"):
        ef.bytes_per_expert(bf16, "fp3")


def test_an_unknown_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="Choose auto .* bf16 .* int8 .* nf4"):
        RuntimeConfig(expert_format="q3").validate()


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
def test_host_ram_and_cache_slots_hold_the_packed_form(fmt, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3_moe")
    dense = RuntimeConfig(device="cpu", cache_experts=3, expert_format="bf16")
    with Runtime.load(model_dir, dense) as runtime:
        dense_bytes = runtime.info.expert_bytes
    config = dense.with_changes(expert_format=fmt, quant_cache_dir=str(tmp_path))
    with Runtime.load(model_dir, config) as runtime:
        host, cache = runtime.engine.host, runtime.engine.cache
        ratio = {"int8": 4, "int4": 6, "nf4": 8}[fmt]  # the tiny model is float32: 32 bits → 8, 4 + 64/32, 4.5
        assert runtime.info.expert_bytes < dense_bytes * 1.2 / ratio
        assert host.ram_bytes() == host.ram_experts * host.expert_bytes
        assert host.ram_experts == runtime.info.num_layers * runtime.info.num_experts
        packed = {"int8": torch.int8, "int4": torch.uint8, "nf4": torch.uint8}[fmt]
        assert cache.tensors["down_proj.q"].dtype == packed
        assert cache.allocated_bytes() == 3 * host.expert_bytes
        final = runtime.generate([{"role": "user", "content": "Hello"}], Sampling(greedy=True, max_new_tokens=3))
        assert final.reason in ("length", "stop", "context") and final.stats.misses > 0


def test_cache_gb_buys_more_experts_in_a_packed_format(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("olmoe")
    counts = {}
    for fmt in ("bf16", "nf4"):
        config = RuntimeConfig(device="cpu", cache_gb=0.0001, expert_format=fmt, quant_cache_dir=str(tmp_path))
        with Runtime.load(model_dir, config) as runtime:
            counts[fmt] = runtime.info.cache_experts
    assert counts["nf4"] >= 6 * counts["bf16"] > 0


def test_the_cuda_int4_product_applies_only_where_torch_offers_it():
    # bf16 activations on a GPU, [out, in] int4 rows torch's tinygemm tiles: anything else dequantises (no GPU is
    # asked here: every refusal below is decided before the device's capability is read).
    int4 = ef.layout("int4", {"w": (64, 128)})["w"]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ef.cuda_int4_tiles(int4, torch.bfloat16, cpu) == 0
    stored = {f"w.{k}": v for k, v in ef.pack(int4, _weights(64, 128), torch.bfloat16).items()}
    assert isinstance(ef.PackedRows(stored, {"w": int4}, torch.bfloat16)["w"], torch.Tensor)
    assert ef.cuda_int4_tiles(int4, torch.float32, cuda) == 0  # float32 compute: the dequantised path
    assert ef.cuda_int4_tiles(ef.layout("int4", {"w": (60, 128)})["w"], torch.bfloat16, cuda) == 0  # out % 8
    assert ef.cuda_int4_tiles(ef.layout("int8", {"w": (64, 128)})["w"], torch.bfloat16, cuda) == 0
    assert ef.cuda_int4_tiles(ef.layout("int4", {"w": (64, 128)}, True)["w"], torch.bfloat16, cuda) == 0  # [in, out]


# ---- the packers against the plain formula they replaced (main at 42d5564: vectorised per block of rows, no buffers
# reused); the bytes must not move, or every quantised copy on users' disks would differ from a fresh one ----------
def _formula_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    w = w.float()
    s = (w.abs().amax(1) / 127).clamp_(min=1e-12)
    return {"q": torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8), "scale": s}


def _formula_int4(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    a, b = w.shape
    g = ef.int4_group(b)
    groups = w.float().reshape(-1, b // g, g)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_(min=1e-6).to(dtype).float()
    zero = (low + 8 * scale).to(dtype).float()
    codes = (groups - zero[..., None]).div_(scale[..., None]).add_(8).round_().clamp_(0, 15).to(torch.uint8)
    codes = codes.reshape(-1, b)
    return {"q": codes[:, 0::2] | (codes[:, 1::2] << 4), "sz": torch.stack([scale.t(), zero.t()], dim=-1).to(dtype)}


def _formula_nf4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    flat = w.float().reshape(-1)
    n = flat.numel()
    blocks = -(-n // ef.NF4_BLOCK)
    padded = torch.zeros(blocks * ef.NF4_BLOCK)
    padded[:n] = flat
    padded = padded.view(blocks, ef.NF4_BLOCK)
    absmax = padded.abs().amax(1)
    normed = (padded / absmax.clamp(min=1e-12)[:, None]).reshape(-1)[:n]
    code = torch.tensor(ef.NF4_CODE)
    q = torch.zeros(n, dtype=torch.uint8)
    for mid in ((code[1:] + code[:-1]) / 2).tolist():  # the nearest level: the count of midpoints below
        q += normed > mid
    if n % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return {"q": (q[0::2] << 4) | q[1::2], "absmax": absmax}


def _edge_weights(out_f: int, in_f: int, dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(out_f + in_f)) * 0.02
    w[1] = 0  # a row of zeros: the scales' floors
    w[2] = 0.5  # every group and block all-equal
    w[3, : in_f // 2] = -3.0
    w[4] *= 1e30  # huge, and (next) tiny: below the int8 floor of 1e-12
    w[5] *= 1e-30
    w[6, ::3] = 1.0  # ties: weights whose scaled value lands on a level's or a midpoint's edge
    mids = (torch.tensor(ef.NF4_CODE[1:]) + torch.tensor(ef.NF4_CODE[:-1])) / 2
    w[7, : len(mids)] = mids
    w[7, len(mids)] = 1.0
    w[8] = torch.arange(in_f) % 16 - 8.0  # exact int4 codes, and .5 steps below
    w[9] = (torch.arange(in_f) % 32 - 16) / 2
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("out_f", "in_f"), [(16, 64), (300, 896), (37, 96)])  # 300 rows: blocks and a partial one
def test_packers_give_the_bytes_of_the_plain_formula(dtype, out_f, in_f, monkeypatch):
    monkeypatch.setattr(ef, "PACK_BLOCK_BYTES", 64 * 1024)  # several row blocks even on small weights
    w = _edge_weights(out_f, in_f, dtype)
    if dtype == torch.float16:
        w[4] = w[4].clamp(-60000, 60000)
    cases = [(ef.pack_int8(w), _formula_int8(w)), (ef.pack_nf4(w), _formula_nf4(w))]
    for sz_dtype in (torch.bfloat16, torch.float32):
        cases.append((ef.pack_int4(w, sz_dtype), _formula_int4(w, sz_dtype)))
    for got, want in cases:
        assert got.keys() == want.keys()
        for key in got:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    # A view that is not contiguous (a transposed row) packs as its contiguous copy does.
    t = w.t().contiguous().t()
    assert torch.equal(ef.pack_int8(t)["q"], ef.pack_int8(w)["q"])
    assert all(torch.equal(ef.pack_nf4(t)[k], v) for k, v in ef.pack_nf4(w).items())


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """bf16 values of 16-bit patterns given as integers in [0, 65535]."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


def _every_weight_under(top: int) -> torch.Tensor:
    """Blocks of 64 bf16 weights, each led by its largest magnitude, the bf16 of pattern `top`, holding every
    pattern of either sign no larger than it down to 2^-9 of it (the table's whole range: ±top itself, each
    midpoint's neighbours and any weight landing exactly on one), and some far smaller ones: subnormals, ±0."""
    smallest = max(top - 9 * 128, 0)
    magnitudes = torch.cat([torch.arange(smallest, top + 1), torch.tensor([0, 1, 127, 128, 3000, top // 2])])
    magnitudes = magnitudes[magnitudes <= top]
    others = torch.cat([magnitudes, magnitudes | (1 << 15)])
    others = torch.cat([others, others[: -len(others) % 63]])  # whole blocks: repeat the first few
    blocks = torch.cat([torch.full((len(others) // 63, 1), top), others.view(-1, 63)], dim=1)
    return _bf16(blocks)


@pytest.mark.parametrize("exponent", [88, 100, 127, 135, 254])  # a from 2^-39 (the table's least) to 2^127
def test_nf4_of_bf16_weights_gives_the_counted_codes_for_every_weight_and_every_block_maximum(exponent, monkeypatch):
    # bf16 rows are coded by a table on their bits (expert_formats._pack_nf4_bf16); the bytes must be the formula's
    # for every pattern under every mantissa of the block's maximum, and no row block may fall back to counting.
    def no_counting(*args):
        raise AssertionError("a bf16 row block of normal blocks was counted, not looked up")

    monkeypatch.setattr(ef._Nf4Compares, "pack", no_counting)
    for mantissa in range(128):
        top = (exponent << 7) | mantissa
        rows = _every_weight_under(top)
        for negative_top in (False, True):
            w = -rows if negative_top else rows
            got, want = ef.pack_nf4(w.reshape(-1, 128 if len(w) % 2 == 0 else 64)), _formula_nf4(w)
            assert torch.equal(got["absmax"], want["absmax"]) and torch.equal(got["q"], want["q"]), (top, negative_top)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_nf4_of_bf16_weights_gives_bitsandbytes_bytes_for_every_weight():
    # bitsandbytes' CPU quantize_4bit scales by the reciprocal of the maximum (w · (1/a)), we divide; for bf16 weights
    # the codes agree on every pattern under every mantissa of the maximum (on float32 weights beside a midpoint they
    # need not: docs/bench.md, "nf4 of bf16 weights by table"), so a checkpoint bitsandbytes wrote has our bytes.
    import bitsandbytes.functional as bnb

    w = torch.cat([_every_weight_under((127 << 7) | mantissa) for mantissa in range(128)])
    q, state = bnb.quantize_4bit(w, blocksize=ef.NF4_BLOCK, quant_type="nf4")
    ours = ef.pack_nf4(w)
    assert torch.equal(ours["absmax"], state.absmax) and torch.equal(ours["q"], q.reshape(-1))


def test_nf4_of_bf16_rows_with_zero_or_tiny_blocks_gives_the_counted_codes(monkeypatch):
    monkeypatch.setattr(ef, "PACK_BLOCK_BYTES", 8 * 4 * 256)  # row blocks of 4 rows of 256: each case its own
    w = (torch.randn(16, 256, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    w[0, :64] = 0.0  # an all-zero block among normal ones: the table's zero block
    w[1, 64:128] = -0.0
    w[2, 128:] = torch.tensor([0.0, -0.0]).repeat(64)
    w[4, :64] *= 1e-30  # a block whose maximum is below 2^-39: counted, the whole row block
    w[8, :64] = _bf16(torch.arange(64))  # subnormals and zero: a maximum that is not a normal bf16
    w[12, :64] = _bf16(torch.tensor([(88 << 7) - 1] * 64))  # the largest pattern below the table's least
    counted = []
    original = ef._Nf4Compares.pack
    monkeypatch.setattr(
        ef._Nf4Compares,
        "pack",
        lambda self, source, *rest: counted.append(source.shape[0]) or original(self, source, *rest),
    )
    got, want = ef.pack_nf4(w), _formula_nf4(w)
    assert torch.equal(got["absmax"], want["absmax"]) and torch.equal(got["q"], want["q"])
    assert counted == [4, 4, 4]  # rows 4, 8 and 12's row blocks; the zero blocks of rows 0-2 were looked up


def test_packing_leaves_a_float32_input_as_it_was():
    w = _weights(8, 64)
    before = w.clone()
    ef.pack_int8(w), ef.pack_int4(w, torch.bfloat16), ef.pack_nf4(w)
    assert torch.equal(w, before)  # the packers work in place on their own buffers, never on the caller's weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_weight_with_inf_or_nan_is_refused_with_a_sentence(fmt, bad, dtype):
    w = _weights(8, 64).to(dtype)
    w[5, 7] = bad
    param = ef.layout(fmt, {"w": (8, 64)})["w"]
    with pytest.raises(ValueError, match="inf or NaN.*damaged"):
        ef.pack(param, w, torch.bfloat16)


@pytest.mark.parametrize("shape", [(16, 32), (208, 2048), (320, 2048)])  # blocks of 64 rows, and a tail of 16
def test_torch_s_cpu_int4_layout_made_in_blocks_is_the_whole_conversion(shape, monkeypatch):
    monkeypatch.setattr(ef, "PACK_BLOCK_BYTES", 64 * 1024)
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    codes = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(shape[0], -1).to(torch.int32)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(ef.Int4Weight.from_portable(q), whole)


@pytest.mark.parametrize(("out_f", "in_f"), [(300, 896), (37, 96)])  # 37 × 96: nf4's flat path (no whole blocks)
def test_a_weight_read_in_parts_packs_as_the_stacked_weight(out_f, in_f, monkeypatch):
    # A checkpoint's separate gate and up rows are packed in turn (read_expert for a packer), never concatenated.
    monkeypatch.setattr(ef, "PACK_BLOCK_BYTES", 64 * 1024)
    w = _edge_weights(out_f, in_f, torch.bfloat16)
    parts = [w[:100], w[100:]] if out_f > 100 else [w[:10], w[10:]]
    for fmt in ("int8", "int4", "nf4"):
        param = ef.layout(fmt, {"w": (out_f, in_f)})["w"]
        got, want = ef.pack(param, parts, torch.bfloat16), ef.pack(param, w, torch.bfloat16)
        assert all(torch.equal(got[k], want[k]) for k in want), fmt
