"""The client side of the OpenAI-compatible API: error bodies in the shapes servers send, and the
events of a streamed reply up to [DONE]."""

from __future__ import annotations

import pytest

from qat4.api_client import StreamError, auth_headers, error_message, stream_events
from qat4.errors import Qat4Error


def test_error_message_of_openai_vllm_and_plain_bodies():
    assert error_message(b'{"error": {"message": "bad key", "type": "x"}}') == "bad key"
    assert error_message(b'{"message": "vLLM says no", "code": 400}') == "vLLM says no"
    assert error_message(b'{"error": "just a string"}') == "just a string"
    assert error_message(b"Bad Gateway\n") == "Bad Gateway"
    assert error_message(b"x" * 1000) == "x" * 300
    assert error_message(b"") == "no details"


def test_stream_events_stop_at_done_and_skip_other_lines():
    lines = [": keep-alive", "", 'data: {"choices": [{"text": "a"}]}', "data: [DONE]", 'data: {"after": 1}']
    assert list(stream_events(lines)) == [{"choices": [{"text": "a"}]}]


@pytest.mark.parametrize("line, message", [
    ("data: {not json", "the server sent an event that is not a JSON object: '{not json'"),
    ("data: [1, 2]", "the server sent an event that is not a JSON object: '[1, 2]'"),
    ('data: {"error": {"message": "out of memory"}}', "error event mid-reply: out of memory"),
])
def test_a_broken_off_stream_is_one_sentence(line, message):
    with pytest.raises(StreamError) as caught:
        list(stream_events(['data: {"choices": []}', line]))
    assert str(caught.value) == message and isinstance(caught.value, Qat4Error)


def test_auth_headers():
    assert auth_headers("k") == {"Authorization": "Bearer k"} and auth_headers(None) == auth_headers("") == {}
