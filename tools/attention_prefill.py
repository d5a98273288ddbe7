"""A long prompt's attention on the CPU: transformers' own function against the one fmoe-local registers.

`python tools/attention_prefill.py [--model deepseek_v2|gpt_oss] [--tokens 512,2048,4096] [--threads 2]` builds one
attention layer at a real checkpoint's widths (random weights, float32) and times a whole prefill of N tokens through
it with each function, each in a process of its own so that its peak resident memory is its own: ms for the layer
(best of 3 after a warm-up) and the peak RSS the passes added beyond the layer's weights and inputs.
- deepseek_v2: DeepSeek-V2-Lite's widths (hidden 2048, 16 heads, keys 128 + 64 wide, values 128, latent 512; 27
  layers); transformers' SDPA against ours (values padded onto the flash kernel).
- gpt_oss: GPT-OSS-20B's (hidden 2880, 64 query and 8 key/value heads of 64, sinks; a full-attention layer; 24 layers,
  half of them full); transformers' eager (GPT-OSS's default) against ours (the same, in pieces of query rows).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layer(model: str, ours: bool) -> tuple[object, object, object]:
    """The attention layer, its rotary embedding and its config, on transformers' implementation or ours."""
    import torch
    from transformers import DeepseekV2Config, GptOssConfig
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as deepseek
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    from fmoe_local import attention

    if model == "deepseek_v2":
        config = DeepseekV2Config(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            num_hidden_layers=1,
            max_position_embeddings=8192,
        )
        config._attn_implementation = "sdpa"
        module, layer, rope = deepseek, deepseek.DeepseekV2Attention, deepseek.DeepseekV2RotaryEmbedding
    else:
        config = GptOssConfig(
            hidden_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_hidden_layers=1,
            layer_types=["full_attention"],
            max_position_embeddings=8192,
        )
        config._attn_implementation = "eager"
        module, layer, rope = gpt_oss, gpt_oss.GptOssAttention, gpt_oss.GptOssRotaryEmbedding
    torch.manual_seed(0)
    built = layer(config, 0).eval()
    if model == "gpt_oss":
        torch.nn.init.normal_(built.sinks)
    if ours:
        # use_our_attention switches a whole model; here one layer of `module`'s stands in for it.
        holder = type("Model", (torch.nn.Module,), {"__module__": module.__name__})()
        holder.config = config
        holder.set_attn_implementation = lambda name: setattr(config, "_attn_implementation", name)
        assert attention.use_our_attention(holder)
    return built, rope(config), config


def one(model: str, tokens: int, ours: bool, threads: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers.masking_utils import create_causal_mask

    torch.set_num_threads(threads)
    layer, rope, config = _layer(model, ours)
    x = torch.randn(1, tokens, config.hidden_size) * 0.1
    positions = torch.arange(tokens)[None]
    with torch.inference_mode():
        emb = rope(x, positions)
        mask = create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=positions
        )
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times = []
        for _ in range(4):
            t = time.perf_counter()
            out, _ = layer(x, attention_mask=mask, position_embeddings=emb)
            times.append(time.perf_counter() - t)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"ms": 1000 * min(times[1:]), "peak_mb": (peak - before) / 1024, "sum": float(out.double().sum())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("deepseek_v2", "gpt_oss"), default="deepseek_v2")
    p.add_argument("--tokens", default="512,2048,4096")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        tokens, side = args.child.split(":")
        print(json.dumps(one(args.model, int(tokens), side == "ours", args.threads)))
        return 0
    print(f"{args.model}: one attention layer, a whole prefill, {args.threads} threads")
    print(f"{'tokens':>7} {'transformers ms':>16} {'ours ms':>9} {'ratio':>6} {'transformers MB':>16} {'ours MB':>8}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = {}
        for side in ("theirs", "ours"):
            cmd = [sys.executable, __file__, "--model", args.model, "--child", f"{tokens}:{side}"]
            cmd += ["--threads", str(args.threads)]
            rows[side] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        t, o = rows["theirs"], rows["ours"]
        ratio = t["ms"] / o["ms"]
        print(f"{tokens:>7} {t['ms']:>16.1f} {o['ms']:>9.1f} {ratio:>6.2f} {t['peak_mb']:>16.0f} {o['peak_mb']:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
