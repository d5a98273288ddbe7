"""A client that goes away cancels its request's handle while the reply waits for its next token (not only when a
later send fails), streamed or not: the model stops within a token of the disconnect."""

from __future__ import annotations

from tests.client_gone import complete_for_a_gone_client, running, stream_until_the_client_goes
from ui.openai_stream import Shape, Streamed, complete, sse
from ui.reply_parts import ReplyParts

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/v1/chat/completions"}


def test_a_streamed_reply_s_client_gone_mid_reply_cancels_it():
    handle = running()
    shape = Shape("chatcmpl-1", 0, "m")
    sent = stream_until_the_client_goes(lambda: Streamed(sse(handle, ReplyParts([]), shape, False), handle), SCOPE)
    assert handle.cancelled and handle.result(timeout=0).reason == "cancelled"
    assert any(b"Once" in m.get("body", b"") for m in sent)


def test_a_plain_reply_s_client_gone_cancels_it():
    handle = running()
    complete_for_a_gone_client(lambda req: complete(handle, ReplyParts([]), Shape("chatcmpl-1", 0, "m"), req), SCOPE)
    assert handle.cancelled and handle.result(timeout=0).reason == "cancelled"
