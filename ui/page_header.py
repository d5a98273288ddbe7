"""The page's header: the model that answers — or the one loading, or why none is loaded.

Scope: text from the Session's state (what is loaded, the load under way, the last load's failure). It does NOT load
anything or build components; ui/__init__ shows it at the top and the Models tab's Load redraws it while it loads;
every other open tab follows on a timer (ui.HEADER_REFRESH_S) that sends only a change.
Every name, path and sentence in it goes through render.literal: a model folder may be called anything, and its
name here was once live HTML (an inline-styled overlay over the whole page, back on every start).
"""

from __future__ import annotations

from ui import sizes
from ui.render import code_literal, literal
from ui.session import Session, format_in_use, format_name, model_label

TITLE = "fmoe-local"


def header(session: Session) -> str:
    model = model_line(session)
    if session.settings_notice:
        model += f"\n\n⚠️ {literal(session.settings_notice)}"
    recovery = getattr(session.store, "recovery", None)
    if recovery is not None:
        model += (
            f"\n\n⚠️ **Your database was damaged.** It was moved to {code_literal(recovery.moved_to)}, kept as it was, "
            f"and {literal(recovery.what_came_back())}."
        )
    return f"# {TITLE}\n{model}"


def model_line(session: Session) -> str:
    """The model that answers, the one loading, or why none is loaded (the Stats tab says the same)."""
    job = session.loading
    if job is not None and not job.finished.is_set():
        # The previous model is already unloaded: naming it would say the wrong model answers.
        model = (
            f"**Loading {literal(model_label(job.model_dir))}…** with experts in {literal(format_name(job.expert_format))}; "
            "the Models tab shows how far it got."
        )
    elif session.runtime is not None:
        i = session.runtime.info
        model = (
            f"**{literal(model_label(session.model_dir, i.name))}** on {literal(i.device)} · experts in "
            f"{literal(format_in_use(i.expert_format, i.dtype))} · expert cache {sizes.cache_gib(i, i.cache_gb)} ({i.cache_experts} "
            "experts)"
        )
    elif session.load_error:
        model = (
            f"**No model loaded.** ⚠️ {literal(session.load_error)} Load another model in the Models tab, or try again."
        )
    else:
        model = "**No model loaded** — open the Models tab to download one or load a folder."
    return model
