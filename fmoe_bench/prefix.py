"""`fmoe-local bench prefix`: time to first token with and without prefix reuse (prefix_cache.py).

Scope: per model, a chat of `--turns` turns (turns 1, 5 and the last measured) and a `--system-tokens` system prompt
shared by `--requests` requests, each timed on a runtime that keeps its KV caches and on one that prefills every
prompt whole (prefix_cache_gb=0), against the TTFT of a fresh prompt holding only the tokens the reusing request had
to prefill (the goal: a turn adding N tokens to a reused prefix within 1.3x a fresh N-token prompt). Prints a table;
asserts nothing (performance is measured, never a test).

Protocol: the ratio's two sides are interleaved — every reusing request is followed at once by the fresh prompt of
the very tokens it prefilled (on the runtime that keeps nothing), so both see the same load — and each row gives the
median and the minimum over its pairs: the system prompt's requests 2 to `--requests` (9 pairs by default); for a
chat turn, the turn in the conversation, then `--repeats` − 1 more, each from the state the conversation had before
it (the prefix caches emptied, the previous turn asked again: greedy, so the same reply and the same kept tokens),
10 pairs by default. A fresh prompt, and a turn asked only to be timed, generate one token (its TTFT is all that is
timed). The whole prompt's TTFT is the median of three runs (it is not in the ratio).

Models: the demo model and one random-weight tiny model per family (bench/tiny_families.py, the demo's tokenizer),
each with its context raised to 8,192 in a temporary copy, so that the long prompts fit (the demo was trained on
1,024 tokens: its replies past that mean nothing, their timings do). Prompts are text (the /v1/completions path,
"User: …\\nAssistant:"), so no chat template's render is in the way; the chat's reply text goes back into the next
prompt as a chat client sends it. TTFT is the runtime's own (from the prompt's ids to the first token: the reuse,
its copy and the prefill). torch and transformers are imported when measuring, so that the command line stays fast.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fmoe_local.cli_args import whole

CONTEXT = 8192
USER_LINES = (
    "Tell me about the ocean, its waves and its tides.",
    "Why does the moon pull the water twice a day?",
    "Write a short poem about a lighthouse keeper.",
    "Explain how a router picks two experts for every token.",
    "What would change if the earth had two moons?",
    "Give three tips for keeping a small boat dry.",
    "Summarise what we discussed so far in one sentence.",
)
SYSTEM_TEXT = (
    "You are a careful assistant for a coding agent. Read the repository's files before you change them, keep each "
    "change small, explain why it is needed, run the tests that cover it, and never invent a result you did not "
    "see. Tools: read_file(path), write_file(path, text), run(command), search(query). "
)


WHOLE_RUNS = 3  # runs of each whole prompt (median), which is not in the ratio


@dataclass
class Row:
    model: str
    case: str
    prompt_tokens: int
    reused: int  # the median over the pairs
    ttft_reuse_ms: float  # medians over the pairs
    ttft_whole_ms: float
    fresh_tokens: int  # the fresh prompt: only what the reusing request had to prefill (the median over the pairs)
    ttft_fresh_ms: float
    reuse_min_ms: float
    fresh_min_ms: float
    pairs: int  # reusing and fresh requests, one after the other

    @property
    def ratio(self) -> float:
        """Median TTFT with reuse over that of a fresh prompt of the new tokens: the goal is at most 1.3."""
        return self.ttft_reuse_ms / self.ttft_fresh_ms if self.ttft_fresh_ms else float("nan")

    @property
    def ratio_of_mins(self) -> float:
        return self.reuse_min_ms / self.fresh_min_ms if self.fresh_min_ms else float("nan")


@dataclass
class Pair:
    """One reusing request and the fresh prompt of the tokens it prefilled, timed one right after the other."""

    reuse_ms: float
    fresh_ms: float
    reused: int
    fresh_tokens: int
    final: object  # the reusing request's Finished


def _ttft_ms(runtime: object, prompt: str, sampling: object) -> tuple[float, object]:
    final = runtime.generate(prompt, sampling)
    if final.reason == "error":
        raise ValueError(f"A benchmark request failed: {final.error}")
    return 1000 * final.stats.ttft_s, final


def _median_ttft(runtime: object, prompt: str, sampling: object, repeats: int) -> tuple[float, int]:
    runs = [_ttft_ms(runtime, prompt, sampling) for _ in range(repeats)]
    return statistics.median(ms for ms, _ in runs), runs[0][1].stats.prompt_tokens


def _first_token() -> object:
    """Sampling for a request timed only to its first token."""
    from fmoe_local.config import Sampling

    return Sampling(greedy=True, max_new_tokens=1)


def pair(reuse: object, whole_: object, prompt: str, sampling: object) -> Pair:
    """`prompt` on the reusing runtime, then at once a fresh prompt of the tokens it prefilled on the other."""
    reuse_ms, final = _ttft_ms(reuse, prompt, sampling)
    fresh_ms, fresh = _ttft_ms(whole_, new_part(reuse, prompt, final.stats.cached_tokens), _first_token())
    return Pair(reuse_ms, fresh_ms, final.stats.cached_tokens, fresh.stats.prompt_tokens, final)


def row(name: str, case: str, prompt_tokens: int, pairs: list[Pair], whole_ms: float) -> Row:
    reuse, fresh = [p.reuse_ms for p in pairs], [p.fresh_ms for p in pairs]
    return Row(
        name,
        case,
        prompt_tokens,
        int(statistics.median(p.reused for p in pairs)),
        statistics.median(reuse),
        whole_ms,
        int(statistics.median(p.fresh_tokens for p in pairs)),
        statistics.median(fresh),
        min(reuse),
        min(fresh),
        len(pairs),
    )


def system_prompt(tokenizer: object, tokens: int) -> str:
    """SYSTEM_TEXT repeated and cut to `tokens` tokens of this tokenizer (re-encoding may differ by a few)."""
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer(SYSTEM_TEXT, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:tokens])


def new_part(runtime: object, prompt: str, reused: int) -> str:
    """The text of the prompt's tokens a reusing request prefilled: a fresh prompt of (about) those N tokens."""
    return runtime.engine.tokenizer.decode(runtime.tokenize(prompt)[reused:])


