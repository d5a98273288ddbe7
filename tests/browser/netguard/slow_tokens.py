"""Loaded by the app under test when $FMOE_TEST_TOKEN_DELAY_S or $FMOE_TEST_TOKEN_HOLD is set: a slow model.

$FMOE_TEST_TOKEN_DELAY_S: every sampled token takes that long. $FMOE_TEST_TOKEN_HOLD (a file's path): a reply that
starts while that file exists cannot end (it keeps writing tokens) until the test deletes the file. A reply that
stops writing would not do: the page's stream notices that it was left only when a token comes.

Scope: test support only (a fake slow model). The tiny test model writes hundreds of tokens a second, so on a busy
machine a whole reply can end before a Stop pressed in the browser reaches the server; a test of Stop needs a
reply that is still running when the press lands. A delay only makes that likely; a test that needs a reply still
running when it acts (another chat waiting for its turn) holds it with the file instead, which no machine's load can
outrun.
"""

import os
import time
from dataclasses import replace
from pathlib import Path

import fmoe_local.generate as generate
import fmoe_local.runtime as runtime

_DELAY_S = float(os.environ.get("FMOE_TEST_TOKEN_DELAY_S", "0"))
_HOLD = Path(os.environ["FMOE_TEST_TOKEN_HOLD"]) if os.environ.get("FMOE_TEST_TOKEN_HOLD") else None
_HOLD_LIMIT_S = 300.0  # a test that never deletes the file fails the reply with a sentence, not a hang
_sample_next = generate.sample_next
_generate_ids = runtime.generate_ids


def _slow_sample_next(*args, **kwargs):
    if _DELAY_S:
        time.sleep(_DELAY_S)
    return _sample_next(*args, **kwargs)


def _held_generate_ids(model, prompt_ids, sampling, eos_ids, *args, **kwargs):
    """The reply goes on (tokens keep streaming, so the page's stream sees them) but cannot end while the hold file
    exists: no token budget, no end of text; once the file is gone it ends at its own budget or end of text."""
    deadline = time.monotonic() + _HOLD_LIMIT_S
    unbounded = replace(sampling, max_new_tokens=10**9)
    for n, token in enumerate(_generate_ids(model, prompt_ids, unbounded, set(), *args, **kwargs), 1):
        held = _HOLD.exists()
        if held and time.monotonic() > deadline:
            raise RuntimeError(f"The test never released its hold on the reply: delete {_HOLD} to let it go on.")
        if held and token in eos_ids:
            continue  # the end of text is not written while held
        yield token
        if not held and (token in eos_ids or n >= sampling.max_new_tokens):
            return


def _counted_from_the_start(*args, **kwargs):
    if _HOLD is not None and _HOLD.exists():
        return _held_generate_ids(*args, **kwargs)
    return _generate_ids(*args, **kwargs)


generate.sample_next = _slow_sample_next
runtime.generate_ids = _counted_from_the_start
