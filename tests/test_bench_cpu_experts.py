"""bench cpu-experts: every kernel of every format is timed on the shape's real module, the fastest is marked."""

from __future__ import annotations

import json

import pytest

from fmoe_bench import cpu_experts as bench
from fmoe_bench.cli import main
from fmoe_local.cpu_experts import KERNELS


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(bench, "MIN_CYCLE_BYTES", 1)
    monkeypatch.setattr(bench.bandwidth, "llc_bytes", lambda: 1)
    monkeypatch.setattr(bench.bandwidth, "dram_read_gbps", lambda: 10.0)
    monkeypatch.setitem(bench.SHAPES, "tiny-gated", bench.ExpertShape("tiny-gated", "qwen3_moe", 64, 32, "test"))
    monkeypatch.setitem(bench.SHAPES, "tiny-oss", bench.ExpertShape("tiny-oss", "gpt_oss", 64, 32, "test"))


def test_every_kernel_of_every_format_gets_a_row_and_the_fastest_at_one_token_is_chosen(small):
    rows = bench.measure_shape(bench.SHAPES["tiny-gated"], bench.FORMATS, (1, 4), 10.0, 1 << 30, passes=1)
    for fmt in bench.FORMATS:
        mine = [r for r in rows if r.fmt == fmt]
        assert {(r.kernel, r.tokens) for r in mine} == {(k.name, t) for k in KERNELS[fmt] for t in (1, 4)}
        one = [r for r in mine if r.tokens == 1]
        assert [r.kernel for r in one if r.chosen] == [min(one, key=lambda r: r.ms_per_expert).kernel]
        assert all(r.experts >= 2 and r.gbps > 0 and r.dram_fraction == pytest.approx(r.gbps / 10.0) for r in mine)


def test_gpt_oss_layout_keeps_only_the_kernels_that_read_in_out_rows(small):
    rows = bench.measure_shape(bench.SHAPES["tiny-oss"], ("bf16", "int8"), (1,), 10.0, 1 << 30, passes=1)
    assert {r.fmt for r in rows} == {"bf16"}


def test_the_command_prints_the_table_and_writes_json(small, tmp_path, capsys):
    out = tmp_path / "rows.json"
    code = main(["cpu-experts", "--shapes", "tiny-gated", "--formats", "fp32", "--tokens", "1", "--passes", "1",
                 "--json", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert (
        "DRAM read bandwidth measured here: 10.0 GB/s" in printed and "| tiny-gated | fp32 | fp32 native |" in printed
    )
    assert json.loads(out.read_text())["rows"][0]["chosen"] is True


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--shapes", "mixtral-9x9b"], "Unknown shape 'mixtral-9x9b'"),
        (["--formats", "fp8"], "Unknown format 'fp8'"),
        (["--tokens", "0"], "--tokens: give whole numbers of at least 1 separated by commas"),
        (["--tokens", "a"], "--tokens: give whole numbers of at least 1 separated by commas"),
    ],
)
def test_bad_arguments_are_refused_with_a_sentence(argv, words, capsys):
    try:
        code = main(["cpu-experts", *argv])
    except SystemExit as refused:  # a flag's own range is refused while parsing (cli_args.py)
        code = refused.code
    assert code == 2
    assert words in capsys.readouterr().err
