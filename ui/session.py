"""The app's live state shared by the tabs: the store, the loaded model, the machine, the running download.

Scope: one object built by app.py and handed to every tab's build()/wire() (never a module of globals). It loads
and unloads models (with the store's map persistence), keeps the recent request statistics the Stats tab draws,
and probes the machine when asked. It does NOT build components or format anything for display.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fmoe_local.cache_budget import SettingRefused
from fmoe_local.config import RuntimeConfig
from fmoe_local.dtype_verdicts import DtypeVerdicts
from fmoe_local.hardware import Machine, probe
from fmoe_local.miss_cost import MissCosts
from fmoe_local.stats import RequestStats
from ui import sizes
from ui.load_job import LoadCancelled, LoadJob, ModelLoadError, shape_of, stopped
from ui.loaded_runtime import LoadedRuntime

HISTORY = 200  # replies kept for the Stats tab's time series
CLOSE_WAIT_S = 30.0  # how long closing waits for a load under way (the start-up one, when the app is quit early)


def format_name(fmt: str) -> str:
    """An expert format for people: "4-bit (nf4)", "8-bit (int8)", "bf16", "MXFP4" (expert_formats.NAMES)."""
    from fmoe_local.expert_formats import NAMES

    name = NAMES.get(fmt, fmt)
    return name if name.lower() == fmt else f"{name} ({fmt})"


def format_in_use(fmt: str, dtype: str) -> str:
    """A loaded model's expert format (ModelInfo.expert_format, .dtype): unquantised experts are in the compute
    dtype, which is not bf16 everywhere (float32 on a CPU for fp16 checkpoints, the tiny models)."""
    if fmt == "bf16" and dtype != "bfloat16":
        return f"{dtype} (full size)"
    return format_name(fmt)


DEMO_LABEL = "Demo model (built in, 9M parameters — shows the machinery, not a useful assistant)"


def demo_dir() -> Path | None:
    """The shipped demo checkpoint's folder, or None when this install lacks it."""
    from fmoe_local.demo import demo_model_dir

    try:
        return demo_model_dir().resolve()
    except FileNotFoundError:
        return None


def model_label(model_dir: Path | None, fallback: str = "") -> str:
    """The name people see for a model folder: the demo's folder is called "weights", which says nothing."""
    if model_dir is not None and demo_dir() is not None and Path(model_dir).resolve() == demo_dir():
        return DEMO_LABEL
    return fallback or (Path(model_dir).name if model_dir is not None else "")


DEMO_ID = "demo"  # the built-in model's id in the API and the chat store (its folder name, "weights", says nothing)


def model_id(model_dir: Path | None, fallback: str = "") -> str:
    """The short id clients name a model by (/v1/models, a chat's model): "demo" for the built-in one."""
    if model_dir is not None and demo_dir() is not None and Path(model_dir).resolve() == demo_dir():
        return DEMO_ID
    return fallback or (Path(model_dir).name if model_dir is not None else "")


