"""Runtime: the one API the CLI, the UI and the benchmarks consume (mlx-lm style).

`Runtime.load(model_dir, config)` builds the offloaded model; `submit(prompt)` (chat messages, or a text to continue
as it is) queues a request and returns its `RequestHandle` (request_handle.py): iterate it for `TextDelta` events and
one final `Finished` with the request's statistics (runtime_types.py, with `ModelInfo`), `cancel()` it, or wait for
its `result()`; `reconfigure()` changes cache size, prefetch distance, policy, store capacity or miss handling
without reloading the model; `reset_cache()` empties the expert cache so the next request starts cold (benchmarks);
`check(prompt)` says before queueing whether the prompt can be one at all (engine.PromptRefused); `close()` ends the
running request and every queued one, and stops every thread.

Threads: one worker thread (`_serve`) owns the engine and everything it holds: the model, the offload state, the
map store. Callers hand it requests (handles) and calls (futures) through `_jobs`; `_turn` is held while the worker
changes which request runs and while a cancel looks at it, so a cancel aimed at one request never lands on the next.
`info` and `miss_explanation` are snapshots the worker takes after each job (`_describe`), read without waiting. No
caller's wait polls or is unbounded: the worker's `finally` ends every handle and call still queued (with CLOSED)
whether it ends by close() or by a crash, and a submit after that ends at once (`_accepting`).

It does NOT persist anything (the app passes a MapPersistence from store/, and may save `miss_costs`), nor probe
hardware beyond resolving "auto" device/dtype and measuring the miss costs once at load (miss_cost.py).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fmoe_local.cache import ExpertLoadError
from fmoe_local.cache_budget import kv_free_bytes
from fmoe_local.chat_template import TemplateOverBudget
from fmoe_local.config import RuntimeConfig, Sampling
from fmoe_local.constrained import GrammarRefused
from fmoe_local.copier import Interrupted, LoadTimeout
from fmoe_local.dtype_verdicts import DtypeVerdicts
from fmoe_local.engine import Engine, PromptRefused
from fmoe_local.generate import Detokenizer, generate_ids, special_token_ids
from fmoe_local.logits_rules import LogitsRules
from fmoe_local.miss_cost import MissCosts
from fmoe_local.prefetch_distance import decode_layer_s
from fmoe_local.prefetcher import PrefetcherFailed
from fmoe_local.prefix_cache import PrefixCache
from fmoe_local.quant_cache import Progress
from fmoe_local.request_handle import RequestHandle
from fmoe_local.runtime_types import Finished, ModelInfo, TextDelta
from fmoe_local.stats import RequestStats

if TYPE_CHECKING:
    from transformers.utils.chat_parsing import ResponseParser

T = TypeVar("T")
log = logging.getLogger(__name__)
# Failures whose message is already a sentence for the user.
_SENTENCES = (PromptRefused, TemplateOverBudget, ExpertLoadError, LoadTimeout, PrefetcherFailed, GrammarRefused)
CLOSED = (
    "The model was unloaded before this request ran (another model was loaded, or the app is closing). Send it again."
)


@dataclass
class _Request:
    """What the worker runs for one submit; the handle is how its caller sees it and how it is cancelled."""

    prompt: list[dict] | str  # chat messages, or a text the reply continues as it is (Engine.tokenize_prompt)
    sampling: Sampling
    handle: RequestHandle
    tools: list[dict] | None = None  # the functions the model may call, rendered by its chat template
    keep: frozenset[str] = frozenset()  # special tokens the reply's text keeps, for its parser (generate.Detokenizer)
    variables: dict | None = None  # the chat template's switches this request sets (Engine.tokenize_prompt)


@dataclass
class _Call:
    """A function the worker runs between two requests (reconfigure, reset_cache, clear_maps)."""

    fn: Callable[[], object]
    future: Future


_SENTINEL = object()


def _request_text(prompt: list[dict] | str) -> str:
    """What a recorded trace labels the request with: the text the user last wrote."""
    if isinstance(prompt, str):
        return prompt
    return prompt[-1].get("content", "") if prompt else ""


def readable_response_template(template: object) -> dict | None:
    """`template` (a tokenizer's `response_template`) where transformers can read it, else None, said once in the log:
    a checkpoint whose template cannot be read has its replies read as a checkpoint without one (our parser of its
    family's format, where the chat template writes one), not an error at every request."""
    if not isinstance(template, dict):
        return None
    from transformers.utils.chat_parsing import ResponseParser

    try:
        ResponseParser(template, prefix="")
    except Exception as exc:  # noqa: BLE001 - a template transformers cannot read raises errors of no one type
        log.warning("The checkpoint's response template cannot be read (%s): replies are read without it.", exc)
        return None
    return template


class Runtime:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._jobs: queue.Queue = queue.Queue()
        self._current: RequestHandle | None = None
        # Held while a cancel reads `_current` and sets the engine's interrupt, and while the worker changes
        # `_current` and clears the interrupt for the next request: a cancel aimed at one request never lands on the
        # next.
        self._turn = threading.Lock()
        # Held while a job is queued and while the ending worker drains the queue: nothing is queued after that.
        self._accepting = threading.Lock()
        self._request_ids = itertools.count(1)
        self._closed = False  # close() was called
        self._ended = False  # the worker has ended (close, or a crash): a submit ends at once
        self._described = self._describe()  # taken here, before the worker owns the engine
        self._response_template = readable_response_template(getattr(engine.tokenizer, "response_template", None))
        # The worker's own (prefix_cache.py says its threading rule): built here before the worker starts.
        self._prefixes = PrefixCache(
            engine.model.config,
            engine.prefix_budget,
            free_bytes=lambda: kv_free_bytes(engine.device),
            boundaries=Detokenizer.special_ids(engine.tokenizer),
        )
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
        dtype_verdicts: DtypeVerdicts | None = None,
    ) -> Runtime:
        """`miss_costs`: the figures an earlier load measured here for this model (`Runtime.miss_costs`, saved by
        the app); without them (or when they no longer fit the model) a short probe measures them again.
        `progress(done, total)`: experts quantised so far while the first load in int8/nf4 makes its copy (called
        on the loading thread; a UI shows it instead of a silent wait of minutes). `dtype_verdicts`: the ratios
        `dtype` auto decides with on a CPU, as an earlier load measured them here (`Runtime.dtype_verdicts`, saved by
        the app; dtype_verdicts.py), so that this load does not run those probes again."""
        config = config or RuntimeConfig()
        config.validate()
        return cls(Engine.build(Path(model_dir), config, map_persistence, miss_costs, progress, dtype_verdicts))

    # ---- public API ----------------------------------------------------------------------------------------------
    @property
    def config(self) -> RuntimeConfig:
        return self._engine.config

    @property
    def info(self) -> ModelInfo:
        """The model and the settings in force, as the worker last described them (after the last job)."""
        return self._described[0]

    def _describe(self) -> tuple[ModelInfo, str]:
        """Read the offload state on its owner's thread (the worker's, or the constructor's before it starts)."""
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
            dense_format=e.dense_format,
            dense_product=e.dense_product,
            dense_repacked_bytes=e.dense_repacked_bytes,
            prefetch_distance=e.config.prefetch_distance,
            store_capacity=e.config.store_capacity,
        ), e.offload.explain_misses()

    @property
    def dtype_verdicts(self) -> DtypeVerdicts:
        """The dtype probes' ratios this load used, saved ones and any it measured (the app saves `to_dict()`)."""
        return self._engine.dtype_verdicts

    @property
    def miss_costs(self) -> MissCosts:
        """What a miss costs here, copied and computed on the CPU (measured at load; save them with `to_dict`)."""
        return self._engine.miss_costs

    @property
    def miss_explanation(self) -> str:
        """One sentence: what the current miss handling does with those figures, and why (the Stats tab shows it)."""
        return self._described[1]

    @property
    def load_notice(self) -> str:
        """Sentences about the load a user should see with it ("" when none): a quantised copy of the experts that
        could not be kept on disk (packed_host.py), a cache cut to what fits."""
        return self._engine.host.notice + self._engine.cache_notice

    @property
    def engine(self) -> Engine:
        """The offloading machinery, for tests and benchmarks that inspect the cache or the policy; never the UI
        (tests/test_layering.py): it belongs to the worker thread, and what the UI needs, Runtime offers."""
        return self._engine

    def submit(
        self,
        prompt: list[dict] | str,
        sampling: Sampling | None = None,
        tools: list[dict] | None = None,
        keep: frozenset[str] = frozenset(),
        variables: dict | None = None,
    ) -> RequestHandle:
        """Queue a request; its handle yields TextDelta events, then one Finished, and cancels it. A runtime already
        closed (a caller that held it while another thread swapped the model) ends the handle at once with CLOSED.
        `tools`: OpenAI-shaped function tools, rendered into the prompt by the model's chat template (check
        `supports_tools` first). `keep`: special tokens (their text) the reply's text keeps where the model wrote
        them, for a parser that reads them (a tool-call format's markers); every other special token is left out.
        Whoever asks for them removes them before a user sees the text. `variables`: the chat template's own
        switches (Qwen3's `enable_thinking`), as Engine.tokenize_prompt takes them."""
        handle = RequestHandle(self._cancel, behind=self._current is not None or not self._jobs.empty())
        request = _Request(
            prompt if isinstance(prompt, str) else list(prompt),
            sampling or self.config.sampling,
            handle,
            tools,
            keep,
            variables,
        )
        if not self._enqueue(request):
            handle.finish(Finished.failed(CLOSED))
        return handle

    def check(
        self, prompt: list[dict] | str, tools: list[dict] | None = None, variables: dict | None = None
    ) -> int | None:
        """The prompt's length in tokens. Raises PromptRefused (ContextTooLong, TemplateRefused: a sentence) when
        this prompt cannot be one for this model: the request's own fault, told before it is queued (a
        server answers it 400 before its reply starts); TemplateOverBudget (a sentence) when the model's chat
        template was stopped, the model's fault (a server's 500). Runs on the caller's thread, without waiting for the
        worker; the worker encodes again when the request runs. None when it cannot tell (the runtime is closed,
        or the tokenizer failed otherwise): the request's handle then gives the verdict."""
        if self._closed:
            return None
        try:
            return len(self.tokenize(prompt, tools, variables))
        except (PromptRefused, TemplateOverBudget):
            raise
        except Exception:  # noqa: BLE001 - not the prompt's fault: the worker's own encode decides and reports it
            log.debug("prompt check skipped", exc_info=True)
            return None

    def tokenize(
        self, prompt: list[dict] | str, tools: list[dict] | None = None, variables: dict | None = None
    ) -> list[int]:
        """The prompt's token ids as the worker encodes them (Engine.tokenize_prompt: the chat template with its
        `variables` switches, or a text as it is), for `check` and a benchmark's reference run; raises what `check`
        says it raises, and any tokenizer failure. On the caller's thread, like `check`."""
        return self._engine.tokenize_prompt(prompt if isinstance(prompt, str) else list(prompt), tools, variables)

    def generate(self, prompt: list[dict] | str, sampling: Sampling | None = None) -> Finished:
        return self.submit(prompt, sampling).result()

    @property
    def context_length(self) -> int | None:
        """The most tokens (prompt + reply) the model reads, from its config; None when it does not say."""
        return self._engine.context_length

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

    def special_tokens(self, texts: Iterable[str] | None = None) -> dict[str, int]:
        """Those of `texts` that are special tokens of the model's tokenizer (a reply's text leaves them out unless
        its request keeps them: `submit`'s `keep`), by id; every special token when None. On the caller's thread,
        like `check`."""
        tok = self._engine.tokenizer
        if texts is None:
            texts = [t for t in tok.convert_ids_to_tokens(sorted(Detokenizer.special_ids(tok))) if t is not None]
        return special_token_ids(tok, texts)

    @property
    def response_template(self) -> dict | None:
        """The checkpoint's own description of how its replies are read (its tokenizer's `response_template`, for
        transformers' response parser: `reply_reader`), or None when it ships none or one transformers cannot read."""
        return self._response_template

    def reply_reader(self, tools: list[dict], prefix: str | None = None) -> ResponseParser | None:
        """A reader of one reply by the checkpoint's response template: transformers' streaming ResponseParser
        (`feed` a reply's text, its special tokens kept, as it comes; `finalize` for the message dict: content,
        tool_calls, reasoning_content; each may raise on a malformed reply). `prefix`: the text the reply follows (the
        template's reply opening when None, which may render the template: pass it where a wait matters). None
        without a template. On the caller's thread."""
        if self._response_template is None:
            return None
        from transformers.utils.chat_parsing import ResponseParser

        opening = self.reply_opening() if prefix is None else prefix
        return ResponseParser(self._response_template, prefix=opening, tools=tools)

    def check_grammar(self, grammar: str, schema: dict | None = None, where: str = "schema") -> None:
        """Raise GrammarRefused (a sentence naming `where` and the path in `schema`) when the reply could not be held
        to `grammar` (Sampling.grammar). On the caller's thread, before the request is queued."""
        self._engine.grammars.check(grammar, schema, where)

    def _cancel(self, handle: RequestHandle) -> None:
        """A running handle was cancelled: end a wait for an expert too, if that request is still the one running."""
        with self._turn:
            if self._current is handle:
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
        """Empty the expert cache and drop the kept KV caches (waits for the current request) so the next request
        starts cold, as after a fresh start; what the policy and the map store learned is kept (clear_maps forgets
        the maps)."""

        def reset() -> None:
            self._prefixes.clear()
            self._engine.reset_cache()

        self._between_requests(reset)

    def _between_requests(self, fn: Callable[[], T]) -> T:
        """Run fn on the worker thread between two requests and hand back its result or its exception. The wait is
        bounded by the request running before it: the worker ends every call it was given, even when it ends."""
        call = _Call(fn, Future())
        if not self._enqueue(call):
            raise RuntimeError(CLOSED)
        return call.future.result()

    def _enqueue(self, job: _Request | _Call) -> bool:
        with self._accepting:
            if self._closed or self._ended:
                return False
            self._jobs.put(job)
            return True

    def clear_maps(self) -> None:
        """Forget every expert map of this model (in memory and, through its persistence, on disk). Waits for the
        current request: the matcher must not lose the store under a search it is running."""
        self._between_requests(self._engine.map_store.clear)

    def close(self) -> None:
        """End the running request (within a token; its Finished says "cancelled", and its handle is not marked
        cancelled: its owner did not ask), end every queued one with CLOSED, stop the worker and the engine."""
        with self._accepting:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(_SENTINEL)
        with self._turn:
            if self._current is not None:
                self._current.stop.set()
            self._engine.interrupt.set()
        self._worker.join(timeout=30)
        self._engine.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- worker thread -------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        job = None
        try:
            while True:
                job = self._jobs.get()
                if job is _SENTINEL:
                    self._engine.finish_recording()  # the recorder belongs to this thread: it writes the last part
                    return
                if isinstance(job, _Call):
                    self._call(job)
                else:
                    self._serve_request(job)
                self._redescribe()
        finally:
            # Whatever ended the worker, nobody waits for ever: the job it was on and everything still queued end now.
            with self._accepting:
                self._ended = True
                left = [job] if isinstance(job, _Request | _Call) else []
                while not self._jobs.empty():
                    left.append(self._jobs.get_nowait())
            for job in left:
                if isinstance(job, _Call):
                    if not job.future.done():
                        job.future.set_exception(RuntimeError(CLOSED))
                elif isinstance(job, _Request):
                    job.handle.stop.set()
                    job.handle.finish(Finished.failed(CLOSED))

    def _redescribe(self) -> None:
        try:
            self._described = self._describe()
        except Exception:  # noqa: BLE001 - the last description stands; the worker must go on serving
            log.exception("could not describe the runtime's state")

    def _call(self, call: _Call) -> None:
        if self._closed:  # queued before close(): not run while the model is being closed
            call.future.set_exception(RuntimeError(CLOSED))
            return
        try:
            call.future.set_result(call.fn())
        except Exception as exc:  # noqa: BLE001 - handed back to the caller's thread
            call.future.set_exception(exc)

    def _serve_request(self, request: _Request) -> None:
        handle = request.handle
        with self._turn:
            if self._closed:  # queued before close(): ended at once, not run while the model is being closed
                handle.finish(Finished.failed(CLOSED))
                return
            if not handle.claim():  # cancelled while it waited for its turn: already ended
                return
            self._current = handle
            self._engine.interrupt.clear()  # a cancel of the previous request must not end this one
        try:
            self._run(request)
        except Exception as exc:  # noqa: BLE001 - a failed request must end its handle, not the worker
            handle.finish(Finished.failed(str(exc)))
        finally:
            with self._turn:
                self._current = None

    def _run(self, request: _Request) -> None:
        e = self._engine
        try:
            prompt_ids = e.encode_prompt(request.prompt, request.tools, request.variables)
        except PromptRefused as exc:  # too long, or the chat template's own refusal: a sentence, not a crash
            request.handle.finish(Finished.failed(str(exc)))
            return
        sampling, full = request.sampling, "length"  # the reason a reply that reaches max_new_tokens ends with
        if e.context_length is not None and prompt_ids.shape[1] + sampling.max_new_tokens > e.context_length:
            # The reply ends where the model's context does ("context": neither more Max new tokens nor Continue
            # makes room), not in positions it was never trained on.
            sampling, full = replace(sampling, max_new_tokens=e.context_length - int(prompt_ids.shape[1])), "context"
        prompt = prompt_ids[0].tolist()
        t0 = time.perf_counter()  # the time to first token counts handing over a kept cache
        kv_cache, reused = self._prefixes.take(prompt, sampling.max_new_tokens)
        stats = RequestStats(prompt_tokens=len(prompt), cached_tokens=reused)
        detok = Detokenizer(e.tokenizer, request.keep)
        reason, error = "length", ""
        times: list[float] = []
        request_id = next(self._request_ids)
        waited = 0.0  # the forward pass's waits for experts up to the first token (decode's are the rest)
        stop = request.handle.stop
        try:
            # Penalties, bias, a grammar, a thought's budget, or None.
            rules = LogitsRules.for_request(sampling, e.grammars, prompt_ids, e.encode_marker)
            with e.request(request_id, stats, text=_request_text(request.prompt), reused_ids=prompt_ids[:, :reused]):
                tokens = generate_ids(
                    e.model,
                    prompt_ids,
                    sampling,
                    e.eos_ids,
                    stop,
                    after_forward=e.end_iteration,
                    rules=rules,
                    cache=kv_cache,
                    cached=reused,
                )
                for token in tokens:
                    times.append(time.perf_counter())
                    if len(times) == 1:
                        waited = e.counters.stall_s + e.counters.host_s
                    if token in e.eos_ids:
                        detok.ids.append(token)
                        reason = "stop"
                        break
                    delta = detok.add(token)
                    request.handle.publish(TextDelta(delta, token))
                if stop.is_set() and reason == "length" and len(times) < sampling.max_new_tokens:
                    reason = "cancelled"
                elif reason == "length":
                    reason = full
                # Ended between two forward passes: every layer holds the same tokens, so the cache can serve the
                # next request (a pass cut short by an exception leaves it half-written, and it is dropped).
                self._prefixes.put(prompt + detok.ids, kv_cache)
        except Interrupted:
            reason = "cancelled"
        except Exception as exc:  # noqa: BLE001 - the request ends with a sentence; the runtime goes on
            reason, error = "error", self._sentence(exc)
            if isinstance(exc, PrefetcherFailed):
                e.recover_policy()
        tail = detok.rest()  # what the detokenizer held back for a later id (a short last word, half a character)
        if tail:
            request.handle.publish(TextDelta(tail, detok.ids[-1]))
        stats.tokens = len(times)
        if times:
            stats.ttft_s = times[0] - t0
            stats.tpot_s = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else stats.ttft_s
        stats.finish_reason = reason
        if reason in ("stop", "length", "context") and len(times) > 1:
            decode_waits = e.counters.stall_s + e.counters.host_s - waited
            e.adapt_distance(decode_layer_s(times[-1] - times[0], decode_waits, len(times) - 1, e.shape.num_layers))
        request.handle.finish(Finished(detok.text, list(detok.ids), stats, reason, error=error))
        # After the reply is out: a copy that makes room for the next turn costs no one's time to first token.
        self._prefixes.prepare()

    @staticmethod
    def _sentence(exc: Exception) -> str:
        if isinstance(exc, _SENTENCES):
            return str(exc)
        log.error("generation failed", exc_info=exc)
        return (
            f"Generation failed ({type(exc).__name__}: {exc}). Send the message again; if it happens again, "
            "load the model again from the Models tab."
        )
