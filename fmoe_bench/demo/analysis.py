"""Does the demo model's routing differ by topic? Record its expert maps on topic prompts and compare them.

Scope: run the demo model (plain transformers, CPU is fine) on prompts grouped by topic (code, English prose, other
languages), record one expert map per token (the gate's softmax per MoE layer, `[L, J]`) for the prompt and a few
greedy decode steps, and report per-topic mean distributions, their pairwise cosine distances against the spread
within a topic, and how often a prompt's nearest topic centroid is its own topic. It can also write the recording in
the trace format of DESIGN.md for the replay benchmark. It does NOT use the offloading runtime (the maps here are the
model's own, unaffected by any cache) and does NOT run the replay benchmark.

Legend: T tokens, L MoE layers, J experts, K top-k, h hidden size.

    python -m fmoe_bench.demo.analysis --per-topic 30 --new-tokens 16 --trace build/demo-topics.npz
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fmoe_bench.demo.data import load_topic_prompts
from fmoe_bench.repo_data import data_dir

DEFAULT_PROMPTS = data_dir() / "prompts"


@dataclass
class Recording:
    """Per-token rows of one or more requests, in the trace format's layout."""

    probs: list[np.ndarray] = field(default_factory=list)  # each [L, J]
    embeddings: list[np.ndarray] = field(default_factory=list)  # each [h]
    seq_ids: list[int] = field(default_factory=list)
    iter_ids: list[int] = field(default_factory=list)
    phase: list[int] = field(default_factory=list)
    seq_labels: list[str] = field(default_factory=list)
    seq_texts: list[str] = field(default_factory=list)


def _layer_probs(router_logits: tuple[torch.Tensor, ...], num_tokens: int) -> np.ndarray:
    """Router logits of every layer (each [B*T, J]) → gate probabilities of the last num_tokens tokens, [T, L, J]."""
    per_layer = [torch.softmax(lg.float(), dim=-1)[-num_tokens:] for lg in router_logits]
    return torch.stack(per_layer, dim=1).numpy()


@torch.no_grad()
def record_request(
    model, tokenizer, prompt: str, new_tokens: int, max_prompt_tokens: int, rec: Recording, label: str
) -> None:
    """Prefill (one iteration, many rows) then greedy decode steps (one row each), appending rows to rec."""
    seq = len(rec.seq_labels)
    iteration = (rec.iter_ids[-1] + 1) if rec.iter_ids else 0
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"][:, -max_prompt_tokens:]  # [1, T]
    embed = model.get_input_embeddings()
    out = model(input_ids=ids, use_cache=True, output_router_logits=True)
    rows = _layer_probs(out.router_logits, ids.shape[1])
    emb = embed(ids)[0].float().numpy()  # [T, h]
    for t in range(ids.shape[1]):
        rec.probs.append(rows[t])
        rec.embeddings.append(emb[t])
        rec.seq_ids.append(seq)
        rec.iter_ids.append(iteration)
        rec.phase.append(0)
    past = out.past_key_values
    next_id = out.logits[:, -1:].argmax(-1)  # [1, 1]
    for _ in range(new_tokens):
        if next_id.item() == tokenizer.eos_token_id:
            break
        iteration += 1
        out = model(input_ids=next_id, past_key_values=past, use_cache=True, output_router_logits=True)
        past = out.past_key_values
        rec.probs.append(_layer_probs(out.router_logits, 1)[0])
        rec.embeddings.append(embed(next_id)[0, 0].float().numpy())
        rec.seq_ids.append(seq)
        rec.iter_ids.append(iteration)
        rec.phase.append(1)
        next_id = out.logits[:, -1:].argmax(-1)
    rec.seq_labels.append(label)
    rec.seq_texts.append(prompt)


