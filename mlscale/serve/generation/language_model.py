"""A served version that generates text: which versions are language models, and what serving one
holds (its engine, tokenizer, chat template and defaults).

A version is a causal language model when its model is a Hugging Face ``PreTrainedModel`` that can
``generate`` and has an output head, or mlscale's ``TinyLM``; the signature (token ids in, per-position
logits out) picks the candidates before any model is built. Its context is the model's positions
(``max_position_embeddings``, ``n_positions``, or TinyLM's position table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlscale.registry import ModelVersion, Registry
from mlscale.registry.generation import GenerationConfig, read_generation
from mlscale.serve.generation.params import Defaults, ParamError
from mlscale.serve.generation.text import Tokenizer

if TYPE_CHECKING:
    import torch

    from mlscale.serve.generation.engine import EngineObserver, GenerationEngine
    from mlscale.serve.options import ServeOptions


# inputs a causal LM may have been trained with beside its token ids; the engine gives its own
POSITIONAL_INPUTS = ("position_ids", "attention_mask")


def lm_signature(signature: dict[str, Any]) -> bool:
    """Token ids in (integer, batch x sequence: the only input, or ``input_ids`` beside ``position_ids`` /
    ``attention_mask``, as a model trained on packed text takes them), logits per position out (batch x
    sequence x vocab)."""
    inputs, outputs = signature.get("inputs", []), signature.get("outputs", [])
    token_shaped = all(i["datatype"].startswith(("INT", "UINT")) and len(i["shape"]) == 2 for i in inputs)
    names = [i.get("name") for i in inputs]
    one_input = len(inputs) == 1 or ("input_ids" in names and all(
        name == "input_ids" or name in POSITIONAL_INPUTS for name in names))
    return bool(inputs) and token_shaped and one_input and len(outputs) == 1 and len(outputs[0]["shape"]) == 3


def is_causal_lm(model: torch.nn.Module) -> bool:
    from mlscale.tasks.tinylm import TinyLM

    if isinstance(model, TinyLM):
        return True
    can_generate = getattr(model, "can_generate", None)
    head = getattr(model, "get_output_embeddings", None)
    return callable(can_generate) and bool(can_generate()) and callable(head) and head() is not None


def max_context(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    positions = getattr(model, "pos_embeddings", None)  # TinyLM
    if positions is not None:
        return positions.num_embeddings
    raise ValueError(f"{type(model).__name__}: no context length found in its config")


def vocab_size(model: torch.nn.Module) -> int:
    """The rows of the token embedding: ids past it would fail the model call."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.tok_embeddings
    return embeddings.num_embeddings


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(int(v) for v in value)


def eos_ids(model: torch.nn.Module, generation: GenerationConfig, tokenizer: Any) -> tuple[int, ...]:
    """The end-of-sequence ids: the registered config's, else the model's own generation config's (what
    its ``generate`` stops at), else its config's; plus the tokenizer config's ``eos_token``."""
    ids = _ids(generation.config.get("eos_token_id"))
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        if not ids:
            ids = _ids(getattr(source, "eos_token_id", None))
    token = generation.token("eos_token")
    if token is not None and tokenizer is not None and tokenizer.token_to_id(token) is not None:
        ids = tuple(dict.fromkeys((*ids, tokenizer.token_to_id(token))))
    return ids


def defaults_of(config: dict[str, Any]) -> Defaults:
    stop = config.get("stop")
    return Defaults(max_tokens=config.get("max_new_tokens", config.get("max_tokens")),
                    temperature=float(config.get("temperature", 1.0)), top_p=float(config.get("top_p", 1.0)),
                    top_k=int(config.get("top_k", 0)), stop=(stop,) if isinstance(stop, str) else tuple(stop or ()))


@dataclass
class LoadedLM:
    """What loading found (off the event loop): the model, its tokenizer and config; the engine comes next."""

    model: torch.nn.Module
    generation: GenerationConfig
    tokenizer: Any


def load_lm(registry: Registry, version: ModelVersion, runtime: Any) -> LoadedLM | None:
    """The version's model as a language model, or None when it is not one. The torch runtime's model is
    shared; with another runtime the weights are loaded again, for the engine."""
    if not lm_signature(version.signature):
        return None
    if getattr(runtime, "kind", None) == "torch":
        model = runtime.model
    else:
        from mlscale.registry import load_torch_model

        model = load_torch_model(registry, version)
    if not is_causal_lm(model):
        return None
    generation = read_generation(registry, version)
    tokenizer = None
    if generation.tokenizer_json is not None:
        from tokenizers import Tokenizer as HFTokenizer

        tokenizer = HFTokenizer.from_str(generation.tokenizer_json)
    return LoadedLM(model.eval(), generation, tokenizer)


class LanguageModel:
    """One served language model: its engine (started in the server's event loop), its tokenizer (None:
    token ids in and out), its chat template (None: no chat route) and its defaults. ``observer``: where
    the engine reports its latencies and stats (the version's metrics)."""

    def __init__(self, name: str, loaded: LoadedLM, options: ServeOptions,
                 observer: EngineObserver | None = None) -> None:
        from mlscale.serve.generation.engine import GenerationEngine

        self.name = name
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        self.generation = loaded.generation
        self.defaults = defaults_of(loaded.generation.config)
        self.max_context = max_context(loaded.model)
        self.vocab_size = vocab_size(loaded.model)
        self.eos_token_ids = eos_ids(loaded.model, loaded.generation, loaded.tokenizer)
        self.engine: GenerationEngine = GenerationEngine(
            loaded.model, eos_token_ids=self.eos_token_ids, max_context=self.max_context,
            kv_cache_mb=options.kv_cache_mb, block_size=options.kv_block_size,
            max_batch_tokens=options.max_batch_tokens, max_running=options.max_sequences,
            max_waiting=options.queue_limit, prefix_caching=not options.no_prefix_caching,
            chunked_prefill=not options.no_chunked_prefill, observer=observer)
        self._template: Any = None

    @property
    def has_chat(self) -> bool:
        return self.tokenizer is not None and self.generation.chat_template is not None

    def encode(self, prompt: str | list[int], field: str = "prompt", special: bool = True) -> list[int]:
        """A prompt's token ids: a text through the tokenizer (``special``: with the tokens it adds around
        a text, as a BOS; not for a chat template's output, which writes its own)."""
        if isinstance(prompt, list):
            if max(prompt) >= self.vocab_size:
                raise ParamError(field, f"{field} holds token id {max(prompt)}: the vocabulary has {self.vocab_size}")
            return prompt
        if self.tokenizer is None:
            raise ParamError(field, f"model {self.name} has no tokenizer: send token ids (a list of integers)")
        ids = self.tokenizer.encode(prompt, add_special_tokens=special).ids
        if not ids:
            raise ParamError(field, f"{field} is empty once tokenized")
        return ids

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The messages rendered by the version's chat template, in a sandbox (a registry row is data)."""
        if not self.has_chat:
            raise ParamError("messages", f"model {self.name} has no chat template (register it with "
                             "--generation-config holding chat_template): use /v1/completions")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ParamError("messages", f"the chat template refused the messages: {message}")

            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = raise_exception
            self._template = environment.from_string(self.generation.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.generation.token("bos_token") or "",
                                     eos_token=self.generation.token("eos_token") or "")

    async def close(self) -> None:
        await self.engine.close(drain=True)
