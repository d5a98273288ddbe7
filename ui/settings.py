"""Settings tab: expert cache size, prefetch distance, policy, map-store capacity, clearing the maps.

Scope: applying these to the loaded model with `runtime.reconfigure` (no reload) and saving them in the store.
The cache slider is bounded by what this machine has left (fmoe_local.hardware.cache_gb_limit). It does NOT
load models or choose defaults (RuntimeConfig / AppSettings hold them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gradio as gr

from fmoe_local.config import POLICIES
from fmoe_local.hardware import GIB, cache_gb_limit
from ui.session import Session, fmt_bytes, fmt_gb, model_label

POLICY_HELP = {
    "fmoe": "fMoE (expert maps)",
    "moe_infinity": "MoE-Infinity",
    "lru": "LRU",
    "lfu": "LFU",
    "speculative": "Speculative (next router)",
    "on_demand": "On demand (no prefetch)",
}


@dataclass
class SettingsTab:
    model_info: gr.Markdown
    cache_gb: gr.Slider
    prefetch_distance: gr.Slider
    policy: gr.Dropdown
    store_capacity: gr.Number
    apply: gr.Button
    clear_maps: gr.Button
    status: gr.Markdown


def cache_bounds(session: Session) -> tuple[float, float]:
    """(max GB, current GB) for the slider; before a model loads the machine's whole budget is offered."""
    machine = session.machine()
    if session.runtime is None:
        return max(0.5, cache_gb_limit(machine, 0)), session.store.settings.load().cache_gb
    info = session.runtime.info
    # The live probe already counts the loaded model (resident part and current cache) as used.
    limit = cache_gb_limit(machine, 0, current_cache_gb=info.cache_gb)
    return max(limit, info.cache_gb, 0.1), info.cache_gb


def describe(session: Session) -> str:
    api = (
        f"\n\n**Use it from other apps** (OpenAI-compatible API): base URL `{session.api_base}`, any API key."
        if session.api_base
        else ""
    )
    if session.runtime is None:
        return f"**No model loaded.** {session.load_error or 'Load one in the Models tab.'}{api}"
    i = session.runtime.info
    return (
        f"**{model_label(session.model_dir, i.name)}** · {i.family} · {i.device} ({i.dtype}) · {i.num_layers} MoE layers × {i.num_experts} experts, "
        f"top-{i.top_k} · resident {fmt_bytes(i.resident_bytes)} · one expert {fmt_bytes(i.expert_bytes)} · "
        f"cache {fmt_gb(i.cache_gb)} = **{i.cache_experts} experts**{api}"
    )


def build(session: Session) -> SettingsTab:
    s = session.store.settings.load()
    model_info = gr.Markdown(describe(session), elem_id="model-info")
    with gr.Row():
        # Wide constructor bounds: the machine's real limit is checked in apply() with a sentence; refresh()
        # narrows what the browser shows once the model and the machine are known.
        cache_gb = gr.Slider(
            0,
            4096,
            value=s.cache_gb,
            step=0.05,
            label="Expert cache (GB)",
            info=CACHE_HELP,
            elem_id="cache-gb",
        )
        prefetch = gr.Slider(
            1,
            8,
            value=s.prefetch_distance,
            step=1,
            label="Prefetch distance (layers ahead)",
            info="How many layers ahead experts are fetched; further hides more copy time but guesses worse.",
            elem_id="prefetch",
        )
    with gr.Row():
        policy = gr.Dropdown(
            [(POLICY_HELP.get(p, p), p) for p in POLICIES],
            value=s.policy,
            label="Policy",
            info="How experts are guessed before they are needed and which leave the cache when it is full.",
            elem_id="policy",
        )
        capacity = gr.Number(
            s.store_capacity,
            label="Expert maps kept (store capacity)",
            precision=0,
            info="Past replies' routing remembered to guess the next one; more helps fMoE, costs disk and a little time.",
        )
    with gr.Row():
        apply = gr.Button("Apply", variant="primary", elem_id="apply-settings")
        clear_maps = gr.Button("Clear learned expert maps", variant="secondary", elem_id="clear-maps")
    status = gr.Markdown("", elem_id="settings-status")
    return SettingsTab(model_info, cache_gb, prefetch, policy, capacity, apply, clear_maps, status)


