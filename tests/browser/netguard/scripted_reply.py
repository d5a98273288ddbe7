"""Loaded by the app under test when $FMOE_TEST_REPLY is set: every reply is that text (its ids in the tokenizer of
the model folder $FMOE_TEST_REPLY_MODEL, then the end of text), whatever the tiny model's random weights would pick.

Scope: test support only (a fake model that writes what a test needs: a reasoning model's `<think>…</think>`). The
model still runs a forward pass per token, on the scripted ids; only the choice of the next id is replaced.
"""

import os

from transformers import AutoTokenizer

import fmoe_local.generate as generate
import fmoe_local.runtime as runtime

_tok = AutoTokenizer.from_pretrained(os.environ["FMOE_TEST_REPLY_MODEL"])
_IDS = list(_tok(os.environ["FMOE_TEST_REPLY"], add_special_tokens=False)["input_ids"]) + [_tok.eos_token_id]
_at = [0]  # the next id of the reply being written (one request at a time: the runtime's worker)
_generate_ids = runtime.generate_ids


def _scripted_next(*args, **kwargs):
    token = _IDS[min(_at[0], len(_IDS) - 1)]
    _at[0] += 1
    return token


def _from_the_start(*args, **kwargs):
    _at[0] = 0  # each request's reply is the whole text
    return _generate_ids(*args, **kwargs)


generate.sample_next = _scripted_next
runtime.generate_ids = _from_the_start
