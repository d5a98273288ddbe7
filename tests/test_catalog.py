"""The curated list: internal consistency of the sizes the wizard shows."""

from __future__ import annotations

from huggingface_hub.utils import filter_repo_objects

from fmoe_local.catalog import CATALOG, GB, find, local_name


def test_entries_are_consistent():
    assert len({e.repo_id for e in CATALOG}) == len(CATALOG)
    for e in CATALOG:
        assert e.active_params_b < e.total_params_b
        assert 1 <= e.top_k < e.num_experts
        # Experts (bf16) plus the resident part make up the whole model: 2 bytes per parameter, within 10%.
        whole = (e.experts_bytes + e.resident_bytes) / 2 / 1e9
        assert abs(whole - e.total_params_b) / e.total_params_b < 0.1, e.repo_id


def test_mixtral_expert_size_matches_design_doc():
    assert find("mistralai/mixtral-8x7b-instruct-v0.1").expert_bytes == 3 * 4096 * 14336 * 2
    assert find("nobody/nothing") is None


def test_patterns_keep_weights_and_tokenizer_and_skip_duplicates():
    files = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer.model",
        "chat_template.jinja",
        "README.md",
        "original/model.safetensors",
        "consolidated.00.pt",
        "pytorch_model.bin",
    ]
    entry = CATALOG[0]
    kept = set(
        filter_repo_objects(
            files, allow_patterns=list(entry.allow_patterns), ignore_patterns=list(entry.ignore_patterns)
        )
    )
    assert kept == {
        "config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer.model",
        "chat_template.jinja",
    }
    assert local_name("a/b") == "a--b"
    assert GB == 10**9


def test_a_packed_dense_format_shrinks_all_but_the_input_embedding_table():
    qwen3 = find("Qwen/Qwen3-30B-A3B-Instruct-2507")
    assert qwen3.embedding_bytes == 151936 * 2048 * 2  # the vocabulary × hidden table in bf16
    rest = qwen3.resident_bytes - qwen3.embedding_bytes
    assert qwen3.resident_bytes_for("bf16") == qwen3.resident_bytes
    assert qwen3.resident_bytes_for("int8") == qwen3.embedding_bytes + rest // 2
    assert qwen3.resident_bytes_for("int4") == qwen3.embedding_bytes + round(rest * 4.5 / 16)
    for e in CATALOG:
        assert 0 < e.embedding_bytes < e.resident_bytes, e.repo_id
