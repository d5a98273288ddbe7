"""Loaded by the app under test when $FMOE_TEST_TOKEN_DELAY_S is set: every sampled token takes that long.

Scope: test support only (a fake slow model). The tiny test model writes hundreds of tokens a second, so on a busy
machine a whole reply can end before a Stop pressed in the browser reaches the server; a test of Stop needs a
reply that is still running when the press lands.
"""

import os
import time

import fmoe_local.generate as generate

_DELAY_S = float(os.environ["FMOE_TEST_TOKEN_DELAY_S"])
_sample_next = generate.sample_next


def _slow_sample_next(*args, **kwargs):
    time.sleep(_DELAY_S)
    return _sample_next(*args, **kwargs)


generate.sample_next = _slow_sample_next
