"""The embedded demo model: a small trained Qwen3-MoE chat LM shipped inside the package (weights/).

Scope: tell callers where the shipped checkpoint lives. Its trainer, corpus and routing analysis are
fmoe_bench/demo/, outside the runtime. This module does NOT load the model (the runtime does, through the same path
as any downloaded checkpoint).
"""

from __future__ import annotations

from pathlib import Path

_WEIGHTS = Path(__file__).resolve().parent / "weights"


def demo_model_dir() -> Path:
    """Directory of the shipped demo checkpoint (config.json, model.safetensors, tokenizer, generation config)."""
    if not (_WEIGHTS / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"The demo model is missing from {_WEIGHTS}. Reinstall fmoe-local, or pass --model with a downloaded model."
        )
    return _WEIGHTS
