"""on_demand: load an expert only when the router asks for it; LRU eviction.

Scope: the no-prediction reference point every prefetching policy must beat. Behaviour is the same as `lru`
(which names the eviction rule); this one names the loading rule, as the papers' "on-demand" baseline does, so
that tables read the way the literature does. It does NOT prefetch.
"""

from __future__ import annotations

from fmoe_local.policies._common import RecencyPolicy


class OnDemandPolicy(RecencyPolicy):
    name = "on_demand"
