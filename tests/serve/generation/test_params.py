"""Generation requests are checked before anything runs: a bad value is refused naming its field, as
OpenAI's API does, and defaults come from the version's generation config."""

from __future__ import annotations

import pytest

from mlscale.serve.generation.params import Defaults, ParamError, parse_chat, parse_completion, parse_oip

DEFAULTS = Defaults()


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "top_k": -1}, "top_k"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "stop": ""}, "stop"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),  # OpenAI refuses unknown fields
    ({"prompt": "hi", "echo": True}, "echo"),  # OpenAI's, not served: refused, never ignored
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),  # only with stream
    ({"prompt": [1, -2]}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_fields_are_refused_by_name(body, field):
    with pytest.raises(ParamError) as error:
        parse_completion(body, DEFAULTS)
    assert error.value.param == field and field in str(error.value)


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_fields_are_refused_by_name(body, field):
    with pytest.raises(ParamError) as error:
        parse_chat(body, DEFAULTS)
    assert error.value.param == field


def test_a_completion_request_reads_as_sampling_params():
    request = parse_completion({"model": "m", "prompt": ["a", "b"], "max_tokens": 5, "temperature": 0, "top_k": 3,
                                "seed": 7, "stop": "\n", "n": 2, "logprobs": 2, "stream": True,
                                "stream_options": {"include_usage": True}}, DEFAULTS)
    assert request.prompts == ["a", "b"] and request.stream and request.include_usage
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_k, sampling.n) == (5, 0, 3, 2)
    assert sampling.stop == ("\n",)
    params = sampling.engine_params(5, index=1)  # a seeded request's second choice: its own seed
    assert (params.seed, params.logprobs, params.max_tokens) == (8, 2, 5)


def test_defaults_fill_what_a_request_leaves_out_within_the_context():
    defaults = Defaults(max_tokens=40, temperature=0.0, stop=("END",))
    sampling = parse_completion({"prompt": [1, 2]}, defaults).sampling
    assert (sampling.temperature, sampling.stop, sampling.max_tokens_for(room=100)) == (0.0, ("END",), 40)
    assert sampling.max_tokens_for(room=10) == 10  # a default never runs past the context
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]}, DEFAULTS).sampling
    assert chat.max_tokens_for(room=37) == 37  # chat: the room left, as OpenAI's default
    assert parse_completion({"prompt": "x"}, DEFAULTS).sampling.max_tokens_for(room=100) == 16  # OpenAI's


def test_chat_logprobs_are_a_flag_and_a_count():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "logprobs": True,
            "top_logprobs": 3}
    request = parse_chat(body, DEFAULTS)
    assert request.messages == [{"role": "user", "content": "hi"}] and request.sampling.logprobs == 3
    assert parse_chat({**body, "top_logprobs": None}, DEFAULTS).sampling.logprobs == 0
    assert parse_chat({**body, "logprobs": False, "top_logprobs": None}, DEFAULTS).sampling.logprobs is None


def test_oip_generate_takes_text_or_ids_and_known_parameters():
    assert parse_oip({"text_input": "hi", "parameters": {"max_tokens": 3}}, DEFAULTS, True).prompts == ["hi"]
    assert parse_oip({"input_ids": [1, 2]}, DEFAULTS, False).prompts == [[1, 2]]
    with pytest.raises(ParamError, match="input_ids"):
        parse_oip({"text_input": "hi"}, DEFAULTS, False)  # no tokenizer: ids only
    with pytest.raises(ParamError, match="best_of"):
        parse_oip({"text_input": "hi", "parameters": {"best_of": 2}}, DEFAULTS, True)
