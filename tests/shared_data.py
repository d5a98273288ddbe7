"""Where the read-only recordings and prompts live: ../shared/data beside the checkout (CI clones put it there too).

FMOE_SHARED_DATA overrides it for other layouts.
"""

from __future__ import annotations

import os
from pathlib import Path

SHARED_DATA = Path(os.environ.get("FMOE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
