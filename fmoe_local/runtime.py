"""Runtime: the one API the CLI, the UI and the benchmarks consume (mlx-lm style).

`Runtime.load(model_dir, config)` builds the offloaded model; `stream(prompt)` (chat messages, or a text to continue
as it is) yields `TextDelta` events and one
final `Finished` with the request's statistics (both in runtime_types.py, with `ModelInfo`); `stop()` ends the
generation within one token; `reconfigure()` changes cache size, prefetch distance, policy, store capacity or miss
handling without reloading the model; `reset_cache()` empties the expert cache so the next request starts cold
(benchmarks); `check(prompt)` says before queueing whether the prompt can be one at all
(engine.PromptRefused); `close()` stops every thread. One worker thread owns the model; each request has its own
response queue and its own stop flag. Callers wait on the worker only through `_wait` (bounded: it notices a worker
that has ended); after close() the worker ends whatever is still queued with the sentence CLOSED instead of running
it under a model being closed.

It does NOT persist anything (the app passes a MapPersistence from store/, and may save `miss_costs`), nor probe
hardware beyond resolving "auto" device/dtype and measuring the miss costs once at load (miss_cost.py).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from fmoe_local.cache import ExpertLoadError
from fmoe_local.chat_template import TemplateOverBudget
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.constrained import GrammarRefused
from fmoe_local.copier import Interrupted, LoadTimeout
from fmoe_local.engine import Engine, PromptRefused
from fmoe_local.generate import Detokenizer, generate_ids
from fmoe_local.logits_rules import LogitsRules
from fmoe_local.miss_cost import MissCosts
from fmoe_local.prefetch_distance import decode_layer_s
from fmoe_local.prefetcher import PrefetcherFailed
from fmoe_local.quant_cache import Progress
from fmoe_local.runtime_types import Finished, ModelInfo, TextDelta
from fmoe_local.stats import RequestStats

T = TypeVar("T")
log = logging.getLogger(__name__)
# Failures whose message is already a sentence for the user.
_SENTENCES = (PromptRefused, TemplateOverBudget, ExpertLoadError, LoadTimeout, PrefetcherFailed, GrammarRefused)
CLOSED = (
    "The model was unloaded before this request ran (another model was loaded, or the app is closing). Send it again."
)
_POLL_S = 0.5  # how often a caller waiting on the worker checks that the worker still runs


@dataclass
class _Request:
    prompt: list[dict] | str  # chat messages, or a text the reply continues as it is (Engine.tokenize_prompt)
    sampling: Sampling
    out: queue.Queue
    stop: threading.Event
    tools: list[dict] | None = None  # the functions the model may call, rendered by its chat template


_SENTINEL = object()


def _request_text(prompt: list[dict] | str) -> str:
    """What a recorded trace labels the request with: the text the user last wrote."""
    if isinstance(prompt, str):
        return prompt
    return prompt[-1].get("content", "") if prompt else ""


class Runtime:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._jobs: queue.Queue = queue.Queue()
        self._current: _Request | None = None
        # Held while stop() reads `_current` and sets the engine's interrupt, and while the worker changes `_current`
        # and clears the interrupt for the next request: a stop aimed at one request never lands on the next.
        self._turn = threading.Lock()
        self._request_ids = itertools.count(1)
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="fmoe-runtime", daemon=True)
        self._worker.start()

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        config: RuntimeConfig | None = None,
        map_persistence: object | None = None,
        miss_costs: MissCosts | None = None,
        progress: Progress | None = None,
    ) -> Runtime:
        """`miss_costs`: the figures an earlier load measured here for this model (`Runtime.miss_costs`, saved by
        the app); without them (or when they no longer fit the model) a short probe measures them again.
        `progress(done, total)`: experts quantised so far while the first load in int8/nf4 makes its copy (called
        on the loading thread; a UI shows it instead of a silent wait of minutes)."""
        config = config or RuntimeConfig()
        config.validate()
        return cls(Engine.build(Path(model_dir), config, map_persistence, miss_costs, progress))

    # ---- public API ----------------------------------------------------------------------------------------------
    @property
    def config(self) -> RuntimeConfig:
        return self._engine.config

    @property
    def info(self) -> ModelInfo:
        e = self._engine
        return ModelInfo(
            name=e.model_dir.name,
            path=str(e.model_dir),
            family=e.arch.model_type,
            num_layers=e.shape.num_layers,
            num_experts=e.shape.num_experts,
            top_k=e.shape.top_k,
            expert_bytes=e.host.expert_bytes,
            resident_bytes=e.resident_bytes,
            device=str(e.device),
            dtype=str(e.dtype).replace("torch.", ""),
            cache_experts=e.cache.capacity,
            cache_gb=e.cache.budget_bytes / 1024**3,
            host_ram_bytes=e.host.ram_bytes(),
            policy=e.config.policy,
            miss_handling=e.offload.miss_handling,
            expert_format=e.host.expert_format,
            prefetch_distance=e.config.prefetch_distance,
            store_capacity=e.config.store_capacity,
        )

    @property
    def miss_costs(self) -> MissCosts:
        """What a miss costs here, copied and computed on the CPU (measured at load; save them with `to_dict`)."""
        return self._engine.miss_costs

    @property
    def miss_explanation(self) -> str:
        """One sentence: what the current miss handling does with those figures, and why (the Stats tab shows it)."""
        return self._engine.offload.explain_misses()

    @property
    def load_notice(self) -> str:
        """Sentences about the load a user should see with it ("" when none): a quantised copy of the experts that
        could not be kept on disk (packed_host.py), a cache cut to what fits."""
        return getattr(self._engine.host, "notice", "") + self._engine.cache_notice  # dense stores have none

    @property
    def engine(self) -> Engine:
        """The offloading machinery, for tests and benchmarks that inspect the cache or the policy."""
        return self._engine

    def stream(
        self,
        prompt: list[dict] | str,
        sampling: Sampling | None = None,
        stop: threading.Event | None = None,
        tools: list[dict] | None = None,
    ) -> Iterator[TextDelta | Finished]:
        """Queue a request; yields its TextDelta events, then one Finished. `stop`: the request's own stop flag, for
        a caller that must end this request from another thread (a server whose client went away) — setting it
        ends the request within a token, or at once if it is still waiting for its turn. `tools`: OpenAI-shaped
        function tools, rendered into the prompt by the model's chat template (check `supports_tools` first)."""
        if self._closed:  # a caller holding a runtime that another thread just closed (a model being swapped)
            yield Finished.failed(CLOSED)
            return
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        request = _Request(prompt, sampling or self.config.sampling, queue.Queue(), stop or threading.Event(), tools)
        self._jobs.put(request)
        try:
            while True:
                item = self._wait(request.out)
                if isinstance(item, BaseException):  # the worker ended without serving this request
                    item = Finished.failed(CLOSED)
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            # A consumer that walks away (closed tab, broken pipe) must not leave the model generating.
            request.stop.set()

    def check(self, prompt: list[dict] | str, tools: list[dict] | None = None) -> int | None:
        """The prompt's length in tokens. Raises PromptRefused (ContextTooLong, TemplateRefused: a sentence) when
        this prompt cannot be one for this model: the request's own fault, told before it is queued (a
        server answers it 400 before its reply starts); TemplateOverBudget (a sentence) when the model's chat
        template was stopped, the model's fault (a server's 500). Runs on the caller's thread, without waiting for the
        worker; the worker encodes again when the request runs. None when it cannot tell (the runtime is closed,
        or the tokenizer failed otherwise): `stream` then gives the verdict."""
        if self._closed:
            return None
        try:
            return len(self._engine.tokenize_prompt(prompt if isinstance(prompt, str) else list(prompt), tools))
        except (PromptRefused, TemplateOverBudget):
            raise
        except Exception:  # noqa: BLE001 - not the prompt's fault: the worker's own encode decides and reports it
            log.debug("prompt check skipped", exc_info=True)
            return None

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (its text), or None when it has none: what a server reads the model's tool-call
        format from."""
        tok = self._engine.tokenizer
        return tok.get_chat_template() if getattr(tok, "chat_template", None) else None

    def supports_tools(self) -> bool:
        """Whether the model's chat template shows it the tools a request gives (Engine.supports_tools); on the
        caller's thread, like `check`."""
        return self._engine.supports_tools()

    def reply_opening(self) -> str:
        """What the model's chat template writes to open a reply (Engine.reply_opening): where it ends inside an
        opened <think>, the reply starts with the model's thinking. On the caller's thread, like `check`."""
        return self._engine.reply_opening()

    def check_grammar(self, grammar: str, schema: dict | None = None, where: str = "schema") -> None:
        """Raise GrammarRefused (a sentence naming `where` and the path in `schema`) when the reply could not be held
        to `grammar` (Sampling.grammar). On the caller's thread, before the request is queued."""
        self._engine.grammars.check(grammar, schema, where)

    def generate(self, prompt: list[dict] | str, sampling: Sampling | None = None) -> Finished:
        events = list(self.stream(prompt, sampling))
        return events[-1]

    def stop(self, request: threading.Event | None = None) -> None:
        """End the running request within a token, or at once if it is waiting for an expert to load. `request`:
        end only the request streamed with that stop flag (running or still queued), not whichever one runs."""
        if request is not None:
            request.set()
        with self._turn:
            current = self._current
            if current is not None and (request is None or current.stop is request):
                current.stop.set()
                self._engine.interrupt.set()

    def reconfigure(
        self,
        cache_gb: float | None = None,
        cache_experts: int | None = None,
        prefetch_distance: int | None = None,
        policy: str | None = None,
        store_capacity: int | None = None,
        miss_handling: str | None = None,
    ) -> RuntimeConfig:
        """Apply new settings between requests (waits for the current one); returns the config in force."""
        changes = {
            k: v
            for k, v in dict(
                cache_gb=cache_gb,
                prefetch_distance=prefetch_distance,
                policy=policy,
                store_capacity=store_capacity,
                miss_handling=miss_handling,
            ).items()
            if v is not None
        }
        if cache_experts is not None or cache_gb is not None:
            changes["cache_experts"] = cache_experts  # an explicit GB value replaces an earlier slot count
        self.config.with_changes(**changes).validate()  # refused at once, on the caller's thread

        def apply() -> RuntimeConfig:
            # Built from the config in force when it applies, not when it was asked for: a request that ran in
            # between (its adaptive prefetch distance) or another caller's change must not be undone.
            new = self._engine.config.with_changes(**changes)
            new.validate()
            self._engine.reconfigure(new)
            return self._engine.config

        return self._between_requests(apply)

    def reset_cache(self) -> None:
        """Empty the expert cache (waits for the current request) so the next request starts cold, as after a
        fresh start; what the policy and the map store learned is kept (clear_maps forgets the maps)."""
        self._between_requests(self._engine.reset_cache)

    def _between_requests(self, fn: Callable[[], T]) -> T:
        """Run fn on the worker thread between two requests and hand back its result or its exception."""
        done: queue.Queue = queue.Queue()
        self._jobs.put((fn, done))
        result = self._wait(done)
        if isinstance(result, BaseException):
            raise result
        return result

    def _wait(self, answers: queue.Queue) -> object:
        """The worker's next answer on `answers`; a RuntimeError (CLOSED) instead once the worker has ended without
        giving one (a job queued behind close()'s sentinel), so no caller waits for ever. Each answer is bounded by
        the job: a token, a request's end, or a reconfiguration between requests."""
        while True:
            try:
                return answers.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._worker.is_alive():
                    try:
                        return answers.get_nowait()  # given just before the worker ended
                    except queue.Empty:
                        return RuntimeError(CLOSED)

    def clear_maps(self) -> None:
        """Forget every expert map of this model (in memory and, through its persistence, on disk). Waits for the
        current request: the matcher must not lose the store under a search it is running."""
        self._between_requests(self._engine.map_store.clear)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        self._engine.interrupt.set()
        self._jobs.put(_SENTINEL)
        self._worker.join(timeout=30)
        self._engine.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- worker thread -------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _SENTINEL:
                self._engine.finish_recording()  # the recorder belongs to this thread: it writes the last part
                return
            if self._closed:  # queued before close(): ended at once, not run while the model is being closed
                if isinstance(job, tuple):
                    job[1].put(RuntimeError(CLOSED))
                else:
                    job.out.put(Finished.failed(CLOSED))
                continue
            if isinstance(job, tuple):
                fn, done = job
                try:
                    done.put(fn())
                except Exception as exc:  # noqa: BLE001 - handed back to the caller's thread
                    done.put(exc)
                continue
            with self._turn:
                self._current = job
                self._engine.interrupt.clear()  # a stop for the previous request must not end this one
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - a failed request must end its stream, not the worker
                job.out.put(Finished.failed(str(exc)))
            finally:
                with self._turn:
                    self._current = None

    def _run(self, request: _Request) -> None:
        e = self._engine
        try:
            prompt_ids = e.encode_prompt(request.prompt, request.tools)
        except PromptRefused as exc:  # too long, or the chat template's own refusal: a sentence, not a crash
            request.out.put(Finished.failed(str(exc)))
            return
        stats = RequestStats(prompt_tokens=int(prompt_ids.shape[1]))
        sampling, full = request.sampling, "length"  # the reason a reply that reaches max_new_tokens ends with
        if e.context_length is not None and prompt_ids.shape[1] + sampling.max_new_tokens > e.context_length:
            # The reply ends where the model's context does ("context": neither more Max new tokens nor Continue
            # makes room), not in positions it was never trained on.
            sampling, full = replace(sampling, max_new_tokens=e.context_length - int(prompt_ids.shape[1])), "context"
        detok = Detokenizer(e.tokenizer)
        reason, error = "length", ""
        times: list[float] = []
        request_id = next(self._request_ids)
        t0 = time.perf_counter()
        waited = 0.0  # the forward pass's waits for experts up to the first token (decode's are the rest)
        try:
            rules = LogitsRules.for_request(sampling, e.grammars)  # penalties, bias, a grammar: None when none
            with e.request(request_id, stats, text=_request_text(request.prompt)):
                for token in generate_ids(
                    e.model, prompt_ids, sampling, e.eos_ids, request.stop, after_forward=e.end_iteration, rules=rules
                ):
                    times.append(time.perf_counter())
                    if len(times) == 1:
                        waited = e.counters.stall_s + e.counters.host_s
                    if token in e.eos_ids:
                        detok.ids.append(token)
                        reason = "stop"
                        break
                    delta = detok.add(token)
                    request.out.put(TextDelta(delta, token))
                if request.stop.is_set() and reason == "length" and len(times) < sampling.max_new_tokens:
                    reason = "cancelled"
                elif reason == "length":
                    reason = full
        except Interrupted:
            reason = "cancelled"
        except Exception as exc:  # noqa: BLE001 - the request ends with a sentence; the runtime goes on
            reason, error = "error", self._sentence(exc)
            if isinstance(exc, PrefetcherFailed):
                e.recover_policy()
        stats.tokens = len(times)
        if times:
            stats.ttft_s = times[0] - t0
            stats.tpot_s = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else stats.ttft_s
        stats.finish_reason = reason
        if reason in ("stop", "length", "context") and len(times) > 1:
            decode_waits = e.counters.stall_s + e.counters.host_s - waited
            e.adapt_distance(decode_layer_s(times[-1] - times[0], decode_waits, len(times) - 1, e.shape.num_layers))
        request.out.put(Finished(detok.text, list(detok.ids), stats, reason, error=error))

    @staticmethod
    def _sentence(exc: Exception) -> str:
        if isinstance(exc, _SENTENCES):
            return str(exc)
        log.error("generation failed", exc_info=exc)
        return (
            f"Generation failed ({type(exc).__name__}: {exc}). Send the message again; if it happens again, "
            "load the model again from the Models tab."
        )