@dataclass
class Session:
    store: object  # store.Store; typed loosely so that ui tests can pass a Store opened on a temp folder
    config: RuntimeConfig
    endpoint: str | None = None  # Hugging Face endpoint for downloads (tests point it at a fake Hub)
    runtime: LoadedRuntime | None = None  # a fmoe_local.runtime.Runtime once a model is loaded
    model_dir: Path | None = None
    load_error: str = ""
    api_base: str = ""  # the OpenAI-compatible API's base URL once the server runs (ui/openai_api.py)
    api_key_required: bool = False  # --listen or --api-key: the API asks for the access token (ui/http_auth.py)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # RequestStats of recent replies
    download: object | None = None  # ui.downloads.Download in progress
    loading: LoadJob | None = None  # the latest start_load's job (the header says "Loading …" until it finishes)
    # The chat's replies still being written, by conversation: at most one each (the runtime runs one request at a
    # time and queues the others). chat_flow adds one when it submits it and removes it once the reply is saved (its
    # handle's done callback, on the runtime's worker); Stop cancels through each reply's handle. Read and changed
    # from any thread (pages, the worker) under `_replies_lock`, not `_lock`, which a load holds for minutes. A
    # reply lives here, not in a page: switching chats, a reload or a closed tab leave it running, and it is saved
    # in its own chat.
    chat_replies: dict = field(default_factory=dict)
    # Saved settings the store refused when read (`check_settings`): the page's header says so for this run.
    settings_notice: str = ""
    _machine: Machine | None = None
    # The dtype verdicts of this machine (fmoe_local.dtype_verdicts), one object for the page's machine probe and
    # every load, so that a probe the start-up load runs while the page is built is measured once, never twice at
    # the same time; made from the saved text at first use (under `_verdicts_lock`), emptied in place on a re-check.
    _verdicts: DtypeVerdicts | None = None
    _verdicts_lock: threading.Lock = field(default_factory=threading.Lock)
    _persistence: object | None = None
    # This run's own folder in the system temp folder for chat exports (`export_path`), made at the first export and
    # removed by `close`: an export holds a chat's text, which must not outlive the app there (nor a deleted chat).
    _exports: Path | None = None
    _exports_lock: threading.Lock = field(default_factory=threading.Lock)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _replies_lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_chat_reply(self, conv_id: int, reply: object) -> bool:
        """Record `reply` (a chat_flow.ChatReply) as chat `conv_id`'s; False when that chat already has one."""
        with self._replies_lock:
            if conv_id in self.chat_replies:
                return False
            self.chat_replies[conv_id] = reply
            return True

    def end_chat_reply(self, conv_id: int, reply: object) -> None:
        """`reply` has been saved (or could not be): the chat has none running any more."""
        with self._replies_lock:
            if self.chat_replies.get(conv_id) is reply:
                del self.chat_replies[conv_id]

    def chat_reply(self, conv_id: int | None) -> object | None:
        """Chat `conv_id`'s reply still being written, or None."""
        with self._replies_lock:
            return self.chat_replies.get(conv_id)

    def stop_chat(self, conv_id: int | None = None) -> None:
        """The chat's Stop: cancel chat `conv_id`'s reply, or (None) every chat reply still being written — a reply
        whose page was reloaded too. Never an API client's request: those are not chat replies."""
        with self._replies_lock:
            replies = [r for c, r in self.chat_replies.items() if conv_id is None or c == conv_id]
        for reply in replies:
            reply.handle.cancel()  # a queued reply ends at once, the running one within a token

    @property
    def models_dir(self) -> Path:
        return Path(self.store.models_dir)

    def machine(self, refresh: bool = False, remeasure: bool = False) -> Machine:
        """This computer as a model to load finds it: the probe (taken again after every load and unload, and with
        `refresh`: its memory and disk now), with what the app's own loaded model holds counted as free, since Load
        unloads it first. Without that, the loaded model's GPU memory and RAM made every other model (and itself)
        look as if it did not fit. `remeasure` (the Models tab's "Re-check this computer") measures the dtype
        verdicts again too; nothing else does (a download's disk check once re-ran every probe)."""
        if self._machine is None or refresh or remeasure:
            verdicts = self._dtype_verdicts()
            if remeasure:
                verdicts.forget()
            self._machine = probe(self.models_dir.parent, verdicts)
            self._save_dtype_verdicts(verdicts)
        vram, ram = self.footprint()
        return self._machine.with_freed(vram, ram)

    def footprint(self) -> tuple[int, int]:
        """(GPU bytes, RAM bytes) the loaded model holds: resident weights and expert cache where it computes, its
        RAM-held experts in RAM; (0, 0) with none loaded."""
        if self.runtime is None:
            return 0, 0
        i = self.runtime.info
        on_device = i.resident_bytes + int(i.cache_gb * 1024**3)
        return (on_device, i.host_ram_bytes) if i.device.startswith("cuda") else (0, on_device + i.host_ram_bytes)

    @property
    def still_loading(self) -> str:
        """ "" unless a load is under way; then a sentence for a request that came too early."""
        job = self.loading
        if job is None or job.finished.is_set():
            return ""
        return f"{model_label(job.model_dir)} is still loading (the page's header says how far). Send again when it has loaded."

    @property
    def loading_id(self) -> str:
        """The id clients will name the model a load under way is loading by ("" when none is loading)."""
        job = self.loading
        return "" if job is None or job.finished.is_set() else model_id(job.model_dir)

    @property
    def model_id(self) -> str:
        """The loaded model's id for clients ("" when none is loaded)."""
        return model_id(self.model_dir, self.runtime.info.name) if self.runtime is not None else ""

    @property
    def last_stats(self) -> RequestStats | None:
        return self.history[-1] if self.history else None

    def record(self, stats: RequestStats) -> None:
        self.history.append(stats)

    def start_load(self, model_dir: str | Path, progress: Callable[[int, int], None] | None = None) -> LoadJob:
        """`load` on a thread of its own; the job says how far it got and, when finished, what happened.
        `progress`: told too, as the job is (the console at start-up)."""
        model_dir = Path(model_dir).expanduser()
        job = LoadJob(model_dir, self.load_format(model_dir))
        previous = self.loading
        if previous is not None and previous.cancel():  # the user chose another model: that load is not wanted
            job.after = previous

        def report(done: int, total: int) -> None:
            job.report(done, total)
            if progress is not None:
                progress(done, total)

        def run() -> None:
            try:
                job.message = self.load(model_dir, progress=report, cancelled=job.cancelled)
            except LoadCancelled:
                job.error = stopped(job)
            except ModelLoadError as exc:
                job.error = str(exc)
            except Exception as exc:  # noqa: BLE001 - the page must hear of it rather than wait forever
                job.error = f"Could not load {job.model_dir.name}: {exc}"
            finally:
                job.finished.set()

        self.loading = job
        threading.Thread(target=run, name="fmoe-load", daemon=True).start()
        return job

    def load_format(self, model_dir: str | Path) -> str:
        """The expert format a load of `model_dir` uses: the folder's own choice, else the app-wide one (the format
        of the last successful load, or the Settings tab's with no model loaded)."""
        settings = self.store.settings
        return settings.model_format(str(model_dir)) or settings.load().expert_format

    def choose_format(self, model_dir: str | Path, fmt: str) -> None:
        """Save `fmt` as the folder's own format (Load's choice); raises ValueError (a sentence) for an unknown one.
        Not the app-wide one: `load` saves that once the model has loaded, so a load that fails does not change
        the format the next start-up loads another model in."""
        RuntimeConfig(expert_format=fmt).validate()
        settings = self.store.settings
        settings.set(model_formats=settings.format_choice(str(model_dir), fmt)["model_formats"])

    def cancel_load(self) -> str:
        """The Models tab's Stop loading: a sentence saying what happens."""
        job = self.loading
        if job is None or not job.cancel():
            return "No model is loading."
        return f"Stopping the load of {model_label(job.model_dir)}…"

    def load(
        self,
        model_dir: str | Path,
        progress: Callable[[int, int], None] | None = None,
        cancelled: threading.Event | None = None,
    ) -> str:
        """Load a model (unloading the current one) in its own format (`load_format`); returns a sentence for the
        user. Saves it as last_model and its format as the app-wide one.
        `progress(done, total)`: experts quantised so far while a first int8/nf4 load makes its copy.

        Raises ModelLoadError (a sentence) when the folder is not a model or loading fails; a folder that is
        not a model, or a model that can never load here (shape_of), leaves the current model loaded.
        `cancelled`: set, the load stops with LoadCancelled before it starts (it waited behind another) or at its
        next progress report (`progress` raises it: LoadJob.report).
        """
        from fmoe_local.runtime import Runtime

        model_dir = Path(model_dir).expanduser()
        if not (model_dir / "config.json").is_file():
            raise ModelLoadError(
                f"{model_dir} is not a model folder (no config.json). Pick a downloaded model or another folder."
            )
        with self._lock:
            if cancelled is not None and cancelled.is_set():
                raise LoadCancelled
            try:
                shape = shape_of(model_dir)
            except Exception as exc:  # noqa: BLE001 - e.g. a dense model, a GPTQ release: refused as a sentence
                said = f"Could not load {model_dir.name}: {exc}"
                if self.runtime is None:
                    self.load_error = said  # the header's reason why no model is loaded
                else:
                    said += f" {model_label(self.model_dir, self.runtime.info.name)} is still loaded."
                raise ModelLoadError(said) from exc
            self.unload()
            fmt, top = self.load_format(model_dir), max(1, shape.num_layers - 1)  # top: the furthest distance there is

            def attempt() -> Runtime:  # with the settings as saved now (a retry follows a reset)
                config = self._saved_config(fmt)
                # A distance saved for a deeper model runs capped to this one's (the Settings slider's end); the
                # saved value stays for the others, and the load says so (`distance_notice`).
                config = config.with_changes(prefetch_distance=min(config.prefetch_distance, top))
                saved = self._saved_miss_costs(model_dir)
                verdicts = self._dtype_verdicts()
                return Runtime.load(model_dir, config, self._persistence, saved, progress, verdicts)

            notice = self.check_settings()
            notice = f" {notice}" if notice else ""
            try:
                self._persistence = self.store.map_persistence(model_dir, shape)
                try:
                    self.runtime = attempt()
                    self._drop_if_cancelled(cancelled)
                except SettingRefused as exc:
                    # A saved value this model cannot use (e.g. a cache smaller than one of its experts) must not
                    # keep the model from loading: back to the defaults, said plainly. Only this type: a checkpoint
                    # that cannot load (incomplete, of another shape) fails the same with any settings.
                    from store.settings import AppSettings

                    saved, default = self.store.settings.load(), AppSettings()
                    if getattr(saved, exc.setting, None) == getattr(default, exc.setting, None):
                        raise  # the default itself is refused: resetting would not help
                    self.store.settings.reset_fields([exc.setting])
                    notice += f" Your saved {exc.setting} could not be used ({exc}); it was reset to the default."
                    self.runtime = attempt()
                    self._drop_if_cancelled(cancelled)
            except LoadCancelled:
                self._close_persistence()
                raise
            except Exception as exc:  # noqa: BLE001 - any load failure is reported, the app keeps running
                self._close_persistence()
                self.load_error = f"Could not load {model_dir.name}: {exc}"
                raise ModelLoadError(self.load_error) from exc
            self.model_dir = model_dir
            self.load_error = ""
            self._machine = None  # probed again with this model in memory (machine() adds it back as free)
            self.history.clear()
            self.store.settings.set(last_model=str(model_dir), expert_format=fmt)
            self._save_miss_costs(model_dir)
            self._save_dtype_verdicts(self.runtime.dtype_verdicts)
            info, saved_d = self.runtime.info, self.store.settings.load().prefetch_distance
            if saved_d > top:
                notice += (
                    f" Your saved prefetch distance {saved_d} is more than this model's {info.num_layers} MoE layers "
                    f"allow: it runs at {top} with this model, and {saved_d} stays saved for the others."
                )
            return (
                f"Loaded {model_label(model_dir, info.name)} on {info.device}, experts in {format_in_use(info.expert_format, info.dtype)}: "
                f"{info.num_layers} MoE layers × {info.num_experts} experts, "
                f"cache {sizes.cache_gib(info, info.cache_gb)} ({info.cache_experts} experts).{self.runtime.load_notice}{notice}"
            )

    def check_settings(self) -> str:
        """Saved settings the store refuses (a NaN temperature a script saved through the page's API before the
        check refused it, a policy another version knew): the defaults already stand in for them (settings.load);
        here they are put right on disk and said, in `settings_notice` (the page's header) and in the sentence
        returned ("" when every saved setting is usable). ui.build calls it once for the page; a load again."""
        refused = self.store.settings.refused()
        if not refused:
            return ""
        self.store.settings.reset_fields(sorted(refused))
        self.settings_notice = (
            f"Saved settings that cannot be used are back to their defaults: {' '.join(refused.values())} Set them "
            "again in the Settings tab or under Generation if you want other values."
        )
        return self.settings_notice

    def _drop_if_cancelled(self, cancelled: threading.Event | None) -> None:
        """A load cancelled after its last progress report (reading plain weights reports none) still ends
        without a model: the user asked for it to stop, or for another model."""
        if cancelled is not None and cancelled.is_set():
            runtime, self.runtime = self.runtime, None
            runtime.close()
            raise LoadCancelled

    def _saved_config(self, expert_format: str) -> RuntimeConfig:
        return self.store.settings.load().apply_to(self.config).with_changes(expert_format=expert_format)

    def _saved_miss_costs(self, model_dir: Path) -> MissCosts | None:
        """The figures an earlier load measured for this model here (None: measure them now)."""
        try:
            saved = json.loads(self.store.settings.load().miss_costs or "{}").get(str(model_dir))
            return MissCosts.from_dict(saved) if saved else None
        except (ValueError, TypeError, AttributeError):
            return None  # unreadable (an older or newer version wrote it): measure again

    def _save_miss_costs(self, model_dir: Path) -> None:
        try:
            known = json.loads(self.store.settings.load().miss_costs or "{}")
        except ValueError:
            known = {}
        known = known if isinstance(known, dict) else {}
        known[str(model_dir)] = self.runtime.miss_costs.to_dict()
        self.store.settings.set(miss_costs=json.dumps(known))

    def _dtype_verdicts(self) -> DtypeVerdicts:
        """This session's dtype verdicts: those saved for this machine (empty, measured when asked, when there are
        none, they are another machine's, or they cannot be read). One object for the session: a re-check empties it
        in place (`DtypeVerdicts.forget`), so a load under way never measures beside it nor saves older figures."""
        with self._verdicts_lock:
            if self._verdicts is None:
                try:
                    self._verdicts = DtypeVerdicts(json.loads(self.store.settings.load().dtype_verdicts or "{}"))
                except ValueError:  # unreadable (an older or newer version wrote it): measure again, then overwrite
                    self._verdicts = DtypeVerdicts()
            return self._verdicts

    def _save_dtype_verdicts(self, verdicts: DtypeVerdicts) -> None:
        if verdicts.measured:  # nothing new: the saved text stands
            self.store.settings.set(dtype_verdicts=json.dumps(verdicts.to_dict()))

    def unload(self) -> None:
        if self.runtime is not None:
            # Unpublished first: a request arriving during the close (up to the worker's 30 s join) finds no model
            # and says so, instead of taking the one being closed.
            runtime, self.runtime, self.model_dir = self.runtime, None, None
            runtime.close()
            self._machine = None
        self._close_persistence()

    def _close_persistence(self) -> None:
        if self._persistence is not None:
            self._persistence.close()
            self._persistence = None

    def export_path(self, name: str) -> Path:
        """Where to write a chat export called `name` for the page to offer: a folder of its own (two exports of one
        name never clash) inside this run's export folder, which `close` removes. Any page thread."""
        with self._exports_lock:
            if self._exports is None:
                self._exports = Path(tempfile.mkdtemp(prefix="fmoe-export-"))
            return Path(tempfile.mkdtemp(dir=self._exports)) / name

    def close(self) -> None:
        with self._exports_lock:
            if self._exports is not None:
                shutil.rmtree(self._exports, ignore_errors=True)  # ours: made by export_path, nothing else in it
                self._exports = None
        if self.download is not None:
            self.download.cancel()
        if self.loading is not None:
            # A load cannot be interrupted; one about to finish is let finish (it holds the store), a long one is
            # left to end with the process (its thread is a daemon).
            self.loading.finished.wait(CLOSE_WAIT_S)
        self.unload()
