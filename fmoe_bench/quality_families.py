"""`bench quality --families`: what quantising the experts costs on one briefly trained tiny model per family.

Random weights make perplexity meaningless, so each supported family's tiny config (tiny_families.py) is first
trained with the demo's own recipe (fmoe_bench/demo/train.py: its byte-level BPE tokenizer and `train_lm`) on the training part
of the held-text file, saved with save_pretrained (float32, so the unquantised row is the trained model itself), and
scored per expert format by `quality.perplexity` — loaded through `Runtime.load`, every expert resident — on the held
part, which no model trained on. The demo model is scored on the same held part. It does NOT time anything and keeps nothing unless asked
(`--train-dir`).

The split is by a hash of each text (the demo's `is_heldout`), so it is the same on every machine and run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fmoe_bench.demo.train import TrainBudget
from fmoe_bench.quality import perplexity
from fmoe_bench.tiny_families import FAMILIES

HELD_FRACTION = 0.2
VOCAB = 1024
# A few minutes for all eight families on two shared cores (measured in docs/bench.md).
# lr 1e-2: at the demo's 3e-3 a 100-step model was still near the unigram loss, its experts adding 0.02 nats.
DEFAULT_BUDGET = TrainBudget(steps=300, batch=8, seq_len=128, lr=1e-2, warmup=0.05, max_minutes=10.0)


@dataclass(frozen=True)
class Trained:
    """One tiny model trained for the table: where it was saved and how its training went."""

    family: str
    model_dir: Path
    steps: int
    tokens: int
    train_loss: float  # mean LM loss of the last 10% of steps
    seconds: float


def split_texts(texts: Sequence[str], held_fraction: float = HELD_FRACTION) -> tuple[list[str], list[str]]:
    """(train, held): each text goes to one side by the hash of its content, the same on every run."""
    from fmoe_bench.demo.data import is_heldout

    if not 0 < held_fraction < 1:
        raise ValueError(f"The held fraction must be between 0 and 1 (exclusive), not {held_fraction}.")
    train, held = [], []
    for text in texts:
        (held if is_heldout(text, held_fraction) else train).append(text)
    if not train or not held:
        raise ValueError("The text splits into an empty training or held part: pass a file with more texts.")
    return train, held


def train_tokenizer(train_texts: Sequence[str], vocab: int = VOCAB) -> object:
    """The demo's tokenizer recipe (byte-level BPE, ChatML) on the training texts rendered as user turns."""
    from fmoe_bench.demo.data import render_chat
    from fmoe_bench.demo.train import build_tokenizer

    return build_tokenizer([render_chat([("user", t)]) for t in train_texts], vocab)


