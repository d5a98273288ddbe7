"""One request's logit rules (fmoe_local/logits_rules.py): the repetition penalty follows transformers' rule over the
prompt and the reply, OpenAI's frequency and presence penalties count the reply's own tokens, each is off at its
default; a thought that spends its budget has its close forced token by token, and a grammar starts after it; on
tiny Qwen3 and GPT-OSS models whose untrained thought does not close, a budget of B gives exactly B thinking tokens,
the close (</think>, or harmony's end of the analysis message and start of the final one) and an answer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fmoe_local.config import Sampling, ThoughtBudget
from fmoe_local.logits_rules import LogitsRules

LOGITS = torch.tensor([4.0, 3.0, 2.0, -1.0, 0.5])  # [V]


def penalised(sampling: Sampling, prompt: list[int], reply: list[int]) -> list[float]:
    rules = LogitsRules.for_request(sampling, None, torch.tensor([prompt]))
    for token in reply:
        rules.advance(token)
    return rules.apply(LOGITS).tolist()


def test_every_penalty_off_asks_for_no_rules():
    assert LogitsRules.for_request(Sampling(), None, torch.tensor([[0, 1]])) is None


def test_repetition_penalty_is_transformers_rule_over_prompt_and_reply():
    # positive logits divided, negative multiplied; token 99 is past the vocabulary and ignored
    assert penalised(Sampling(repetition_penalty=2.0), [0, 3, 99], [1]) == [2.0, 1.5, 2.0, -2.0, 0.5]


def test_frequency_and_presence_penalties_count_the_replys_own_tokens():
    out = penalised(Sampling(frequency_penalty=0.5, presence_penalty=1.0), [2], [0, 0, 1])
    assert out == [4.0 - 1.0 - 1.0, 3.0 - 0.5 - 1.0, 2.0, -1.0, 0.5]  # the prompt's token 2 is not counted
    assert penalised(Sampling(presence_penalty=-1.0), [2], [4]) == [4.0, 3.0, 2.0, -1.0, 1.5]


# ---- a thought's budget ------------------------------------------------------------------------------------------
START, END, CLOSE = [5], [6], [7, 6, 8]  # "<think>", "</think>", "\n</think>\n\n" as a tokenizer might write them
MARKERS = {"<think>": START, "</think>": END, "\n</think>\n\n": CLOSE}
WIDE = torch.arange(10.0)  # [V]: every marker's id has a logit


def budget(tokens: int, opened: bool = True, max_new_tokens: int = 512, grammar: str | None = None) -> Sampling:
    thought = ThoughtBudget(tokens, "<think>", "</think>", "\n</think>\n\n", opened)
    return Sampling(max_new_tokens=max_new_tokens, thought=thought, grammar=grammar)


def follow(rules: LogitsRules, free: list[int], steps: int) -> list[int | None]:
    """What the rules force at each of `steps` tokens (None: free), each free step taking the next of `free`."""
    out, free = [], iter(free)
    for _ in range(steps):
        logits = rules.apply(WIDE)
        allowed = torch.isfinite(logits).nonzero().reshape(-1).tolist()
        forced = allowed[0] if len(allowed) == 1 else None
        out.append(forced)
        rules.advance(forced if forced is not None else next(free))
    return out


def test_a_thought_that_spends_its_budget_is_closed_for_the_model():
    rules = LogitsRules.for_request(budget(3), None, encode=MARKERS.__getitem__)
    assert follow(rules, [0, 1, 2, 0, 1], 8) == [None, None, None, 7, 6, 8, None, None]


def test_a_thought_the_model_closes_itself_is_not_cut():
    rules = LogitsRules.for_request(budget(3), None, encode=MARKERS.__getitem__)
    assert follow(rules, [0, 6, 1, 2, 3, 4], 6) == [None] * 6  # its own </think> (6) at its second token


def test_a_budget_counts_from_the_start_marker_the_reply_writes_and_only_there():
    opens = LogitsRules.for_request(budget(2, opened=False), None, encode=MARKERS.__getitem__)
    assert follow(opens, [5, 0, 1, 0], 7) == [None, None, None, 7, 6, 8, None]  # <think>, two tokens, the close
    plain = LogitsRules.for_request(budget(2, opened=False), None, encode=MARKERS.__getitem__)
    assert follow(plain, [0, 5, 1, 2, 3, 4], 6) == [None] * 6  # no thought at the start: nothing is counted


def test_a_budget_of_zero_closes_the_thought_at_once_and_repeats_no_penalty():
    sampling = replace(budget(0), logit_bias=((7, -100.0),))  # no bias can keep the close from being written
    rules = LogitsRules.for_request(sampling, None, encode=MARKERS.__getitem__)
    assert follow(rules, [0], 4) == [7, 6, 8, None]


def test_a_budget_as_long_as_the_reply_forces_nothing_within_it():
    rules = LogitsRules.for_request(budget(4, max_new_tokens=4), None, encode=MARKERS.__getitem__)
    assert follow(rules, [0, 1, 2, 3], 4) == [None] * 4


def test_a_budget_spent_inside_the_model_s_own_end_forces_only_the_rest_of_it():
    """A multi-token end the thought's last tokens began: before, the whole close was forced after its first half,
    leaving half a marker in the thought ("</" then "\n</think>\n\n")."""
    markers = {"<think>": [5], "</think>": [6, 9], "\n</think>\n\n": [7, 6, 9, 8]}
    rules = LogitsRules.for_request(budget(3), None, encode=markers.__getitem__)
    assert follow(rules, [0, 1, 6, 2], 5) == [None, None, None, 9, None]  # 6 began the end: 9 completes it
    whole = LogitsRules.for_request(budget(3), None, encode=markers.__getitem__)
    assert follow(whole, [0, 1, 2, 3], 8) == [None, None, None, 7, 6, 9, 8, None]


class _OnlyToken:
    """A grammar that allows token 4 only, and records what it was told."""

    def __init__(self) -> None:
        self.told: list[int] = []

    eos_ids = (9,)  # the tokens that end a reply, as Grammars gives them

    def start(self, grammar: str) -> _OnlyToken:
        return self

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[4] = logits[4]
        return out

    def advance(self, token: int) -> None:
        self.told.append(token)


def test_a_grammar_holds_the_reply_from_the_end_of_a_bounded_thought_the_prompt_opened():
    grammar = _OnlyToken()
    rules = LogitsRules.for_request(budget(2, grammar="g"), grammar, encode=MARKERS.__getitem__)
    assert follow(rules, [0, 1, 4, 4], 7) == [None, None, 7, 6, 8, 4, 4]
    assert grammar.told == [4, 4]  # the thought's tokens and the close are not the grammar's


def test_a_reply_cannot_end_inside_a_thought_that_a_grammar_s_text_must_follow():
    """Before, the thought's logits kept the end-of-reply token, so a forced tool call or a strict schema could end as
    a thought with no call and no JSON."""
    rules = LogitsRules.for_request(budget(3, grammar="g"), _OnlyToken(), encode=MARKERS.__getitem__)
    thinking = rules.apply(WIDE)
    assert thinking[9] == float("-inf") and torch.isfinite(thinking[:9]).all()
    free = LogitsRules.for_request(budget(3), None, encode=MARKERS.__getitem__)  # no grammar: it may end
    assert torch.isfinite(free.apply(WIDE)).all()


def test_a_grammar_holds_the_reply_from_its_first_token_where_the_reply_would_open_the_thought():
    grammar = _OnlyToken()
    rules = LogitsRules.for_request(budget(2, opened=False, grammar="g"), grammar, encode=MARKERS.__getitem__)
    assert follow(rules, [], 3) == [4, 4, 4] and grammar.told == [4, 4, 4]


def test_a_thinking_budget_is_refused_without_its_markers():
    with pytest.raises(ValueError, match="open, end and close"):
        Sampling(thought=ThoughtBudget(3, "<think>", "", "</think>")).validate()
    with pytest.raises(ValueError, match="whole number"):
        Sampling(thought=ThoughtBudget(-1, "<think>", "</think>", "</think>")).validate()


HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")  # GPT-OSS's markers: special tokens in its vocabulary
THINKERS = {  # family → (its thought's markers, a prompt that opens the thought)
    "qwen3_moe": (
        ("<think>", "</think>", "\n</think>\n\n"),
        "<|user|>\nName a colour.<|eos|>\n<|assistant|>\n<think>\n",
    ),
    "gpt_oss": (
        ("<|channel|>analysis<|message|>", "<|end|>", "<|end|><|start|>assistant<|channel|>final<|message|>"),
        "<|start|>user<|message|>Name a colour.<|end|><|start|>assistant<|channel|>analysis<|message|>",
    ),
}


@pytest.mark.parametrize("family", sorted(THINKERS))
def test_a_tiny_model_s_endless_thought_is_cut_at_its_budget_and_the_answer_follows(family, tiny_model_dir, tmp_path):
    from fmoe_local.config import RuntimeConfig
    from fmoe_local.runtime import Runtime
    from tests.tiny import with_special_tokens

    (start, end, close), prompt = THINKERS[family]
    model = tiny_model_dir(family)
    if family == "gpt_oss":
        model = with_special_tokens(model, tmp_path / "harmony", list(HARMONY))
    plain = Sampling(greedy=True, max_new_tokens=20)
    thought = ThoughtBudget(6, start, end, close, opened=True)  # the prompt opened the thought
    with Runtime.load(model, RuntimeConfig(device="cpu", sampling=plain)) as runtime:
        closing = runtime.engine.encode_marker(close)
        free = runtime.submit(prompt, plain).result()
        cut = runtime.submit(prompt, replace(plain, thought=thought)).result()
        written = runtime.engine.tokenizer.decode(free.token_ids[: 6 + len(closing)])  # special tokens and all
    assert end not in written and len(free.token_ids) == 20  # untrained: the thought goes on, not cut
    assert cut.token_ids[:6] == free.token_ids[:6]  # the budget's six thinking tokens, as the model wrote them
    assert cut.token_ids[6 : 6 + len(closing)] == closing  # then the close, forced
    assert len(cut.token_ids) == 20 and cut.reason == "length"  # then the answer, up to max_new_tokens
