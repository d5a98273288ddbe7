"""`python -m store.bench_writer`: what committing each expert map as it arrives costs, against 0.2 s batches.

Puts 400 DeepSeek-V2-Lite-shaped maps (26×64 probabilities + a 2048-wide embedding) at 50 per second — a 50 tok/s
decode — into a fresh store, for each writer linger, and prints the commits made and the process CPU per map.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from fmoe_local.maps import ExpertMap
from fmoe_local.policies.base import ModelShape
from store import open_store

SHAPE = ModelShape(num_layers=26, num_experts=64, top_k=6, embed_dim=2048)


def _fake_model(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "deepseek_v2"}')
    (root / "model.safetensors").write_bytes(b"\0" * 100)
    return root


def main(n: int = 400, rate_hz: float = 50.0) -> None:
    rng = np.random.default_rng(0)
    maps = [
        ExpertMap(
            rng.random((SHAPE.num_layers, SHAPE.num_experts), dtype=np.float32),
            rng.random(SHAPE.embed_dim, dtype=np.float32),
            i,
        )
        for i in range(n)
    ]
    print(f"{'linger s':>9}{'commits':>9}{'CPU ms/map':>12}")
    for linger in (0.2, 0.0):
        with tempfile.TemporaryDirectory() as tmp:
            store = open_store(Path(tmp))
            persistence = store.map_persistence(_fake_model(Path(tmp) / "m"), SHAPE)
            persistence._linger_s = linger
            cpu0 = time.process_time()
            for i, m in enumerate(maps):
                persistence.put(i, m)
                time.sleep(1.0 / rate_hz)
            persistence.flush()
            cpu = time.process_time() - cpu0
            print(f"{linger:>9.1f}{persistence.status().batches:>9}{cpu * 1e3 / n:>12.2f}")
            persistence.close()
            store.close()


if __name__ == "__main__":
    main()
