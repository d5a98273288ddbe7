"""`python -m fmoe_bench.detokenize [--tokens 2000] [--repeats 3]`: what streaming a reply's text costs.

Scope: times fmoe_local.generate.Detokenizer (a window of ids decoded per token) against decoding every id again on
every token (what it did before), on one reply of the demo model's tokenizer, and prints a table. It does NOT run a
model: the reply is a fixed text's ids (English, code, other scripts and emoji), so both see the same ids.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from fmoe_local.cli_args import SentenceParser, whole
from fmoe_local.demo import demo_model_dir
from fmoe_local.generate import Detokenizer

REPLY = (
    "Mixture-of-Experts models route every token to a few experts, so most of the weights sit idle at any moment. "
    "Keeping only the experts about to be needed on the GPU lets a model larger than its memory run:\n\n"
    "```python\nfor layer in range(num_layers):\n    experts = predict(layer + distance)\n    prefetch(experts)\n```\n"
    "Auf Deutsch: Grüße aus Köln. 日本語の文も混ざります。Русский текст тоже. 🙂👍🏽 — naïve café, 3.14 ≈ π.\n"
)


def reply_ids(tokenizer: object, tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer.encode(REPLY, add_special_tokens=False)
    return ids[:tokens]


def redecode_all(tokenizer: object, ids: list[int]) -> str:
    """The detokenizer before the window: the whole reply decoded again for every token."""
    seen: list[int] = []
    sent = ""
    out = []
    for i in ids:
        seen.append(i)
        text = tokenizer.decode(seen, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue
        out.append(text[len(sent) :])
        sent = text
    return "".join(out)


def windowed(tokenizer: object, ids: list[int]) -> str:
    detok = Detokenizer(tokenizer)
    return "".join(detok.add(i) for i in ids) + detok.rest()


def best_of(repeats: int, run: Callable[[], str]) -> tuple[float, str]:
    times, text = [], ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        text = run()
        times.append(time.perf_counter() - t0)
    return min(times), text


def main(argv: list[str] | None = None) -> int:
    parser = SentenceParser(prog="python -m fmoe_bench.detokenize", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=whole(1), default=2000, help="reply length in tokens (default 2000)")
    parser.add_argument("--repeats", type=whole(1), default=3, help="runs of each; the best is shown (default 3)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir())
    ids = reply_ids(tokenizer, args.tokens)
    whole_text = tokenizer.decode(ids, skip_special_tokens=True)
    print(f"demo model's tokenizer, a {len(ids)}-token reply, best of {args.repeats}")
    print(f"{'detokenizer':<34}{'total s':>10}{'ms/token':>10}  same text as decode(all ids)")
    for name, run in (("re-decode every id (before)", redecode_all), ("window (Detokenizer)", windowed)):
        seconds, text = best_of(args.repeats, lambda run=run: run(tokenizer, ids))
        print(f"{name:<34}{seconds:>10.3f}{seconds / len(ids) * 1000:>10.3f}  {text == whole_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
