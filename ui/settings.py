"""Settings tab: expert cache size, prefetch distance, policy, map-store capacity, miss handling, expert format,
dense format, clearing the maps.

Scope: applying these to the loaded model with `runtime.reconfigure` (no reload) and saving them in the store; the
expert and dense formats are saved only, for the next load (they change what RAM and the cache hold: a reload).
The cache size is typed in the unit that fits the model (GB, MB or KB) and shown in experts; it must hold one
expert and fit what this machine has left (fmoe_local.hardware.cache_gb_limit), else it is refused with a sentence. It does NOT
load models or choose defaults (RuntimeConfig / AppSettings hold them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gradio as gr

from fmoe_local.cache_budget import SMALLEST_MAP_BYTES, check_store_capacity, map_room_bytes
from fmoe_local.config import POLICIES
from fmoe_local.hardware import GIB, cache_gb_limit
from ui import sizes
from ui.model_formats import AUTO_HELP
from ui.model_formats import choices as format_choices
from ui.render import code_literal, literal
from ui.session import Session, format_in_use, format_name, model_label

POLICY_HELP = {
    "fmoe": "fMoE (expert maps)",
    "moe_infinity": "MoE-Infinity",
    "lru": "LRU",
    "lfu": "LFU",
    "speculative": "Speculative (next router)",
    "on_demand": "On demand (no prefetch)",
    "cpu_moe": "CPU MoE (llama.cpp --n-cpu-moe style)",
}
MISS_CHOICES = [
    ("Auto: share each layer's misses between both (measured here)", "auto"),
    ("Copy it to the GPU", "copy"),
    ("Compute it on the CPU", "cpu"),
]
DENSE_CHOICES = [
    ("Auto: as 8-bit or 4-bit int4 experts on a CPU, else full size", "auto"),
    ("Full size (the model's own)", "bf16"),
    ("8-bit (CPU only)", "int8"),
    ("4-bit int4 (CPU only)", "int4"),
]
DENSE_HELP = (
    "How attention and the output layer are kept: a CPU reads all of them for every token, so smaller is faster "
    "there, answers differ slightly. A reload applies it (Models tab, Load)."
)
MISS_HELP = (
    "An expert the cache lacks can be copied to the GPU or computed by the CPU from RAM; auto measures both at load "
    "and shares each layer's misses between them so the layer finishes soonest (the Stats tab says how)."
)


@dataclass
class SettingsTab:
    model_info: gr.Markdown
    cache_size: gr.Number
    cache_experts: gr.Markdown
    prefetch_distance: gr.Slider
    policy: gr.Dropdown
    store_capacity: gr.Number
    miss_handling: gr.Dropdown
    expert_format: gr.Dropdown
    dense_format: gr.Dropdown
    apply: gr.Button
    clear_maps: gr.Button
    status: gr.Markdown


def cache_bounds(session: Session) -> tuple[float, float]:
    """(max GB, current GB) for the slider; before a model loads the machine's whole budget is offered."""
    machine = session.machine()
    if session.runtime is None:
        return max(0.5, cache_gb_limit(machine, 0)), session.store.settings.load().cache_gb
    info = session.runtime.info
    # session.machine() counts the loaded model as free: all it holds stays taken, except its current cache, which
    # a resize releases (cache_gb_limit's current_cache_gb).
    vram, ram = session.footprint()
    limit = cache_gb_limit(machine, vram if machine.has_gpu else ram, current_cache_gb=info.cache_gb)
    return max(limit, info.cache_gb, 0.1), info.cache_gb


def describe(session: Session) -> str:
    key = "the access token printed at start as the API key" if session.api_key_required else "any API key"
    api = (
        f"\n\n**Use it from other apps** (OpenAI-compatible API): base URL {code_literal(session.api_base)}, {key}."
        if session.api_base
        else ""
    )
    if session.still_loading:  # not "No model loaded. Load one": that invited a second Load
        return (
            f"**{literal(model_label(session.loading.model_dir))} is loading** (the page's header says how far). Its settings "
            f"show here when it has loaded.{api}"
        )
    if session.runtime is None:
        return f"**No model loaded.** {literal(session.load_error or 'Load one in the Models tab.')}{api}"
    i = session.runtime.info
    dense = "" if i.dense_format == "bf16" else f", attention and output layer in {format_name(i.dense_format)}"
    return (
        f"**{literal(model_label(session.model_dir, i.name))}** · {literal(i.family)} · {literal(i.device)} "
        f"({literal(i.dtype)}) · experts in {literal(format_in_use(i.expert_format, i.dtype))}{dense} · {i.num_layers} MoE layers × {i.num_experts} experts, "
        f"top-{i.top_k} · resident {in_unit(session, i.resident_bytes)} · one expert {in_unit(session, i.expert_bytes)} · "
        f"cache {in_unit(session, i.cache_gb * GIB)} = **{i.cache_experts} experts**{api}"
    )


