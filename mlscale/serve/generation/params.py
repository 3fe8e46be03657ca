"""Generation requests, parsed and checked: OpenAI's completions and chat completions, the Open
Inference Protocol's generate. Every problem is a ``ParamError`` naming the field, which the endpoints
answer with 400 (OpenAI's error shape on its routes).

Where OpenAI refuses a field it does not know ("Unrecognized request argument"), so do these routes;
fields OpenAI has that are not served here (``echo``, ``suffix``, ``logit_bias``, penalties, tools) are
refused when set to anything but their no-op value, rather than silently ignored. ``top_k``,
``ignore_eos`` and ``return_token_ids`` are the extensions vLLM also takes (the ``openai`` client sends
them with ``extra_body``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mlscale.serve.protocol import BadRequest

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_N = 16
MAX_LOGPROBS = 20  # chat's top_logprobs limit (completions' logprobs: 5 at OpenAI, 20 here as in vLLM)
MAX_PROMPTS = 64


class ParamError(BadRequest):
    """A bad request field: ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Defaults:
    """A version's generation defaults (its registered generation config), used where a request is silent."""

    max_tokens: int | None = None  # None: 16 for completions (OpenAI's), the context's room for chat
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the sampler and of the text: the engine's ``SamplingParams`` less the
    prompt-dependent max_tokens (``None``: the default), with stop strings and choices beside."""

    max_tokens: int | None  # None: not given (then ``default_max_tokens``, within the context's room)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: int | None
    stop: tuple[str, ...]
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    default_max_tokens: int | None = None  # None: as many as the context has room for

    def max_tokens_for(self, room: int) -> int:
        """The tokens a choice may generate after a prompt that leaves ``room`` in the context: as asked
        (the engine refuses more than the room, naming both counts), else the default, cut to the room."""
        if self.max_tokens is not None:
            return self.max_tokens
        return min(self.default_max_tokens or room, room)

    def engine_params(self, max_tokens: int, index: int = 0) -> Any:
        """The engine's ``SamplingParams`` for choice ``index`` (a seeded request's choices differ: seed + index)."""
        from mlscale.serve.generation.engine import SamplingParams

        seed = None if self.seed is None else self.seed + index
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed, logprobs=self.logprobs,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed request: its prompts (texts or token-id lists; chat: ``messages`` instead), its sampling
    and how it is answered."""

    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, str]] | None = None
    sampling: Sampling | None = None
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, *,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(name, f"{name} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ParamError(name, f"{name} must be in {bounds}, got {value!r}")
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ParamError(name, f"{name} must be {bounds}, got {value}")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ParamError(name, f"{name} must be true or false, got {value!r}")
    return value


def _stops(value: Any, name: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ParamError(name, f"{name} must be a non-empty string or a list of them, got {value!r}")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ParamError(name, f"{name} takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _no_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ParamError(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")


def _unsupported(body: dict[str, Any], names: dict[str, Any]) -> None:
    """Fields OpenAI has that are not served here: refused unless absent or set to their no-op value."""
    for name, no_op in names.items():
        value = body.get(name)
        if value is not None and value != no_op and not (isinstance(no_op, tuple) and value in no_op):
            raise ParamError(name, f"{name} is not supported by this server (got {value!r})")


def _sampling(body: dict[str, Any], defaults: Defaults, logprobs: int | None, max_tokens_name: str = "max_tokens",
              default_max_tokens: int | None = 16) -> Sampling:
    """``default_max_tokens``: when neither the request nor the version's defaults say (OpenAI's
    completions: 16; chat: None, the context's room)."""
    return Sampling(
        max_tokens=_integer(body, max_tokens_name, None, 1),
        default_max_tokens=defaults.max_tokens or default_max_tokens,
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, low_open=True),
        top_k=_integer(body, "top_k", defaults.top_k, 0) or 0,
        seed=_integer(body, "seed", None, -(2**63), 2**63 - 1 - MAX_N),  # choice i samples with seed + i
        logprobs=logprobs,
        stop=_stops(body.get("stop")) or defaults.stop,
        n=_integer(body, "n", 1, 1, MAX_N) or 1,
        ignore_eos=_flag(body, "ignore_eos"),
    )


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether usage comes as a last chunk (``stream_options.include_usage``); only with ``stream``."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ParamError("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ParamError("stream_options", f"stream_options must be {{\"include_usage\": bool}}, got {options!r}")
    return _flag(options, "include_usage")


_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                     "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                     "top_k", "ignore_eos", "return_token_ids"})
_COMPLETIONS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                   "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier"}
_NO_OPS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": ({},)}


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ParamError(None, "the request body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ParamError("model", f"model must be a model name, got {model!r}")
    return model


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's ``prompt``: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(_is_id(x) for x in value):
        return [list(value)]
    if (isinstance(value, list) and 0 < len(value) <= MAX_PROMPTS and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(x) for x in p)) for p in value)):
        return [p if isinstance(p, str) else list(p) for p in value]
    raise ParamError("prompt", "prompt must be a string, a list of token ids, or a non-empty list of either "
                     f"(at most {MAX_PROMPTS})")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_completion(body: Any, defaults: Defaults) -> GenerateRequest:
    """``POST /v1/completions``."""
    body = _object(body)
    _no_unknown(body, _COMPLETIONS)
    _unsupported(body, {**_NO_OPS, "echo": False, "suffix": ("",), "best_of": 1})
    if "prompt" not in body:
        raise ParamError("prompt", "prompt is required")
    stream = _flag(body, "stream")
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    return GenerateRequest(prompts=_prompts(body["prompt"]), sampling=_sampling(body, defaults, logprobs),
                           model=_model(body), stream=stream, include_usage=_stream_options(body, stream),
                           return_token_ids=_flag(body, "return_token_ids"))