def chat_rows(name: str, reuse: object, whole_: object, turns: int, reply: int, repeats: int) -> list[Row]:
    """The chat: one conversation on the reusing runtime (from an empty prefix cache), each measured turn paired
    with its fresh prompt; then `repeats` − 1 more pairs per measured turn, each after the previous turn asked again
    on an emptied prefix cache (the state the conversation had before the turn)."""
    from fmoe_local.config import Sampling

    sampling = Sampling(greedy=True, max_new_tokens=reply)
    measured = sorted({1, min(5, turns), turns})
    pairs: dict[int, list[Pair]] = {k: [] for k in measured}
    prompts: list[str] = []
    reuse.reset_cache()
    text = ""
    for k in range(1, turns + 1):
        prompt = text + f"User: {USER_LINES[(k - 1) % len(USER_LINES)]}\nAssistant:"
        prompts.append(prompt)
        if k in pairs:
            pairs[k].append(pair(reuse, whole_, prompt, sampling))
            final = pairs[k][-1].final
        else:
            _, final = _ttft_ms(reuse, prompt, sampling)
        text = prompt + final.text + "\n"
    rows = []
    for k in measured:
        for _ in range(repeats - 1):
            reuse.reset_cache()
            if k > 1:
                _ttft_ms(reuse, prompts[k - 2], sampling)
            pairs[k].append(pair(reuse, whole_, prompts[k - 1], _first_token()))
        whole_ms, length = _median_ttft(whole_, prompts[k - 1], _first_token(), WHOLE_RUNS)
        rows.append(row(name, f"chat turn {k}", length, pairs[k], whole_ms))
    return rows


def system_rows(name: str, reuse: object, whole_: object, tokens: int, requests: int) -> list[Row]:
    """One system prompt, `requests` different questions: the first request prefills it, the others reuse it, each
    paired with its fresh prompt."""
    from fmoe_local.config import Sampling

    sampling = Sampling(greedy=True, max_new_tokens=4)
    system = system_prompt(reuse.engine.tokenizer, tokens)
    questions = [f"User: {USER_LINES[i % len(USER_LINES)]} (request {i + 1})\nAssistant:" for i in range(requests)]
    prompts = [f"System: {system}\n{q}" for q in questions]
    reuse.reset_cache()
    first_ms, first = _ttft_ms(reuse, prompts[0], sampling)
    later = [pair(reuse, whole_, p, sampling) for p in prompts[1:]]
    whole_ms, n = _median_ttft(whole_, prompts[min(1, requests - 1)], _first_token(), WHOLE_RUNS)
    if not later:  # one request: its fresh prompt is the question alone
        fresh_ms, fresh = _ttft_ms(whole_, questions[0], _first_token())
        only = Pair(first_ms, fresh_ms, first.stats.cached_tokens, fresh.stats.prompt_tokens, first)
        return [row(name, f"system {tokens}, request 1", first.stats.prompt_tokens, [only], whole_ms)]
    rest = row(name, f"system {tokens}, requests 2-{requests}", n, later, whole_ms)
    # The first request prefills the system prompt, once: set against the later requests' fresh prompts.
    opening = replace(
        rest,
        case=f"system {tokens}, request 1",
        prompt_tokens=first.stats.prompt_tokens,
        reused=first.stats.cached_tokens,
        ttft_reuse_ms=first_ms,
        reuse_min_ms=first_ms,
        pairs=1,
    )
    return [opening, rest]


