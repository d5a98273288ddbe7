"""Constrained-decoding benchmark: what holding a reply to a JSON schema costs per token.

Scope: two tables. Per library (llguidance, the one the runtime uses; xgrammar when installed, the alternative it
was chosen over), the grammar's own work per token — the allowed-token mask computed, applied to logits of the
model's width, the token consumed — walking the tokens of a schema-valid reply. Then the runtime end to end (greedy,
the demo model unless --model): ms per token without a grammar and with one. Prints; asserts nothing.
`fmoe-local bench constrained [--model DIR] [--tokens N] [--repeats R]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from fmoe_local.cli_args import whole

# A strict schema of the shape agents send (nested object, enum, array, bounded strings).
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 7},
        "detail": {
            "type": "object",
            "properties": {"wind": {"type": "boolean"}, "note": {"type": "string", "maxLength": 80}},
            "required": ["wind", "note"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "days", "detail"],
    "additionalProperties": False,
}
REPLY = {"city": "Lisbon", "unit": "celsius", "days": [1, 2, 3, 4, 5], "detail": {"wind": True, "note": "a calm sea"}}
PROMPT = [{"role": "user", "content": "The weather in Lisbon for five days, as JSON."}]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("constrained", help="per-token cost of holding a reply to a JSON schema")
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the demo model)")
    p.add_argument("--tokens", type=whole(1, 4096), default=64, help="tokens generated per end-to-end run")
    p.add_argument("--repeats", type=whole(1, 100), default=5)


def _walk_llguidance(tokenizer, vocab: int, ids: list[int], eos: int) -> float:  # noqa: ANN001
    import torch

    from fmoe_local.constrained import Grammars, json_schema_grammar

    constraint = Grammars(tokenizer, vocab, {eos}).start(json_schema_grammar(SCHEMA))
    logits = torch.zeros(vocab)
    t0 = time.perf_counter()
    for token in ids:
        constraint.mask(logits)
        constraint.advance(token)
    return (time.perf_counter() - t0) / len(ids)


def _walk_xgrammar(tokenizer, vocab: int, ids: list[int]) -> float | None:  # noqa: ANN001
    try:
        import xgrammar
    except ImportError:
        return None
    import torch

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    t0 = time.perf_counter()
    for token in ids:
        matcher.fill_next_token_bitmask(bitmask)
        masked = logits.clone()
        xgrammar.apply_token_bitmask_inplace(masked, bitmask)
        matcher.accept_token(token)
    return (time.perf_counter() - t0) / len(ids)


def run(args: argparse.Namespace) -> int:
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.constrained import json_schema_grammar
    from fmoe_local.demo import demo_model_dir
    from fmoe_local.runtime import Runtime

    model = args.model or demo_model_dir()
    with Runtime.load(model, RuntimeConfig(device="cpu")) as runtime:
        engine = runtime._engine  # noqa: SLF001 - a benchmark reads the tokenizer and the width it masks
        tok, vocab = engine.tokenizer, int(engine.model.config.vocab_size)
        ids = tok(json.dumps(REPLY, separators=(",", ":")), add_special_tokens=False)["input_ids"]
        eos = sorted(engine.eos_ids)[0]
        print(f"runtime end to end, greedy, {args.tokens} tokens at most, median of {args.repeats}")
        print(f"{'grammar':<12} {'tokens':>7} {'ms/token':>9}")
        kinds = (("none", None), ("json_schema", json_schema_grammar(SCHEMA)))
        rows: dict[str, list] = {label: [] for label, _ in kinds}
        for _ in range(args.repeats):  # interleaved, so that a change in the machine's load falls on both alike
            for label, grammar in kinds:
                sampling = Sampling(greedy=True, max_new_tokens=args.tokens, grammar=grammar)
                final = runtime.generate(PROMPT, sampling)
                if final.reason == "error":
                    print(f"{label}: {final.error}")
                    return 1
                rows[label].append((final.stats.tokens, final.stats.tpot_s))
        for label, got in rows.items():
            print(f"{label:<12} {got[0][0]:>7} {1000 * statistics.median(r[1] for r in got):>9.3f}")
        print()
        print(f"grammar alone: model {model.name}, vocab {vocab}, a reply of {len(ids)} tokens walked {args.repeats}×")
        print(f"{'library':<12} {'ms/token (median)':>18}")
        for name, walk in (
            ("llguidance", lambda: _walk_llguidance(tok, vocab, ids, eos)),
            ("xgrammar", lambda: _walk_xgrammar(tok, vocab, ids)),
        ):
            times = [walk() for _ in range(args.repeats)]
            shown = "not installed" if times[0] is None else f"{1000 * statistics.median(times):.3f}"
            print(f"{name:<12} {shown:>18}")
    return 0