ROLES = ("system", "user", "assistant", "developer", "tool")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ParamError("messages", "messages must be a non-empty list of {\"role\", \"content\"}")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ParamError(where, f"{where} must have a role among {', '.join(ROLES)}")
        messages.append({"role": message["role"], "content": _content(message.get("content"), where)})
    return messages


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (OpenAI's content parts; images are not served)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ParamError(f"{where}.content", f"{where}.content must be a string or a list of text parts")


def parse_chat(body: Any, defaults: Defaults) -> GenerateRequest:
    """``POST /v1/chat/completions``: ``logprobs`` is a flag there, ``top_logprobs`` the count."""
    body = _object(body)
    _no_unknown(body, _CHAT)
    _unsupported(body, {**_NO_OPS, "tools": ([],), "tool_choice": "none", "response_format": ({"type": "text"},)})
    stream = _flag(body, "stream")
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not _flag(body, "logprobs"):
        raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (top or 0) if _flag(body, "logprobs") else None
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise ParamError("max_completion_tokens", "give max_completion_tokens or max_tokens, not both")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = _sampling(body, defaults, logprobs, name, default_max_tokens=None)
    return GenerateRequest(messages=_messages(body.get("messages")), sampling=sampling,
                           model=_model(body), stream=stream, include_usage=_stream_options(body, stream),
                           return_token_ids=_flag(body, "return_token_ids"))


_OIP_PARAMETERS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                             "stream"})


def parse_oip(body: Any, defaults: Defaults, has_tokenizer: bool) -> GenerateRequest:
    """``POST /v2/models/NAME/generate[_stream]``: ``text_input`` (or ``input_ids``, for a version without a
    tokenizer) and ``parameters``; ``id`` is echoed."""
    body = _object(body)
    _no_unknown(body, frozenset({"text_input", "input_ids", "parameters", "id"}))
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ParamError("parameters", "parameters must be an object")
    _no_unknown(parameters, _OIP_PARAMETERS)
    if has_tokenizer:
        if not isinstance(body.get("text_input"), str):
            raise ParamError("text_input", "text_input (a string) is required")
        prompt: str | list[int] = body["text_input"]
    else:
        ids = body.get("input_ids")
        if not (isinstance(ids, list) and ids and all(_is_id(x) for x in ids)):
            raise ParamError("input_ids", "this version has no tokenizer: send input_ids, a list of token ids")
        prompt = list(ids)
    return GenerateRequest(prompts=[prompt], sampling=_sampling({**parameters, "n": None}, defaults, None))