def with_context(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` whose config reads CONTEXT tokens (weights linked, not copied where possible)."""
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            target = out / f.name
            try:
                target.symlink_to(f.resolve())
            except OSError:  # no symlinks (Windows without the right): copy
                shutil.copy2(f, target)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = max(CONTEXT, int(config.get("max_position_embeddings") or 0))
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


def tiny_model(family: str, tokenizer_dir: Path, out: Path) -> Path:
    """A random-weight tiny `family` model with the demo's tokenizer, saved in `out` (timing only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fmoe_bench.tiny_families import tiny_config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config(family, tokenizer, len(tokenizer))
    config.max_position_embeddings = CONTEXT
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def measure(model_dir: Path, name: str, args: argparse.Namespace) -> list[Row]:
    from fmoe_local.config import RuntimeConfig, Sampling
    from fmoe_local.runtime import Runtime

    config = RuntimeConfig(device=args.device)
    with (
        Runtime.load(model_dir, config) as reuse,
        Runtime.load(model_dir, config.with_changes(prefix_cache_gb=0)) as whole_,
    ):
        for runtime in (reuse, whole_):  # first-request costs (allocations, the kernels' first runs) out of the way
            _ttft_ms(runtime, "User: hello\nAssistant:", Sampling(greedy=True, max_new_tokens=2))
        rows = chat_rows(name, reuse, whole_, args.turns, args.reply_tokens, args.repeats)
        return rows + system_rows(name, reuse, whole_, args.system_tokens, args.requests)


def format_table(rows: list[Row]) -> str:
    lines = [
        "TTFT in ms, median and min over the pairs. reuse: prefix cache on; whole: every prompt prefilled whole "
        "(median of 3); fresh: a prompt of only the tokens the reusing request prefilled, timed right after it; "
        "ratio = reuse / fresh (goal <= 1.3), of the medians and of the mins",
        f"{'model':<14} {'case':<26} {'prompt':>6} {'reused':>6} {'reuse':>8} {'min':>7} {'whole':>8} {'fresh N':>7} "
        f"{'fresh':>8} {'min':>7} {'ratio':>6} {'of min':>6} {'pairs':>5}",
    ]
    for r in rows:
        lines.append(
            f"{r.model:<14} {r.case:<26} {r.prompt_tokens:>6} {r.reused:>6} {r.ttft_reuse_ms:>8.1f} "
            f"{r.reuse_min_ms:>7.1f} {r.ttft_whole_ms:>8.1f} {r.fresh_tokens:>7} {r.ttft_fresh_ms:>8.1f} "
            f"{r.fresh_min_ms:>7.1f} {r.ratio:>6.2f} {r.ratio_of_mins:>6.2f} {r.pairs:>5}"
        )
    return "\n".join(lines)


def _progress(rows: list[Row]) -> list[Row]:
    print(format_table(rows).split("\n", 2)[2], flush=True)  # a model's rows as soon as they are measured
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    from fmoe_bench.tiny_families import FAMILIES

    p = sub.add_parser("prefix", help="TTFT with and without prefix reuse: a chat's turns, a shared system prompt")
    p.add_argument("--model", type=Path, action="append", help="model folder (repeatable; default: the demo model)")
    p.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help="random-weight tiny models to time too, comma-separated, or none (default: every family)",
    )
    p.add_argument("--turns", type=whole(1), default=20, help="chat turns; 1, 5 and the last are measured (default 20)")
    p.add_argument("--reply-tokens", type=whole(1), default=24, help="greedy tokens per chat reply (default 24)")
    p.add_argument("--system-tokens", type=whole(1, CONTEXT - 512), default=4000, help="system prompt tokens (4000)")
    p.add_argument(
        "--requests", type=whole(1), default=10, help="requests sharing the system prompt; 2 on are pairs (default 10)"
    )
    p.add_argument("--repeats", type=whole(1), default=10, help="pairs per measured chat turn (default 10)")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", type=Path, metavar="OUT", help="write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    from fmoe_bench.tiny_families import FAMILIES
    from fmoe_local.demo import demo_model_dir

    families = [f.strip() for f in args.families.split(",") if f.strip() and f.strip() != "none"]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"Unknown family {', '.join(unknown)}. Choose from {', '.join(FAMILIES)}, or none.")
    models = args.model or [demo_model_dir()]
    for m in models:
        if not m.is_dir():
            raise FileNotFoundError(f"No model folder at {m}: pass --model with a downloaded checkpoint.")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fmoe-bench-prefix-") as tmp:
        work = Path(tmp)
        for i, m in enumerate(models):
            name = "demo" if m.resolve() == demo_model_dir().resolve() else m.name
            rows += _progress(measure(with_context(m, work / f"model-{i}"), name, args))
        for family in families:
            rows += _progress(measure(tiny_model(family, demo_model_dir(), work / family), family, args))
    print(format_table(rows))
    if args.json:
        rows_out = [asdict(r) | {"ratio": r.ratio, "ratio_of_mins": r.ratio_of_mins} for r in rows]
        args.json.write_text(json.dumps(rows_out, indent=1))
    return 0
