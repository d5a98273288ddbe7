"""Engine: the offloaded model and everything wired around it (the Offload, the map store, the router hooks).

Scope: construction, per-request bracketing (statistics, traces), reconfiguration and shutdown. It does NOT own a
thread for requests (runtime.py does), run the token loop (generate.py), or touch the cache, the prefetcher or
the policy's calls except through the Offload (offload.py).

Threads: everything here runs on the runtime's worker thread, except `interrupt.set()` (any thread: Stop, close),
which ends every wait of the Offload within a fraction of a second, and `tokenize_prompt`, which Runtime.check also
calls on its caller's thread: encodings run one at a time (`_encoding`, which also guards `_encoded`, the ids of the
last texts tokenized), and the worker otherwise only decodes, but for a thinking budget's markers (`encode_marker`,
under the same lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
from jinja2.exceptions import TemplateError, TemplateSyntaxError

from fmoe_local import (
    cache_budget,
    chat_template,
    cpu_experts,
    dense_formats,
    hardware,
    miss_cost,
)
from fmoe_local.attention import use_our_attention
from fmoe_local.cache import ExpertCache
from fmoe_local.cache_budget import check_capacity, check_store_capacity, fitted_slots, map_bytes, slots_for_budget
from fmoe_local.chat_template import TemplateOverBudget
from fmoe_local.config import RuntimeConfig
from fmoe_local.constrained import Grammars
from fmoe_local.cpu_experts import Kernel
from fmoe_local.dtype_verdicts import DtypeVerdicts, resolve_dtype
from fmoe_local.experts import OffloadedExperts
from fmoe_local.loading import checkpoint_dtype, load_model
from fmoe_local.maps import MapStore
from fmoe_local.miss_cost import MissCosts
from fmoe_local.observe import RoutingObserver
from fmoe_local.offload import Offload
from fmoe_local.policies import make_policy
from fmoe_local.policies.base import ModelShape, Policy
from fmoe_local.prefetch_distance import distance_for
from fmoe_local.prefetcher import PrefetcherFailed
from fmoe_local.quant_cache import Progress
from fmoe_local.stats import LayerCounters, RequestStats
from fmoe_local.traces import DECODE, PREFILL, TraceRecorder

ENCODED_KEPT = 4  # texts whose ids Engine keeps (the check and the request; a chat's cut and the prompt it sends)


class PromptRefused(ValueError):
    """The messages cannot be a prompt for this model; the message is a sentence that says why. The request's
    fault, not the server's: an API answers it 400, not 500."""


class ContextTooLong(PromptRefused):
    """The prompt does not fit the model's context; the message says by how much and what to do."""


