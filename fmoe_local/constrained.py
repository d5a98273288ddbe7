"""Grammar-constrained decoding: a reply held token by token to a grammar (a JSON schema, any JSON object, a tool
call's shape), with llguidance (pinned in pyproject.toml; chosen over xgrammar by the per-token overhead measured in
docs/bench.md, "Constrained decoding", and because its wheels need no compiler or triton).

Scope: grammar text from a JSON schema (`json_schema_grammar`, `JSON_OBJECT`) or a Lark grammar (`lark_grammar`);
`Grammars.check` compiles one against the model's tokenizer and raises GrammarRefused (a sentence naming the
schema path) when it cannot be; `Grammars.start` gives one request's TokenConstraint, which masks the logits before
sampling and follows the sampled tokens. It does NOT sample (generate.py) or know the API's formats (ui/ builds the
grammar text of a tool call or a response_format).

Threads: a Grammars belongs to one engine; its tokenizer is built once, under a lock, on whichever thread asks
first (Runtime.check on a server thread, or the worker). A TokenConstraint belongs to the request's worker thread.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# Text a grammar can be: llguidance's JSON grammar format, as its own helpers write it.
Grammar = str


class GrammarRefused(ValueError):
    """The grammar (a response_format's schema, a tool's parameters) cannot be compiled; the message is a sentence
    naming where in the schema and what to send instead. The request's fault: an API answers it 400."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


def json_schema_grammar(schema: dict) -> Grammar:
    """The grammar of JSON text matching `schema` (strict: no field beyond those the schema allows, as OpenAI's
    strict mode)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def lark_grammar(lark: str) -> Grammar:
    """A Lark grammar (llguidance's dialect: `%json{...}` embeds a JSON schema) as grammar text."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


# Any JSON object: response_format {"type": "json_object"}.
JSON_OBJECT_SCHEMA = {"type": "object"}


class Grammars:
    """Grammars compiled against one model's tokenizer. `vocab_size`: the model's logits' width (it may exceed the
    tokenizer's: padded embeddings), every id beyond the tokenizer's never allowed; `eos_ids`: the tokens that end a
    reply, the only ones allowed once the grammar is complete."""

    def __init__(self, tokenizer: object, vocab_size: int, eos_ids: set[int]) -> None:
        self._hf, self._vocab, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The tokens that end a reply: kept from a thought that comes before a grammar's text (logits_rules.py)."""
        return tuple(self._eos)

    def _llg(self):  # noqa: ANN202 - an llguidance.LLTokenizer
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf, n_vocab=self._vocab, eos_token=self._eos or None
                    )
                except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast ones only
                    raise GrammarRefused(
                        "This model's tokenizer cannot hold a reply to a grammar (it is not a fast tokenizer), so "
                        "structured output and forced tool calls are not available with it. Send the request without "
                        "response_format or tool_choice."
                    ) from exc
            return self._tokenizer

    def check(self, grammar: Grammar, schema: dict | None = None, where: str = "schema") -> None:
        """Raise GrammarRefused when `grammar` cannot be compiled; `schema`: the JSON schema it came from, searched
        for the part that fails, named as `where` + its path (`response_format.json_schema.schema.properties.a`)."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self._llg())
        if not error:
            return
        path = where + _failing_path(schema, error) if schema is not None else where
        raise GrammarRefused(
            f"The JSON schema at '{path}' cannot be enforced: {error}. Send a schema without that construct "
            "(JSON Schema's type, properties, required, items, enum, const, anyOf and $ref are supported).",
            path,
        )

    def start(self, grammar: Grammar) -> TokenConstraint:
        """One request's constraint, at the start of its reply."""
        import llguidance

        matcher = llguidance.LLMatcher(self._llg(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarRefused(f"The reply's grammar cannot be enforced: {matcher.get_error()}.")
        return TokenConstraint(matcher, self._vocab)


class TokenConstraint:
    """Masks the tokens the grammar does not allow next, and follows the tokens sampled."""

    def __init__(self, matcher: object, vocab_size: int) -> None:
        self._matcher, self._vocab = matcher, vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)  # one bit per token, written in place

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with every token the grammar forbids next at -inf (a new tensor)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        width = logits.shape[-1]
        allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:width].astype(bool)
        if len(allowed) < width:  # logits wider than the vocabulary the grammar knows: the rest never allowed
            allowed = np.pad(allowed, (0, width - len(allowed)))
        return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        """The token sampled from the masked logits. A matcher left in error (it cannot be, after a masked pick)
        is a bug here, raised rather than generating text that breaks the grammar."""
        if not self._matcher.consume_token(token) and self._matcher.is_error():
            raise RuntimeError(f"Constrained decoding lost its place: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar has matched a whole reply and allows nothing but its end."""
        return self._matcher.is_stopped()


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _failing_path(schema: dict, error: str) -> str:
    """Where in `schema` the compile `error` comes from: the deepest subschema that fails alone (with the root's
    definitions beside it, so a good $ref still resolves), as a dotted path; "" when only the whole fails."""
    import llguidance

    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema}

    def fails(sub: object) -> bool:
        if not isinstance(sub, dict):
            return False
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema({**defs, **sub})
        except ValueError:
            return True
        return bool(llguidance.LLMatcher.validate_grammar(grammar))

    def deepest(node: dict, path: str) -> str:
        for key in _SUBSCHEMA_MAPS:
            for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
                if fails(sub):
                    return deepest(sub, f"{path}.{key}.{name}")
        for key in _SUBSCHEMA_LISTS:
            for i, sub in enumerate(node.get(key) or []) if isinstance(node.get(key), list) else ():
                if fails(sub):
                    return deepest(sub, f"{path}.{key}[{i}]")
        for key in _SUBSCHEMA_ONE:
            if key in node and fails(node[key]):
                return deepest(node[key], f"{path}.{key}")
        return path

    del error  # the search compiles each part itself; the first error only told us one exists
    return deepest(schema, "") if isinstance(schema, dict) else ""
