"""The token loop: prefill, then one decode step at a time with a KV cache; sampling; incremental detokenising.

Scope: turning a prompt's ids into generated ids, honouring a stop flag between tokens. `generate_ids` takes a
starting KV cache and how many prompt tokens it already holds (prefix_cache.py) and prefills only the rest; a
request's LogitsRules (logits_rules.py) change the logits before each token is sampled (temperature, top-p, top-k:
`sample_next`); `Detokenizer` streams the text by decoding a window of the last ids, never every id again on every
token (fmoe_bench/detokenize.py times both). It does NOT know about offloading (the experts implementation does
that inside the model's forward) nor about threads or statistics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from transformers import Cache

from fmoe_local.config import Sampling
from fmoe_local.kv_cache import GrowingCache, first_capacity
from fmoe_local.logits_rules import LogitsRules


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Pick the next token from `logits` [V]."""
    if sampling.greedy or sampling.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float()
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties at the k-th are kept, as transformers does
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p  # always keeps the first
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_ids(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # [1, T]
    sampling: Sampling,
    eos_ids: set[int],
    stop: threading.Event,
    after_forward: Callable[[], None] = lambda: None,
    rules: LogitsRules | None = None,
    cache: Cache | None = None,
    cached: int = 0,
) -> Iterator[int]:
    """Yield generated token ids until EOS, max_new_tokens or `stop` (checked before every forward pass).
    `rules`: the request's changes to the logits before each token is sampled (penalties, bias, a grammar; None:
    the penalties `sampling` asks for, no grammar). `cache`:
    the KV cache to extend in place (a fresh kv_cache.GrowingCache when None: no copy of the context per token),
    already holding the first `cached` prompt tokens (prefix_cache.py); only the rest is prefilled, at least the last
    token, whose logits give the first reply token."""
    if not 0 <= cached < prompt_ids.shape[1]:
        raise ValueError(f"A cache holding {cached} of {prompt_ids.shape[1]} prompt tokens leaves nothing to prefill.")
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    if cache is None:
        cache = GrowingCache(model.config, first_capacity(prompt_ids.shape[1], sampling.max_new_tokens))
    inputs = prompt_ids[:, cached:]
    if rules is None:
        rules = LogitsRules.for_request(sampling, None, prompt_ids)
    with torch.inference_mode():
        for _ in range(sampling.max_new_tokens):
            if stop.is_set():
                return
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            after_forward()
            logits = out.logits[0, -1].cpu()
            if rules is not None:
                logits = rules.apply(logits)
            token = sample_next(logits, sampling, generator)
            if rules is not None:
                rules.advance(token)
            yield token
            if token in eos_ids:
                return
            inputs = torch.tensor([[token]], device=prompt_ids.device)