def train_family(
    family: str,
    tokenizer: object,
    train_texts: Sequence[str],
    budget: TrainBudget,
    out_dir: Path,
) -> Trained:
    """Train `family`'s tiny model on the texts (as user turns, packed) and save it, with the tokenizer, in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    from fmoe_bench.demo.data import render_chat
    from fmoe_bench.demo.train import encode_corpus, train_lm
    from fmoe_bench.tiny_families import tiny_config
    from fmoe_local.architectures import architecture_for

    stream = encode_corpus(tokenizer, [render_chat([("user", t)]) for t in train_texts])
    config = tiny_config(family, tokenizer, len(tokenizer))
    torch.manual_seed(budget.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch = architecture_for(config)
    losses: list[float] = []
    start = time.perf_counter()
    steps, tokens = train_lm(
        model, stream, budget, arch.num_experts(config), arch.top_k(config), lambda _s, row: losses.append(row["loss"])
    )
    seconds = time.perf_counter() - start
    tail = losses[-max(1, len(losses) // 10) :]
    model.eval()
    model.config.output_router_logits = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Trained(family, Path(out_dir), steps, tokens, sum(tail) / len(tail), seconds)


def loss_without_routed_experts(model_dir: Path, texts: Sequence[str], seq_len: int, windows: int) -> float:
    """Mean loss of transformers eager on the same windows with every routed expert's weights zeroed (their output
    is then 0; shared experts and dense layers stay): how much of the prediction the routed experts carry, the most
    any expert format could lose."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fmoe_bench.quality import held_windows
    from fmoe_local.architectures import architecture_for

    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype=torch.float32).eval()
    rows = held_windows(AutoTokenizer.from_pretrained(model_dir), texts, seq_len, windows)
    total = 0.0
    with torch.inference_mode():
        for ref in architecture_for(model.config).moe_layers(model):
            for param in ref.experts.parameters():
                param.zero_()
        for row in rows:
            x = torch.tensor([row])
            logits = model(input_ids=x[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
    return total / (seq_len * len(rows))


def measure_families(
    families: Sequence[str],
    formats: Sequence[str],
    texts: Sequence[str],
    budget: TrainBudget,
    seq_len: int,
    windows: int,
    device: str,
    work_dir: Path,
    demo_dir: Path | None = None,
    on_trained: Callable[[Trained], None] | None = None,
) -> tuple[list[Trained], list[dict]]:
    """Train each family's tiny model in `work_dir/FAMILY`, then score it (and the demo) per format on the held texts.

    Rows: `quality.perplexity`'s dict plus `model`, `rel_ppl` (perplexity / the model's unquantised one − 1; None
    when bf16 is not among the formats) and `loss_without_experts` (`loss_without_routed_experts`, per model).
    """
    import torch

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"Unknown family {', '.join(unknown)}. Choose from: {', '.join(FAMILIES)} (or all).")
    train_texts, held_texts = split_texts(texts)
    tokenizer = train_tokenizer(train_texts)
    threads = torch.get_num_threads()
    # One thread while training: on a shared, oversubscribed CPU two OpenMP threads spin-wait on each other (measured
    # here: 126 steps in 10 minutes with two threads during a test run, 300 steps in 29 s with one).
    torch.set_num_threads(1)
    try:
        trained = []
        for family in families:
            trained.append(train_family(family, tokenizer, train_texts, budget, Path(work_dir) / family))
            if on_trained is not None:
                on_trained(trained[-1])
    finally:
        torch.set_num_threads(threads)
    models = ([("demo", demo_dir)] if demo_dir is not None else []) + [(t.family, t.model_dir) for t in trained]
    rows: list[dict] = []
    for name, model_dir in models:
        scored = [perplexity(model_dir, fmt, held_texts, seq_len, windows, device) for fmt in formats]
        base = next((r["ppl"] for r in scored if r["format"] == "bf16"), None)
        off = loss_without_routed_experts(model_dir, held_texts, seq_len, windows)
        for r in scored:
            rel = None if base is None else r["ppl"] / base - 1.0
            rows.append({**r, "model": name, "rel_ppl": rel, "loss_without_experts": off})
    return trained, rows


def training_line(t: Trained) -> str:
    """One family's training, as the command prints it when the family is trained."""
    return (
        f"- {t.family}: {t.steps} steps, {t.tokens:,} tokens, train loss {t.train_loss:.3f} (last 10 % of steps), "
        f"{t.seconds:.0f} s"
    )


def format_table(rows: Sequence[dict]) -> str:
    """The markdown table of every model x format, with the perplexity increase over the model's unquantised row."""
    lines = [
        "| model | experts stored as | KB per expert | tokens | mean loss | perplexity | vs unquantised "
        "| loss without routed experts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first: dict[str, dict] = {}
    for r in rows:
        first.setdefault(r["model"], r)
    for r in rows:
        name = r["format"] if r["format"] != "bf16" else f"unquantised ({r['dtype']})"
        rel = "—" if r["rel_ppl"] is None or r["format"] == "bf16" else f"{100 * r['rel_ppl']:+.2f} %"
        # Once per model: the ceiling on what any format could lose (eager, routed experts zeroed).
        off = f"{r['loss_without_experts']:.4f}" if r is first.get(r["model"]) else "—"
        lines.append(
            f"| {r['model']} | {name} | {r['expert_bytes'] / 1e3:.1f} | {r['tokens']} | {r['loss']:.4f} "
            f"| {r['ppl']:.2f} | {rel} | {off} |"
        )
    return "\n".join(lines)


def run_families(args: argparse.Namespace, formats: Sequence[str], texts: Sequence[str], text_path: Path) -> int:
    """`bench quality --families ...`: train, score and print (quality.run has checked the shared flags)."""
    import dataclasses
    import tempfile

    from fmoe_local.demo import demo_model_dir

    families = list(FAMILIES) if args.families.strip() == "all" else [f.strip() for f in args.families.split(",")]
    if args.train_steps < 1:
        raise ValueError("--train-steps must be at least 1.")
    budget = dataclasses.replace(DEFAULT_BUDGET, steps=args.train_steps)
    train_texts, held_texts = split_texts(texts)
    heading = (
        f"Tiny models: each family's tiny config (hidden 64, 8 experts, top-2) trained from scratch for {budget.steps} "
        f"steps of {budget.batch} x {budget.seq_len} tokens (lr {budget.lr:g}, one CPU thread; the demo's recipe) on "
        f"{len(train_texts)} texts of {text_path.name}, tokenizer {VOCAB}-token byte-level BPE on the same texts. "
        f"Held text: the other {len(held_texts)} texts ({HELD_FRACTION:.0%} by hash of the text, never trained on), "
        f"{args.windows} windows x {args.seq_len} tokens per row. The demo model (its own tokenizer) scores the same "
        "held texts. Every expert resident."
    )
    print(heading + "\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="fmoe-quality-train-") as tmp:
        work_dir = args.train_dir or Path(tmp)
        trained, rows = measure_families(
            families,
            formats,
            texts,
            budget,
            args.seq_len,
            args.windows,
            args.device,
            work_dir,
            demo_model_dir(),
            on_trained=lambda t: print(training_line(t), flush=True),
        )
    print()
    print(format_table(rows))
    return 0