CACHE_HELP = "Memory kept for experts ready to run; more means fewer waits for copies, less memory for anything else."


def cache_help(session: Session) -> str:
    """The field's help, with the loaded model's sizes in the unit that fits (tiny models are MB, not 0.0098 GB)."""
    if session.runtime is None:
        return CACHE_HELP
    i = session.runtime.info
    return f"{CACHE_HELP} Now {fmt_gb(i.cache_gb)} = {i.cache_experts} experts of {fmt_bytes(i.expert_bytes)} each."


def refresh_outputs(tab: SettingsTab) -> list:
    return [tab.model_info, tab.cache_gb, tab.prefetch_distance, tab.policy, tab.store_capacity]


def cache_step(expert_bytes: int) -> float:
    """Slider step: a power of ten just under one expert's size (0.1 GB for Mixtral, 1e-5 GB for test models)."""
    return 10 ** math.floor(math.log10(max(expert_bytes, 1) / GIB))


def refresh(session: Session) -> tuple:
    """Values for `refresh_outputs`: re-read after a model loads, since the bounds depend on it."""
    top, current = cache_bounds(session)
    s = session.store.settings.load()
    layers = session.runtime.info.num_layers if session.runtime is not None else 8
    distance_max = max(1, layers - 1)
    step = cache_step(session.runtime.info.expert_bytes) if session.runtime is not None else 0.05
    digits = max(0, -math.floor(math.log10(step)))
    top = round(math.floor(top / step) * step, digits)
    return (
        describe(session),
        gr.Slider(
            minimum=step, maximum=top, step=step, value=round(min(current, top), digits), info=cache_help(session)
        ),
        gr.Slider(maximum=distance_max, value=min(s.prefetch_distance, distance_max)),
        s.policy,
        s.store_capacity,
    )


def wire(session: Session, tab: SettingsTab, demo: gr.Blocks) -> list:
    """Attach the events; returns the events after which the runtime's settings changed."""

    def apply(cache_gb, distance, policy, capacity):
        top, _ = cache_bounds(session)
        if cache_gb is None or cache_gb <= 0:
            raise gr.Error("The expert cache needs more than 0 GB. Move the slider to the right.")
        if cache_gb > top + 1e-6:
            raise gr.Error(f"This machine has room for at most {top:.2f} GB of expert cache. Choose less.")
        if capacity is None or int(capacity) < 1:
            raise gr.Error("Keep at least one expert map (store capacity ≥ 1).")
        changes = dict(
            cache_gb=float(cache_gb), prefetch_distance=int(distance), policy=policy, store_capacity=int(capacity)
        )
        if session.runtime is not None:
            layers = session.runtime.info.num_layers
            if int(distance) > max(1, layers - 1):
                raise gr.Error(f"This model has {layers} MoE layers: the prefetch distance can be 1 to {layers - 1}.")
            try:
                session.runtime.reconfigure(**changes)
            except ValueError as exc:
                raise gr.Error(str(exc)) from exc
        try:
            session.store.settings.set(**changes)
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc
        if session.runtime is None:
            return describe(session), "Saved. They apply when a model is loaded."
        i = session.runtime.info
        return describe(session), (
            f"Applied without reloading: cache {fmt_gb(i.cache_gb)} ({i.cache_experts} experts), prefetch distance "
            f"{i.prefetch_distance}, policy {i.policy}, {i.store_capacity} maps kept."
        )

    def clear_maps():
        if session.runtime is None:
            raise gr.Error("Load a model first: maps are kept per model.")
        session.runtime.clear_maps()  # also clears the model's maps in SQLite
        return "Cleared the learned expert maps of this model. Prefetching learns again from the next reply."

    demo.load(lambda: refresh(session), None, refresh_outputs(tab), api_visibility="private")
    applied = tab.apply.click(
        apply,
        [tab.cache_gb, tab.prefetch_distance, tab.policy, tab.store_capacity],
        [tab.model_info, tab.status],
        api_name="apply_settings",
        concurrency_id="runtime",
    )
    tab.clear_maps.click(clear_maps, None, [tab.status], api_name="clear_maps", concurrency_id="runtime")
    return [applied]
