"""The live benchmark's prompts: every shared file format gives its first user turn; samples are seeded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fmoe_bench import prompts


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_prompt_files_of_every_shared_format_give_the_first_user_turn(tmp_path):
    d = tmp_path / "prompts"
    d.mkdir()
    alpaca = {"instruction": "Sort these words.", "instances": [{"input": "b a c", "output": "a b c"}]}
    _write_jsonl(d / "a.jsonl", [alpaca, {"instruction": "Say hi.", "instances": [{"input": "", "output": "hi"}]}])
    _write_jsonl(d / "b.jsonl", [{"prompt": "Dolly question?", "source": "dolly"}])
    (d / "c.json").write_text(json.dumps([{"id": "x", "prompt": "ShareGPT turn"}, {"prompt": ""}]))
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"}]
    (d / "d.json").write_text(json.dumps([{"messages": chat}, {"conversations": [{"from": "human", "value": "v"}]}]))
    assert prompts.read_prompts(d / "a.jsonl") == ["Sort these words.\n\nb a c", "Say hi."]
    every = prompts.read_prompts(d)
    assert every == ["Sort these words.\n\nb a c", "Say hi.", "Dolly question?", "ShareGPT turn", "first", "v"]
    sample = prompts.sample_prompts(d, 3, seed=1, max_chars=10)
    assert sample == prompts.sample_prompts(d, 3, seed=1, max_chars=10)
    assert len(sample) == 3 and all(len(p) <= 10 for p in sample)


def test_the_shared_prompts_folder_samples_when_present():
    folder = prompts.shared_data_dir() / "prompts"
    if not folder.exists():
        pytest.skip("the shared prompts are not beside this checkout")
    sample = prompts.sample_prompts(folder, 8, seed=0)
    assert len(set(sample)) == 8 and sample == prompts.sample_prompts(folder, 8, seed=0)
    assert all(0 < len(p) <= 1500 for p in sample)
