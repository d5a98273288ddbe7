"""Grammar-constrained decoding (llguidance): whatever the logits say, the tokens sampled spell text the grammar
accepts; a schema that cannot be compiled is refused naming where it fails."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from fmoe_local.config import Sampling
from fmoe_local.constrained import GrammarRefused, Grammars, json_schema_grammar, lark_grammar
from fmoe_local.demo import demo_model_dir
from fmoe_local.generate import sample_next
from fmoe_local.logits_rules import LogitsRules

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 9, "minimum": 0}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars():
    tok = AutoTokenizer.from_pretrained(demo_model_dir())
    return tok, Grammars(tok, len(tok) + 7, {tok.eos_token_id})  # logits wider than the vocabulary, as padded


def _decode(tok, grammars, grammar, seed, steps=80):  # noqa: ANN001, ANN202
    """Random logits, masked, sampled: the text a model that knows nothing would write under the grammar."""
    gen = torch.Generator().manual_seed(seed)
    sampling = Sampling(temperature=1.0, top_p=1.0, grammar=grammar)
    rules = LogitsRules.for_request(sampling, grammars)
    ids = []
    for _ in range(steps):
        logits = rules.apply(torch.randn(len(tok) + 7, generator=gen) * 5)
        token = sample_next(logits, sampling, gen)
        assert token < len(tok)  # never a padded id
        rules.advance(token)
        if token == tok.eos_token_id:
            return tok.decode(ids)
        ids.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(5))
def test_random_logits_under_a_schema_write_valid_json(grammars, seed):
    tok, g = grammars
    value = json.loads(_decode(tok, g, json_schema_grammar(SCHEMA), seed))
    assert value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9 and set(value) == {"answer", "n"}


def test_a_lark_grammar_with_an_embedded_schema_holds_the_wrapper_too(grammars):
    tok, g = grammars
    grammar = lark_grammar(f'start: "<call>" obj "</call>"\nobj: %json {json.dumps(SCHEMA)}\n')
    text = _decode(tok, g, grammar, seed=3)
    assert text.startswith("<call>") and text.endswith("</call>") and json.loads(text[6:-7])["answer"] in ("yes", "no")


@pytest.mark.parametrize(
    "schema, path",
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "s.properties.a"),
        ({"type": "object", "properties": {"a": {"items": {"not": {"type": "string"}}}}}, "s.properties.a.items"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, "s.properties.a"),
    ],
)
def test_a_schema_that_cannot_be_compiled_names_its_path(grammars, schema, path):
    _, g = grammars
    with pytest.raises(GrammarRefused, match=f"'{path}'") as caught:
        g.check(json_schema_grammar(schema), schema, "s")
    assert caught.value.path == path


def test_a_good_ref_is_not_blamed(grammars):
    _, g = grammars
    schema = {"$defs": {"x": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}
    g.check(json_schema_grammar(schema), schema, "s")


def test_penalties_and_bias_change_the_logits_as_openai_documents():
    sampling = Sampling(frequency_penalty=0.5, presence_penalty=1.0, logit_bias=((2, -100.0), (3, 4.0)))
    rules = LogitsRules.for_request(sampling, None)
    for token in (1, 1, 0):
        rules.advance(token)
    got = rules.apply(torch.zeros(5))
    assert got.tolist() == [-1.5, -2.0, -100.0, 4.0, 0.0]  # 0 once: 0.5 + 1; 1 twice: 1.0 + 1
    assert LogitsRules.for_request(Sampling(), None) is None  # nothing asked: the loop touches no logits
