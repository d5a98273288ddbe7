"""A model load as the page follows it: the job on its own thread, how far it got, and how it is cancelled.

Scope: `LoadJob` (progress, the sentence it ended with, cancellation), `shape_of` (what a model's config says
before anything is loaded: the cheap refusal that must come before the working model is unloaded) and the load's
error types. It does NOT load anything (Session.load does, on the job's thread) or format progress for the page
(model_formats.load_progress).

Threads: a job is written by its load thread (`report`, `message`, `error`, `finished`) and read by the page's
poll; `cancel()` may be called from any thread. A load is cancelled where it reports progress — per expert while a
first int8/nf4 load makes its copy, the part that takes minutes — so a load reading plain weights runs to its end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


class ModelLoadError(ValueError):
    """A model could not be loaded; the message is a sentence for the user."""


class LoadCancelled(Exception):
    """Raised on the load's thread, from its progress report, once the load was cancelled."""


@dataclass(frozen=True)
class ModelShapeFacts:
    """What the map store needs to know before the model loads (read from config.json)."""

    num_layers: int
    num_experts: int
    top_k: int
    embed_dim: int


def shape_of(model_dir: Path) -> ModelShapeFacts:
    """Raises ValueError (a sentence) for a model the app can never load: not a MoE family it knows, or quantized
    in a way it cannot read. Reads config.json only, so that Load can refuse before unloading the model in use."""
    from fmoe_local.architectures import architecture_for
    from fmoe_local.loading import check_quantization, read_config

    config = read_config(model_dir)
    arch = architecture_for(config)
    check_quantization(config, arch)
    text = getattr(config, "text_config", None) or config
    return ModelShapeFacts(
        num_layers=len(arch.moe_layer_indices(config)),
        num_experts=arch.num_experts(config),
        top_k=arch.top_k(config),
        embed_dim=int(text.hidden_size),
    )


@dataclass
class LoadJob:
    """A model loading on its own thread, so that the page can show how far it got (a first int8/nf4 load
    quantises for minutes). `message` is Session.load's sentence, `error` the failure's; `finished` is set after.
    `after`: the load still running when this one was asked for (cancelled by it; this one waits for it to stop)."""

    model_dir: Path
    expert_format: str  # as saved when the load started (auto | bf16 | int8 | nf4)
    done: int = 0  # experts quantised so far, while a quantised copy is made
    total: int = 0  # 0: no copy is being made (loading weights, or the copy is reused)
    message: str = ""
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    finished: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    after: LoadJob | None = None

    def report(self, done: int, total: int) -> None:
        """Called by the load as it goes; raises LoadCancelled once the job was cancelled, which ends the load
        there (the copy's finished layers are kept: the next load in this format goes on from them)."""
        if self.cancelled.is_set():
            raise LoadCancelled
        self.done, self.total = done, total

    def cancel(self) -> bool:
        """Ask the load to stop at its next progress report; False when it had already finished."""
        if self.finished.is_set():
            return False
        self.cancelled.set()
        return True

    @property
    def waiting(self) -> LoadJob | None:
        """The earlier load this one still waits for, or None."""
        return self.after if self.after is not None and not self.after.finished.is_set() else None


def stopped(job: LoadJob) -> str:
    """The sentence a cancelled load ends with."""
    from ui.session import format_name, model_label

    said = f"Stopped loading {model_label(job.model_dir)}."
    if job.total:  # the copy's finished layers stay: minutes of work the next load in this format does not redo
        said += (
            f" The part of its {format_name(job.expert_format)} copy made so far is kept, so a later load in this "
            "format goes on from there."
        )
    return said
