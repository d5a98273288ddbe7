"""GPT-OSS's eager attention in pieces (fmoe_local/attention.py) against one whole call, on a device.

On the CPU the pieces give the whole call's bits (tests/test_attention.py). On a GPU, cuBLAS may tile a product of
fewer query rows otherwise; this says whether it does there: the tiny GPT-OSS model, pieces forced to 24 query rows,
the logits of a 300-token prefill and the greedy tokens of 16 more, whole and in pieces, in float32 and bf16.
Prints one line per dtype (equal or the largest difference; the tokens equal or where they part); exits 0.

Run from the repository root: `python tools/gpu_check/attention_pieces.py [--device cuda]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fmoe_local import attention  # noqa: E402
from fmoe_local.config import Sampling  # noqa: E402
from fmoe_local.generate import generate_ids  # noqa: E402
from tests.tiny import build_tiny_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model("gpt_oss", Path(tmp) / "gpt_oss")
        for dtype in (torch.float32, torch.bfloat16):
            whole = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
            pieces = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
            assert attention.use_our_attention(pieces)
            size = torch.tensor([], dtype=dtype).element_size()
            attention.PIECE_BYTES = pieces.config.num_attention_heads * 24 * 301 * size
            ids = torch.tensor([list(range(10, 310))], device=args.device)
            greedy = Sampling(greedy=True, max_new_tokens=16)
            with torch.inference_mode():
                a, b = whole(input_ids=ids).logits.float(), pieces(input_ids=ids).logits.float()
            tokens = [list(generate_ids(m, ids, greedy, set(), threading.Event())) for m in (whole, pieces)]
            parted = next((i for i, (x, y) in enumerate(zip(*tokens, strict=True)) if x != y), None)
            logits = "logits equal" if torch.equal(a, b) else f"logits differ by {(a - b).abs().max().item():.3g}"
            said = "16 greedy tokens equal" if parted is None else f"greedy tokens part at {parted}"
            print(f"{args.device} {str(dtype).removeprefix('torch.')}: {logits}; {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