def write_trace(path: Path, rec: Recording, model_name: str, top_k: int) -> None:
    """Save a recording in the trace format (DESIGN.md), full distributions and embeddings included."""
    probs = np.stack(rec.probs).astype(np.float32)  # [T, L, J]
    order = np.argsort(-probs, axis=-1)[..., :top_k]
    np.savez_compressed(
        path,
        format_version=np.int32(1),
        model=np.array(model_name),
        num_layers=np.int32(probs.shape[1]),
        num_experts=np.int32(probs.shape[2]),
        top_k=np.int32(top_k),
        seq_ids=np.asarray(rec.seq_ids, dtype=np.int32),
        iter_ids=np.asarray(rec.iter_ids, dtype=np.int32),
        phase=np.asarray(rec.phase, dtype=np.int8),
        topk_ids=order.astype(np.int16),
        topk_probs=np.take_along_axis(probs, order, axis=-1).astype(np.float32),
        probs=probs,
        embeddings=np.stack(rec.embeddings).astype(np.float32),
        seq_labels=np.asarray(rec.seq_labels),
        seq_texts=np.asarray(rec.seq_texts),
    )


def _cos_dist(a: np.ndarray, b: np.ndarray) -> float:
    return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))


def topic_report(rec: Recording) -> dict:
    """Per-request maps (mean over the request's rows, flattened [L*J]) compared within and across topics."""
    probs = np.stack(rec.probs)  # [T, L, J]
    seq_ids = np.asarray(rec.seq_ids)
    labels = np.asarray(rec.seq_labels)
    req = np.stack([probs[seq_ids == s].mean(0).reshape(-1) for s in range(len(labels))])  # [S, L*J]
    topics = sorted(set(labels))
    centroids = {t: req[labels == t].mean(0) for t in topics}
    between = {
        f"{a} vs {b}": _cos_dist(centroids[a], centroids[b]) for i, a in enumerate(topics) for b in topics[i + 1 :]
    }
    within = {t: float(np.mean([_cos_dist(v, centroids[t]) for v in req[labels == t]])) for t in topics}
    # Leave-one-out nearest centroid: can a request's routing alone tell its topic?
    correct = 0
    for i, v in enumerate(req):
        best, best_d = None, np.inf
        for t in topics:
            members = req[labels == t]
            n = len(members)
            c = (centroids[t] * n - v) / (n - 1) if labels[i] == t and n > 1 else centroids[t]
            d = _cos_dist(v, c)
            if d < best_d:
                best, best_d = t, d
        correct += best == labels[i]
    # Expert usage per topic and layer: share of top-K selections, what an expert cache actually feels.
    k = 2
    top = np.argsort(-probs, axis=-1)[..., :k]  # [T, L, k]
    usage = {}
    for t in topics:
        rows = np.isin(seq_ids, np.nonzero(labels == t)[0])
        counts = np.stack(
            [np.bincount(top[rows, layer].ravel(), minlength=probs.shape[2]) for layer in range(probs.shape[1])]
        )
        usage[t] = (counts / counts.sum(1, keepdims=True)).round(3).tolist()  # [L, J]
    return {
        "requests_per_topic": {t: int((labels == t).sum()) for t in topics},
        "rows": int(len(probs)),
        "between_topic_cosine_distance": between,
        "within_topic_mean_cosine_distance_to_centroid": within,
        "nearest_centroid_accuracy": correct / len(labels),
        "chance_accuracy": 1.0 / len(topics),
        "top2_usage_per_layer": usage,
    }


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fmoe_local.demo import demo_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the shipped demo model)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--per-topic", type=int, default=30)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=192)
    p.add_argument("--trace", type=Path, default=None, help="also write the recording as a trace .npz")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or demo_model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rec = Recording()
    for topic, prompts in load_topic_prompts(args.prompts).items():
        for prompt in prompts[: args.per_topic]:
            record_request(model, tokenizer, prompt, args.new_tokens, args.max_prompt_tokens, rec, topic)
    report = topic_report(rec)
    usage = report.pop("top2_usage_per_layer")
    print(json.dumps(report, indent=2))
    print(json.dumps({"top2_usage_layer0": {t: u[0] for t, u in usage.items()}}))
    if args.trace:
        write_trace(args.trace, rec, f"fmoe-local demo ({model_dir.name})", model.config.num_experts_per_tok)
        print(f"trace written to {args.trace}")


if __name__ == "__main__":
    main()
