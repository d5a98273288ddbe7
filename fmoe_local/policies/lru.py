"""lru: the classic baseline — no prefetching, evict the least recently used expert.

Scope: a name for `RecencyPolicy`. It does NOT predict anything; misses are loaded on demand by the cache.
"""

from __future__ import annotations

from fmoe_local.policies._common import RecencyPolicy


class LRUPolicy(RecencyPolicy):
    name = "lru"