def special_token_ids(tokenizer: object, texts: Iterable[str]) -> dict[str, int]:
    """Those of `texts` that are one special token of `tokenizer` (decode(skip_special_tokens=True) drops them), by
    id."""
    texts = sorted(set(texts))
    if not texts:
        return {}
    skipped = Detokenizer.special_ids(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(texts)
    return {t: i for t, i in zip(texts, ids, strict=True) if i is not None and i in skipped}


class Detokenizer:
    """Streams text for a growing list of ids: each `add` decodes a window of the last few ids, not every id, and the
    deltas joined (then `rest()`) are exactly `decode(ids, skip_special_tokens=True)`.

    A window starts where all text before it was whole and sent, one id or more before the text still to send (their
    left context: a decoder may render a sequence's first id differently, as SentencePiece's drops its leading space),
    so the decoder cannot tell the split from the whole (UTF-8 decoding starts afresh after a whole character; special
    tokens decode to nothing and never start a window). A delta never ends inside a multi-byte character (the
    decoder's U+FFFD: wait for the next id), nor on a byte piece (<0xE2>: byte fallback decodes a run of them
    together, all to U+FFFD if the run is not UTF-8 as a whole), nor, for tokenizers that clean up spaces before
    punctuation (" ." → "."), within a short last word a later id could change.

    `keep`: special tokens whose text the deltas keep where they were generated (a tool-call format's markers, such
    as Mistral's [TOOL_CALLS] or GPT-OSS's <|call|>, for the parser of the request that asked for them: ui/
    tool_calls.py); every other special token is left out as before. A kept marker is not part of any window: the
    text before it is sent whole first (it is whole: a special token starts afresh), then the marker.
    """

    WINDOW = 16  # ids in a window before it moves on (a little later if its text is not whole then)
    CLEANUP_SPAN = 4  # the longest text transformers' clean_up_tokenization rewrites (" n't"), a space first

    def __init__(self, tokenizer: object, keep: frozenset[str] = frozenset()) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._content: list[int] = []  # ids that produce text: the skipped special tokens are left out
        self._skipped = self.special_ids(tokenizer)
        self._kept = {i: text for text, i in special_token_ids(tokenizer, keep).items()}
        self._text: list[str] = []  # the deltas sent, joined by `text`
        self._byte_pieces = self._byte_piece_ids(tokenizer)
        self._cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._start = 0  # the window: self._content[self._start:]
        self._sent = 0  # characters of the window's text already sent
        self._clean = 0  # the last length of self._content whose text was whole and sent: where a window may start

    @staticmethod
    def special_ids(tokenizer: object) -> frozenset[int]:
        """The ids decode(skip_special_tokens=True) drops: they must not open a window, where the id after them
        would be decoded as a sequence's first."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        return frozenset(getattr(tokenizer, "all_special_ids", ()))

    @staticmethod
    def _byte_piece_ids(tokenizer: object) -> frozenset[int]:
        pieces = [f"<0x{b:02X}>" for b in range(256)]
        convert = getattr(tokenizer, "convert_tokens_to_ids", None)
        if convert is None:
            return frozenset()
        ids = [i for i in convert(pieces) if i is not None]
        back = tokenizer.convert_ids_to_tokens(ids)
        return frozenset(i for i, piece in zip(ids, back, strict=True) if piece in pieces)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def _ready(self, text: str) -> int:
        """How much of the window's text no later id can change."""
        if text.endswith("\ufffd") or self._content[-1] in self._byte_pieces:
            return self._sent
        space = text.rfind(" ")
        if self._cleans_up and space >= 0 and len(text) - space < self.CLEANUP_SPAN:
            return max(self._sent, space)
        return len(text)

    def add(self, token_id: int) -> str:
        delta = self._add(token_id)
        self._text.append(delta)
        return delta

    def _add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if token_id in self._kept:
            return self._rest() + self._kept[token_id]
        if token_id in self._skipped:
            return ""
        self._content.append(token_id)
        text = self._decode(self._content[self._start :])
        ready = self._ready(text)
        delta, self._sent = text[self._sent : ready], ready
        if ready == len(text):
            if len(self._content) - self._start >= self.WINDOW and self._clean > self._start:
                # Everything is sent, so the new window's text is all sent too, however the decoder renders its
                # first id ("foo" for "▁foo", "##ing" as it is): only its length matters.
                self._start, self._sent = self._clean, len(self._decode(self._content[self._clean :]))
            self._clean = len(self._content)
        return delta

    def rest(self) -> str:
        """What `add` held back at the end (an incomplete character, a short last word): the reply's last delta."""
        rest = self._rest()
        self._text.append(rest)
        return rest

    def _rest(self) -> str:
        text = self._decode(self._content[self._start :]) if self._content else ""
        rest, self._sent = text[self._sent :], len(text)
        return rest

    @property
    def text(self) -> str:
        """The whole reply's text: without `keep`, decode(ids, skip_special_tokens=True); with it, the deltas."""
        if not self._kept:
            return self._decode(self.ids)
        held = self._decode(self._content[self._start :])[self._sent :] if self._content else ""
        return "".join(self._text) + held
