"""DeepSeek's attention on the CPU: transformers' SDPA against fmoe-local's (values padded onto the flash kernel).

`python tools/mla_attention.py [--tokens 512,2048,4096] [--threads 2]` builds one DeepseekV2Attention layer at
DeepSeek-V2-Lite's widths (hidden 2048, 16 heads, keys 128 + 64 wide, values 128, latent 512; random weights, float32)
and times a whole prefill of N tokens through it with each attention function, each in a process of its own so that
its peak resident memory is its own: ms for the layer (best of 3 after a warm-up) and the peak RSS over the layer's
weights and inputs. The model has 27 such layers.
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


def one(tokens: int, ours: bool, threads: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AttentionInterface, DeepseekV2Config
    from transformers.masking_utils import AttentionMaskInterface, create_causal_mask
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding

    from fmoe_local.attention import NAME, sdpa_grouped, sdpa_mask_additive

    torch.set_num_threads(threads)
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
    if ours:
        AttentionInterface.register(NAME, sdpa_grouped)
        AttentionMaskInterface.register(NAME, sdpa_mask_additive)
        config._attn_implementation = NAME
    else:
        config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = DeepseekV2Attention(config, 0).eval()
    rope = DeepseekV2RotaryEmbedding(config)
    x = torch.randn(1, tokens, 2048) * 0.1
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
    p.add_argument("--tokens", default="512,2048,4096")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default="")
    args = p.parse_args()
    if args.child:
        tokens, ours = args.child.split(":")
        print(json.dumps(one(int(tokens), ours == "ours", args.threads)))
        return 0
    print(
        f"{'tokens':>7} {'transformers ms':>16} {'ours ms':>9} {'ratio':>6} {'transformers peak MB':>21} {'ours peak MB':>13}"
    )
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = {}
        for side in ("theirs", "ours"):
            cmd = [sys.executable, __file__, "--child", f"{tokens}:{side}", "--threads", str(args.threads)]
            rows[side] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        t, o = rows["theirs"], rows["ours"]
        print(
            f"{tokens:>7} {t['ms']:>16.1f} {o['ms']:>9.1f} {t['ms'] / o['ms']:>6.2f} {t['peak_mb']:>21.0f} {o['peak_mb']:>13.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