class TemplateRefused(PromptRefused):
    """The model's chat template rejects this sequence of messages (e.g. roles that do not alternate)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("No CUDA GPU is available here. Choose device cpu (or auto).")
    return torch.device(name)


def pinned_budget(config: RuntimeConfig) -> int:
    """Bytes of RAM experts to page-lock on a GPU: the setting, or up to half of the machine's RAM (none when the
    machine does not say how much it has)."""
    if config.pinned_ram_gb is not None:
        return int(config.pinned_ram_gb * 1024**3)
    total, _ = hardware.ram_bytes()
    return total // 2


class Engine:
    def __init__(self) -> None:  # use Engine.build
        raise TypeError("use Engine.build(model_dir, config)")

    @classmethod
    def build(
        cls,
        model_dir: Path,
        config: RuntimeConfig,
        map_persistence: object | None = None,
        saved_costs: MissCosts | None = None,
        progress: Progress | None = None,
        dtype_verdicts: DtypeVerdicts | None = None,
    ) -> Engine:
        """`saved_costs`: figures an earlier load measured on this machine for this model (`miss_costs`); used
        instead of a new probe when they match the model's stored format and size and the device. `progress`:
        load_model's, while a quantised copy of the experts is made. `dtype_verdicts`: what `dtype` auto decides
        with on a CPU (dtype_verdicts.py: saved ratios of this machine, probes run only for those missing); kept
        as `self.dtype_verdicts`, with what this load measured added, for the app to save."""
        self = object.__new__(cls)
        self.model_dir = model_dir
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype_verdicts = verdicts = dtype_verdicts if dtype_verdicts is not None else DtypeVerdicts()
        dtype = resolve_dtype(
            config.dtype,
            self.device,
            partial(checkpoint_dtype, model_dir),
            verdicts.keeps_half,
            config.expert_format,
            verdicts.products_prefer_bf16,
        )
        loaded = load_model(model_dir, config, self.device, dtype, progress, verdicts.dense_prefers_openvino)
        self.model, self.tokenizer, self.arch, self.host = loaded.model, loaded.tokenizer, loaded.arch, loaded.host
        self._encoding = threading.Lock()  # tokenize_prompt: the worker's and Runtime.check's callers'
        # The ids of the last texts tokenized, under `_encoding`: an API request's prompt is tokenized by
        # Runtime.check on its caller's thread and again by the worker, and a chat that cuts its oldest turns checks
        # the prompt it then sends; a long conversation's tokenizing is milliseconds each time (docs/bench.md).
        self._encoded: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()  # most recent last
        # Why the model's chat template is not used any more ("" while it is): it ran over its budget once, and a
        # template that can do so would hold every later request for its whole budget.
        self.template_stopped = ""
        if getattr(self.tokenizer, "chat_template", None):
            chat_template.prestart()  # the renderer starts while the model loads, not at the first reply
        self.moe_layers = loaded.moe_layers
        self.dtype = next(p.dtype for p in self.model.parameters() if p.device.type != "meta")
        cfg = self.model.config
        self.shape = ModelShape(
            num_layers=len(self.moe_layers),
            num_experts=self.arch.num_experts(cfg),
            top_k=self.arch.top_k(cfg),
            embed_dim=int(cfg.hidden_size),
        )
        self.dense_format = loaded.dense_format
        self.dense_product = dense_formats.product_name(self.model)
        self.dense_repacked_bytes = dense_formats.repacked_bytes(self.model)
        self.resident_bytes = (
            dense_formats.packed_bytes(self.model)
            + self.dense_repacked_bytes
            + sum(p.numel() * p.element_size() for p in self.model.parameters() if p.device.type != "meta")
        )
        self.counters = LayerCounters(self.shape.num_layers, self.shape.num_experts)
        self._check_store(config)  # a saved capacity too big for RAM: a sentence (SettingRefused), not MemoryError
        self.map_store = MapStore.for_config(self.shape, config, map_persistence)
        if map_persistence is not None:
            self.map_store.load_from()  # the user's earlier maps: why prediction improves over time
        policy = make_policy(config.policy, self.shape, config, self.map_store)
        self.interrupt = threading.Event()
        # Sized after the resident weights took their share of the device: a cache the GPU cannot hold gets what
        # fits, and the load says so (cache_notice), instead of failing with the allocator's out-of-memory error.
        capacity, self.cache_notice = fitted_slots(
            self._capacity(config), self.host.expert_bytes, cache_budget.device_room_bytes(self.device)
        )
        check_capacity(capacity, self.host.expert_bytes)
        # Measured before the expert cache's slots are allocated, so they are counted out by hand.
        room = cache_budget.kv_room_bytes(self.device)
        room = None if room is None else max(0, room - capacity * self.host.expert_bytes)
        self.prefix_budget = cache_budget.prefix_budget_bytes(config.prefix_cache_gb, room)
        if self.cache_notice:
            self.config = config = config.with_changes(cache_experts=capacity)
        self.miss_costs, kernel = self._measure_misses(saved_costs)
        self.offload = Offload(
            self.host,
            self.device,
            capacity,
            policy,
            self.counters,
            self.miss_costs,
            kernel,
            miss_handling=config.miss_handling,
            load_timeout_s=config.load_timeout_s,
            copy_chunk_bytes=int(config.copy_chunk_mb * 1024**2),
            synchronous=config.synchronous_prefetch,
            interrupt=self.interrupt,
            pinned_bytes=pinned_budget(config),
        )
        self.observer = RoutingObserver(
            self.model.get_input_embeddings(),
            self.moe_layers,
            self.arch,
            self.offload.publish,
            config.semantic_mode,
            per_layer=lambda: self.offload.per_layer,
        )
        self.observer.want_lookahead = policy.needs_lookahead
        self.observer.attach()
        self.offloaded = OffloadedExperts({id(ref.experts): ref.moe_index for ref in self.moe_layers}, self.offload)
        self.model.set_experts_implementation(self.offloaded.register())
        use_our_attention(self.model)  # no copy of the past per head, no score matrix of the whole prompt
        self.eos_ids = self._eos_ids()
        # Grammars are compiled against this tokenizer, the model's logits' width and its end tokens.
        self.grammars = Grammars(self.tokenizer, int(self.model.config.vocab_size), self.eos_ids)
        self._tools_probe: bool | None = None  # supports_tools' answer, found once
        self._opening: str | None = None  # reply_opening's answer, found once
        self.recorder = None
        if config.record_trace:
            shape = self.shape
            self.recorder = TraceRecorder(model_dir.name, shape.num_layers, shape.num_experts, shape.top_k)
            self.observer.recording = True
        self._request_id = 0
        self._iteration_in_request = 0
        return self

    @property
    def cache(self) -> ExpertCache:
        """The Offload's cache, for reading (tests, statistics); the forward pass goes through the Offload."""
        return self.offload.cache

    @property
    def policy(self) -> Policy:
        return self.offload.policy

    def _measure_misses(self, saved: MissCosts | None) -> tuple[MissCosts, Kernel]:
        """The miss figures for this model here: the saved ones when they fit, else a short probe (miss_cost.py)."""
        fits = saved is not None and (saved.device, saved.expert_bytes) == (self.device.type, self.host.expert_bytes)
        if fits and saved.fmt == cpu_experts.FORMAT_OF_DTYPE.get(self.host.param_dtype):
            try:
                return saved, miss_cost.kernel_named(saved, self.device)
            except ValueError:
                pass  # measured with a kernel this install lacks: measure again
        return miss_cost.probe(self.host, self.moe_layers[0].experts, self.device)

    def _capacity(self, config: RuntimeConfig) -> int:
        if config.cache_experts is not None:
            return config.cache_experts
        return slots_for_budget(config.cache_gb, self.host.expert_bytes)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return ids

    # ---- requests ------------------------------------------------------------------------------------------------
    @property
    def context_length(self) -> int | None:
        """The most tokens (prompt + reply) the model reads, from its config; None when it does not say."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def name(self) -> str:
        """The model as a sentence names it: its folder's name, but "the demo model" for the shipped one, whose
        folder, "weights", says nothing (the UI's longer label for it lives in ui/, which fmoe_local cannot use)."""
        from fmoe_local.demo import demo_model_dir

        try:
            demo = demo_model_dir().resolve()
        except FileNotFoundError:  # an install without the demo: no folder can be it
            return self.model_dir.name
        return "the demo model" if self.model_dir.resolve() == demo else self.model_dir.name

    def encode_prompt(
        self, prompt: list[dict] | str, tools: list[dict] | None = None, variables: dict | None = None
    ) -> torch.Tensor:
        """Prompt ids [1, T] on the device: `tokenize_prompt` (which may raise PromptRefused) as a tensor."""
        # Through numpy: torch.tensor reads a list of Python ints one by one (0.6 ms for 4,000 ids, numpy 0.09 ms).
        ids = np.array(self.tokenize_prompt(prompt, tools, variables), dtype=np.int64)
        return torch.from_numpy(ids).unsqueeze(0).to(self.device)

    def tokenize_prompt(
        self, prompt: list[dict] | str, tools: list[dict] | None = None, variables: dict | None = None
    ) -> list[int]:
        """Prompt ids of chat messages, from the tokenizer's own chat template (plain concatenation when it has none;
        a final assistant message is continued, not answered: inside its thought when it has only a `thinking`), or
        of a text to continue as it is (an API client's /v1/completions: the tokenizer's own special tokens, a BOS
        where the model has one, and no template).
        Touches no device: Runtime.check calls it on its caller's thread. Raises ContextTooLong (a sentence) when
        the prompt leaves no room for a reply: refused before any compute, so an over-long paste cannot occupy the
        model for minutes; TemplateRefused (a sentence) when the model's chat template rejects the messages (its
        raise_exception: e.g. roles that do not alternate); TemplateOverBudget (a sentence) when the template ran
        over its budget of time, memory or output (chat_template.py), on these messages or earlier ones. `tools`:
        the functions the model may call (OpenAI's `tools`), rendered by the template as it writes them;
        `variables`: the template's own switches a request sets (Qwen3's `enable_thinking`)."""
        with self._encoding:
            if isinstance(prompt, str):
                text, special = prompt, True
            else:
                text, special = self._chat_text(prompt, tools, variables)
            ids = self._encoded.get((text, special))
            if ids is None:
                ids = self._encode(text, special, isinstance(prompt, str))
                self._encoded[(text, special)] = ids
                if len(self._encoded) > ENCODED_KEPT:
                    self._encoded.popitem(last=False)
            else:
                self._encoded.move_to_end((text, special))
        limit = self.context_length
        if limit is not None and len(ids) >= limit:
            raise ContextTooLong(self._too_long(f"{len(ids):,}", isinstance(prompt, str)))
        return list(ids)

    def _too_long(self, tokens: str, is_text: bool) -> str:
        fix = "Shorten the prompt." if is_text else "Start a new chat, or shorten the message."
        what = "prompt" if is_text else "conversation"
        return f"This {what} is {tokens} tokens long, but {self.name} reads at most {self.context_length:,}. {fix}"

    def _encode(self, text: str, add_special_tokens: bool, is_text: bool) -> tuple[int, ...]:
        """The text's ids; a text far longer than the context is refused from a prefix instead of tokenized whole
        (a 10 MB message to a 512-token model took 42 s and 1.25 GB to count, and held every other prompt's
        tokenizing meanwhile). Prefixes of 8, 32, 128… times the context in characters are counted while the text
        is longer: once one holds twice the context in tokens, the whole text is over the context whatever the
        rest (a cut changes the tokens of the word it splits, not a context's worth)."""
        limit, tok = self.context_length, self.tokenizer
        probe = 8 * limit if limit else len(text)
        while probe < len(text):
            counted = len(tok(text[:probe], add_special_tokens=add_special_tokens)["input_ids"])
            if counted >= 2 * limit:
                raise ContextTooLong(self._too_long(f"over {2 * limit:,}", is_text))
            probe *= 4
        ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return tuple(ids[0] if ids and isinstance(ids[0], list) else ids)  # a tuple: kept in `_encoded`, shared

    def encode_marker(self, text: str) -> list[int]:
        """A marker's token ids as the tokenizer writes it alone, with no special tokens added (a thinking budget's
        `</think>`: logits_rules.ThoughtRule). Raises ValueError (a sentence) for a marker the model cannot write: an
        id beyond its logits."""
        with self._encoding:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if any(not 0 <= i < int(self.model.config.vocab_size) for i in ids):
            raise ValueError(
                f"{self.name} cannot write {text!r}: its tokens are beyond the model's vocabulary, so its thinking "
                "cannot be held to a budget. Send the request without a thinking budget (thinking_token_budget, "
                "thinking.budget_tokens)."
            )
        return ids

    def supports_tools(self) -> bool:
        """Whether the model's chat template shows the model the tools it is given: a probe tool's name appears in
        what it renders (a template that ignores `tools` would let the model answer without ever seeing them)."""
        if self._tools_probe is None:
            probe = "fmoe_probe_tool_q7"
            tool = {"type": "function", "function": {"name": probe, "description": "", "parameters": {}}}
            try:
                with self._encoding:
                    text, _ = self._chat_text([{"role": "user", "content": "hi"}], [tool])
                self._tools_probe = probe in text
            except PromptRefused:
                self._tools_probe = False
        return self._tools_probe

    def reply_opening(self) -> str:
        """What the chat template writes to open the assistant's reply (its add_generation_prompt part), found from
        a probe conversation rendered with and without it: "<|im_start|>assistant\n", or with "<think>\n" after
        it where the template opens the model's thinking for it (a server then reads the reply as thinking from its
        first token). "" without a template, or when the template refuses the probe."""
        if self._opening is None and not getattr(self.tokenizer, "chat_template", None):
            self._opening = ""
        if self._opening is None:
            probe = [{"role": "user", "content": "hi"}]
            try:
                with self._encoding:
                    asked, _ = self._chat_text(probe)
                    plain = chat_template.render(
                        self.tokenizer.get_chat_template(),
                        probe,
                        add_generation_prompt=False,
                        continue_final_message=False,
                        variables=dict(self.tokenizer.special_tokens_map),
                        model=self.name,
                    )
                self._opening = asked[len(plain) :] if asked.startswith(plain) else ""
            except (PromptRefused, TemplateError, TemplateOverBudget):
                self._opening = ""
        return self._opening

    def _chat_text(
        self, messages: list[dict], tools: list[dict] | None = None, variables: dict | None = None
    ) -> tuple[str, bool]:
        """The prompt text of chat messages and whether the tokenizer adds its special tokens to it (only without a
        template: a template writes them itself)."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            return "\n".join(m.get("content") or "" for m in messages), True
        # A final assistant message is a reply to go on with (the chat's Continue, an API client's prefill): the
        # prompt ends inside it, where the model left off, instead of opening a new turn after it. One with no content
        # but a `thinking` was cut inside its thought (GPT-OSS's analysis channel): the prompt ends inside the thought,
        # as the template renders it (transformers' continue_final_message="thinking").
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else {}
        cont: bool | str = bool(last.get("content")) or ("thinking" if isinstance(last.get("thinking"), str) else False)
        if self.template_stopped:
            raise TemplateOverBudget(self.template_stopped)
        try:
            # The template is code from the model's files: rendered in a child process with a budget, never here.
            text = chat_template.render(
                tok.get_chat_template(),
                messages,
                add_generation_prompt=not cont,
                continue_final_message=cont,
                variables=dict(tok.special_tokens_map) | ({"tools": tools} if tools else {}) | (variables or {}),
                model=self.name,
            )
        except TemplateOverBudget as exc:
            self.template_stopped = str(exc)
            raise
        except TemplateSyntaxError:
            raise  # the template itself is broken: not these messages' fault
        except TemplateError as exc:
            raise TemplateRefused(f"The chat template of {self.name} refuses these messages: {exc}") from exc
        return text, False

    @contextmanager
    def request(
        self, request_id: int, stats: RequestStats, text: str = "", reused_ids: torch.Tensor | None = None
    ) -> Iterator[None]:
        """Bracket one request. A background failure during it raises PrefetcherFailed here (unless the request
        already failed), so it reaches the request that was running. `reused_ids`: the prompt's first tokens, held
        by a kept KV cache and not prefilled again (the observer's semantic embedding still counts them)."""
        self._request_id, self._iteration_in_request = request_id, 0
        before = self.counters.snapshot()
        self.observer.begin_request(reused_ids)
        self.offload.begin_request(request_id)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            late_error = self.offload.end_request(self.config.load_timeout_s)
            self.counters.since(before).fill(stats)
            stats.cache_gb_used = self.offload.resident_bytes() / 1024**3
            if self.recorder is not None and len(self.recorder):
                self.recorder.label(request_id, text=text)
                self.recorder.checkpoint(self.config.record_trace)
            if not failed:
                if late_error is not None:
                    raise late_error
                self.offload.raise_if_failed()
            else:
                # The request already ends with its own error (or was stopped): a background failure it did not
                # report must not end the next, unrelated request; the policy is rebuilt as after a reported one.
                try:
                    self.offload.raise_if_failed()
                except PrefetcherFailed:
                    self.recover_policy()

    def end_iteration(self) -> None:
        self.offload.end_iteration()
        if self.recorder is not None:
            obs = self.observer
            probs = torch.stack(obs.rows_probs, dim=1).cpu().numpy()  # [T, L, J]
            phase = PREFILL if self._iteration_in_request == 0 else DECODE
            self.recorder.add(self._request_id, phase, probs, obs.rows_embed.cpu().numpy())
        self._iteration_in_request += 1

    # ---- settings ------------------------------------------------------------------------------------------------
    def recover_policy(self) -> None:
        """After a background failure: a fresh policy on the same map store (what the store holds survives)."""
        self._set_policy(make_policy(self.config.policy, self.shape, self.config, self.map_store))

    def _set_policy(self, policy: Policy) -> None:
        self.offload.set_policy(policy)
        self.observer.want_lookahead = policy.needs_lookahead

    def reconfigure(self, new: RuntimeConfig) -> None:
        """Between requests only (the runtime's worker calls it); the model is not reloaded. Everything is checked
        before anything changes, so a refused value changes nothing; the one step that can fail while applying
        (allocating the new cache) goes first and, if it fails, the previous size is restored before raising."""
        old = self.config
        new.validate()
        capacity = self._capacity(new)
        check_capacity(capacity, self.host.expert_bytes)
        if new.store_capacity != old.store_capacity:
            self._check_store(new)
        self._check_idle(old.load_timeout_s)
        if capacity != self._capacity(old):
            try:
                self.offload.resize(capacity)
            except Exception as exc:
                self.offload.resize(self._capacity(old))  # cold, at the size that worked
                raise ValueError(
                    f"Could not set up a {capacity}-expert cache ({type(exc).__name__}: {exc}). The previous "
                    f"{self.cache.capacity}-expert cache is back; choose a smaller cache."
                ) from exc
        if (new.store_capacity, new.prefetch_distance) != (old.store_capacity, old.prefetch_distance):
            self.map_store.reconfigure(capacity=new.store_capacity, prefetch_distance=new.prefetch_distance)
        # Retuned in place where the policy can: it keeps what it learned so far.
        retuned = new.policy == old.policy and self.policy.reconfigure(
            prefetch_distance=new.prefetch_distance, store_capacity=new.store_capacity
        )
        if not retuned and (new.policy != old.policy or new.prefetch_distance != old.prefetch_distance):
            self._set_policy(make_policy(new.policy, self.shape, new, self.map_store))
        self.offload.set_load_timeout(new.load_timeout_s)
        self.offload.set_miss_handling(new.miss_handling)
        self.config = new

    def _check_store(self, config: RuntimeConfig) -> None:
        s = self.shape
        per_map = map_bytes(s.num_layers, s.num_experts, s.embed_dim, config.sketch_dim)
        check_store_capacity(config.store_capacity, per_map, cache_budget.map_room_bytes())

    def adapt_distance(self, layer_s: float | None) -> None:
        """With `prefetch_distance_auto`: retune d to the measured copy time and this layer time (between requests
        only). Nothing without a GPU, where no expert is copied, or without a layer time."""
        if not self.config.prefetch_distance_auto or not self.miss_costs.has_gpu or not layer_s:
            return
        d = distance_for(self.miss_costs.copy_s, layer_s, self.shape.num_layers)
        if d != self.config.prefetch_distance:
            self.reconfigure(self.config.with_changes(prefetch_distance=d))

    def reset_cache(self) -> None:
        """A new, cold cache of the configured size (between requests only): every expert back to RAM only."""
        self._check_idle(self.config.load_timeout_s)
        self.offload.resize(self._capacity(self.config))

    def _check_idle(self, timeout_s: float) -> None:
        """Refuse a change while a prefetch copy is still stuck in a read: the new cache would be swapped in under
        it (its copy then fails, and the next request with it). Nothing has changed when this raises."""
        if not self.offload.wait_idle(timeout_s):
            raise ValueError(
                "A copy of an expert is still stuck reading the model files, so nothing was changed. Try again in a "
                "moment; if this repeats, check the disk or download the model again."
            )

    def finish_recording(self) -> None:
        """Write what the trace recorder holds and has not saved yet (forward thread, after the last request)."""
        if self.recorder is not None and self.recorder.unsaved:
            self.recorder.save(self.config.record_trace)

    def close(self) -> None:
        self.offload.close()
        self.observer.detach()
        self.host.close()