def build(session: Session) -> SettingsTab:
    s = session.store.settings.load()
    model_info = gr.Markdown(describe(session), elem_id="model-info")
    with gr.Row():
        # Wide constructor bounds: the machine's real limit is checked in apply() with a sentence; refresh()
        # narrows what the browser shows once the model and the machine are known.
        with gr.Column():
            # A number, not a slider: a slider's box silently clamps what is typed (999, -1) to its ends, and its
            # bounds cannot say why. apply() refuses an impossible size with a sentence instead.
            cache_size = gr.Number(
                shown_cache_size(session), label=f"Expert cache ({cache_unit(session)[0]})", info=CACHE_HELP,
                elem_id="cache-size",
            )  # fmt: skip
            cache_experts = gr.Markdown("", elem_id="cache-experts")
        prefetch = gr.Slider(
            1,
            8,
            value=s.prefetch_distance,
            step=1,
            label="Prefetch distance (layers ahead)",
            info=DISTANCE_HELP,
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
        miss_handling = gr.Dropdown(
            MISS_CHOICES, value=s.miss_handling, label="When an expert is not in the cache", info=MISS_HELP,
            elem_id="miss-handling",
        )  # fmt: skip
        expert_format = gr.Dropdown(
            format_choices(), value=s.expert_format, label="Expert format (applies at the next load)", info=FORMAT_HELP,
            elem_id="expert-format",
        )  # fmt: skip
        dense_format = gr.Dropdown(
            DENSE_CHOICES, value=s.dense_format, label="Dense format (applies at the next load)", info=DENSE_HELP,
            elem_id="dense-format",
        )  # fmt: skip
    with gr.Row():
        apply = gr.Button("Apply", variant="primary", elem_id="apply-settings")
        clear_maps = gr.Button("Clear learned expert maps", variant="secondary", elem_id="clear-maps")
    status = gr.Markdown("", elem_id="settings-status")
    return SettingsTab(
        model_info, cache_size, cache_experts, prefetch, policy, capacity, miss_handling, expert_format, dense_format,
        apply, clear_maps, status,
    )  # fmt: skip


FORMAT_HELP = (
    "How experts are kept in RAM and on the GPU: smaller holds more of them, answers differ slightly. "
    f"{AUTO_HELP} A reload applies it (Models tab, Load); a first 8-bit or 4-bit load makes a copy of the experts, "
    "kept for the next."
)
DISTANCE_HELP = "How many layers ahead experts are fetched; further hides more copy time but guesses worse."
CACHE_HELP = "Memory kept for experts ready to run; more means fewer waits for copies, less memory for anything else."


def cache_unit(session: Session) -> tuple[str, int]:
    """(name, bytes) of the unit the cache size is typed in (sizes.cache_unit: the largest in which all the model's
    experts are at least 1; GB before a model is loaded). Every size the tab shows is in it."""
    unit = sizes.cache_unit(session.runtime.info if session.runtime is not None else None)
    return unit.name, unit.bytes


def cache_help(session: Session) -> str:
    """The field's help, with the loaded model's sizes in the unit that fits (tiny models are MB, not 0.0098 GB)."""
    if session.runtime is None:
        return CACHE_HELP
    i = session.runtime.info
    return (
        f"{CACHE_HELP} Now {sizes.cache_gib(i, i.cache_gb)} = {i.cache_experts} experts; at least one expert "
        f"({in_unit(session, i.expert_bytes, toward='up')}), at most what this machine has free."
    )


def in_unit(session: Session, n_bytes: float, toward: str = "nearest") -> str:
    """A size in the cache field's unit (binary, as the field), e.g. "0.562 MB", never "1.94e+04 MB"; `toward` "up"
    or "down" for a minimum or maximum the user may type back."""
    return sizes.cache_size(session.runtime.info if session.runtime is not None else None, n_bytes, toward)


def shown_cache_size(session: Session) -> float:
    """The running (or saved) cache in the field's unit, rounded UP to the two decimals shown: rounded down, the
    shown size bought one expert fewer when applied unchanged."""
    _, current = cache_bounds(session)
    return math.ceil(round(current * GIB / cache_unit(session)[1] * 100, 6)) / 100


def _number(value: object) -> bool:
    """A finite int or float, not a bool: what a number field may hold (a script may send anything)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def unchanged_size(session: Session, size: float | None) -> bool:
    """The field still holds the size it was shown with: Apply keeps the cache (and its experts) as it is. A whole
    expert can be smaller than the shown precision, so even rounded up the value is not the exact size."""
    return _number(size) and abs(size - shown_cache_size(session)) < 1e-9


def experts_in(session: Session, size: float | None) -> str:
    """How many experts a typed size holds, for the line under the field ("" before a model is loaded)."""
    if session.runtime is None or not _number(size):
        return ""
    unit, unit_bytes = cache_unit(session)
    i = session.runtime.info
    n = i.cache_experts if unchanged_size(session, size) else math.floor(size * unit_bytes / i.expert_bytes + 1e-9)
    return f"{size:g} {unit} = {n} experts of {in_unit(session, i.expert_bytes)} each" if size > 0 else ""


def refresh_outputs(tab: SettingsTab) -> list:
    return [
        tab.model_info,
        tab.cache_size,
        tab.cache_experts,
        tab.prefetch_distance,
        tab.policy,
        tab.store_capacity,
        tab.miss_handling,
        tab.expert_format,
        tab.dense_format,
    ]


def distance_max(session: Session) -> int:
    """The furthest prefetch distance the loaded model has layers for (the slider's end; 7 before a model loads)."""
    return max(1, (session.runtime.info.num_layers if session.runtime is not None else 8) - 1)


def distance_help(session: Session, saved: int) -> str:
    """The slider's help, saying so when the saved distance is more than this model allows (the load capped it)."""
    top = distance_max(session)
    if saved <= top or session.runtime is None:
        return DISTANCE_HELP
    layers = session.runtime.info.num_layers
    return f"{DISTANCE_HELP} {saved} is saved; this model has {layers} MoE layers, so it runs at {top}."


def refresh(session: Session) -> tuple:
    """Values for `refresh_outputs`: re-read after a model loads, since the unit and the bounds depend on it."""
    s = session.store.settings.load()
    top = distance_max(session)
    unit, _ = cache_unit(session)
    size = shown_cache_size(session)
    return (
        describe(session),
        gr.Number(value=size, label=f"Expert cache ({unit})", info=cache_help(session)),
        experts_in(session, size),
        gr.Slider(maximum=top, value=min(s.prefetch_distance, top), info=distance_help(session, s.prefetch_distance)),
        s.policy,
        s.store_capacity,
        s.miss_handling,
        s.expert_format,
        s.dense_format,
    )


def format_pending(session: Session) -> str:
    """ " The saved expert format waits for a reload" when it differs from the loaded model's, else ""."""
    saved = session.store.settings.load().expert_format
    if saved == session.runtime.config.expert_format:
        return ""
    info = session.runtime.info
    loaded = format_in_use(info.expert_format, info.dtype)  # the form it resolved to (auto: the checkpoint's own)
    return (
        f" Expert format {format_name(saved)} is saved: the model runs in {loaded} until you load it "
        "again (Models tab, Load)."
    )


def check_cache_size(session: Session, size: float | None) -> float:
    """The typed size (in the unit shown) as GiB; ValueError (a sentence) when it is impossible. Never clamped."""
    unit, unit_bytes = cache_unit(session)
    if not _number(size):
        raise ValueError(f"Type the expert cache size as a number of {unit}.")
    if unchanged_size(session, size):
        size = cache_bounds(session)[1] * GIB / unit_bytes  # the exact size in force: the same number of experts
    gb = size * unit_bytes / GIB
    if session.runtime is not None:
        one = session.runtime.info.expert_bytes
        if size * unit_bytes < one * (1 - 1e-9):
            raise ValueError(
                f"{size:g} {unit} is too small: the expert cache must hold at least one expert "
                f"({in_unit(session, one, toward='up')}). Type that or more."
            )
    elif size <= 0:
        raise ValueError(f"{size:g} {unit} is not a cache size: type more than 0.")
    top, _ = cache_bounds(session)
    if gb > top + 1e-9:
        raise ValueError(
            f"{size:g} {unit} is more than this machine has free: it has room for at most "
            f"{in_unit(session, top * GIB, toward='down')} of expert cache. Type less."
        )
    if session.runtime is not None:
        i = session.runtime.info
        everything = i.expert_bytes * i.num_layers * i.num_experts
        if size * unit_bytes > everything * (1 + 1e-9):
            # The cache would silently stop at every expert: say so rather than pretend to apply the size.
            raise ValueError(
                f"{size:g} {unit} is more than all of this model's experts take ({in_unit(session, everything, toward='down')}): "
                "a bigger cache holds nothing more. Type at most that."
            )
    return gb


def wire(session: Session, tab: SettingsTab, demo: gr.Blocks) -> list:
    """Attach the events; returns the events after which the runtime's settings changed. A refused value is said
    in the status line (a raised gr.Error would cover the fields with red pills) and changes nothing."""

    def refused(sentence: str) -> tuple:
        return gr.skip(), f"⚠️ {literal(sentence)}"  # it may quote what was typed, or a name

    def apply(size, distance, policy, capacity, miss_handling="auto", expert_format=None, dense_format=None):
        if session.still_loading:
            # Refused rather than kept for after the load: the load reads the saved settings when it starts and
            # saves the format it used when it ends, so values saved meanwhile were said saved and then ignored.
            return refused(f"{model_label(session.loading.model_dir)} is still loading (the page's header says how "
                           "far); Apply when it has loaded.")  # fmt: skip
        try:
            cache_gb = check_cache_size(session, size)
        except ValueError as exc:
            return refused(str(exc))
        if isinstance(capacity, (int, float)) and not isinstance(capacity, bool) and not capacity >= 1:  # NaN too
            return refused("Keep at least one expert map (store capacity ≥ 1).")
        changes = dict(
            cache_gb=cache_gb,
            prefetch_distance=distance,
            policy=policy,
            store_capacity=capacity,
            miss_handling=miss_handling,
        )
        later = {} if expert_format is None else {"expert_format": expert_format}  # saved only, for the next load
        if dense_format is not None:
            later["dense_format"] = dense_format
        try:
            # The store's one check of every setting (the chat's Generation values take it too), before anything
            # is applied: a value a script sent to this endpoint (NaN, a string, 2.5 layers) is refused as one
            # typed would be, and a refused value changes nothing.
            checked = session.store.settings.check(**changes, **later)
        except ValueError as exc:
            return refused(str(exc))
        changes = {key: getattr(checked, key) for key in changes}  # typed: 2.0 layers is 2
        distance, capacity = checked.prefetch_distance, checked.store_capacity
        if session.runtime is None:  # the load checks the model's own map size (Engine.build)
            try:
                check_store_capacity(capacity, SMALLEST_MAP_BYTES, map_room_bytes(), "even for the smallest model")
            except ValueError as exc:
                return refused(str(exc))
        saved_distance = session.store.settings.load().prefetch_distance
        # The slider shows a saved distance this model cannot run capped to its end: left there, the saved value
        # stays for deeper models (it was silently replaced by the cap when anything else was applied).
        top = distance_max(session)
        keep_distance = saved_distance > top and distance == top
        if session.runtime is not None:
            layers = session.runtime.info.num_layers
            if distance > max(1, layers - 1):
                return refused(f"This model has {layers} MoE layers: the prefetch distance can be 1 to {layers - 1}.")
            try:
                session.runtime.reconfigure(**changes)
            except ValueError as exc:
                return refused(str(exc))
            except MemoryError as exc:  # the checks leave little to fail here; a sentence still, not Gradio's "Error"
                return refused(f"This computer has not enough free memory for these settings ({exc}). Choose a "
                               "smaller cache or fewer expert maps.")  # fmt: skip
        if keep_distance:
            changes["prefetch_distance"] = saved_distance
        if expert_format is not None:
            # The loaded model's own choice too: the Models tab shows it when that model is picked for Load.
            store = session.store.settings
            chosen = store.format_choice(str(session.model_dir), expert_format) if session.model_dir else None
            changes.update(chosen or {"expert_format": expert_format})
        if dense_format is not None:
            changes["dense_format"] = checked.dense_format
        try:
            session.store.settings.set(**changes)
        except ValueError as exc:
            return refused(str(exc))
        if session.runtime is None:
            return describe(session), "Saved. They apply when a model is loaded."
        i = session.runtime.info
        kept = f" ({saved_distance} stays saved for models with more layers)" if keep_distance else ""
        return describe(session), literal(
            f"Applied without reloading: cache {in_unit(session, i.cache_gb * GIB)} ({i.cache_experts} experts), prefetch distance "
            f"{i.prefetch_distance}{kept}, policy {i.policy}, {i.store_capacity} maps kept. "
            f"{session.runtime.miss_explanation}{format_pending(session)}"
        )

    def clear_maps():
        if session.still_loading:
            return f"⚠️ {literal(model_label(session.loading.model_dir))} is still loading; clear its maps when it has loaded."
        if session.runtime is None:
            return "⚠️ Load a model first: maps are kept per model."
        session.runtime.clear_maps()  # also clears the model's maps in SQLite
        return "Cleared the learned expert maps of this model. Prefetching learns again from the next reply."

    demo.load(lambda: refresh(session), None, refresh_outputs(tab), api_visibility="private")
    tab.cache_size.change(
        lambda size: experts_in(session, size), [tab.cache_size], [tab.cache_experts], queue=False,
        api_visibility="private",
    )  # fmt: skip
    applied = tab.apply.click(
        apply,
        [
            tab.cache_size,
            tab.prefetch_distance,
            tab.policy,
            tab.store_capacity,
            tab.miss_handling,
            tab.expert_format,
            tab.dense_format,
        ],
        [tab.model_info, tab.status],
        api_name="apply_settings",
        concurrency_id="runtime",
    )
    tab.clear_maps.click(clear_maps, None, [tab.status], api_name="clear_maps", concurrency_id="runtime")
    return [applied]
