"""What a language model's version records to generate text: its tokenizer (a Hugging Face ``tokenizers``
file, ``tokenizer.json``) and its generation config (``generation_config.json``: sampling defaults, end
ids, and a chat template if it has one; a ``tokenizer_config.json`` carries its chat template and special
tokens the same way). Both are artifacts, checked and bounded in bytes when registered, verified like the
weights when served; both are data: a chat template is rendered in a sandbox, never run as code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlscale.errors import UsageError
from mlscale.registry.store import ModelVersion, Registry

TOKENIZER_ARTIFACT = "tokenizer.json"
GENERATION_ARTIFACT = "generation_config.json"
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # the largest tokenizer.json on the Hub are ~20 MB
MAX_CONFIG_BYTES = 1024 * 1024  # a chat template and a few numbers
# The keys read from a generation config (Hugging Face's names, and a tokenizer config's); others are kept
# in the file but not used.
KEYS = {"max_new_tokens": int, "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
        "top_k": int, "eos_token_id": (int, list), "stop": (str, list), "chat_template": (str, list),
        "bos_token": (str, dict), "eos_token": (str, dict)}


@dataclass(frozen=True)
class GenerationConfig:
    """A version's generation artifacts, read and checked: the tokenizer's JSON text (None: token ids in
    and out) and the config's known keys."""

    tokenizer_json: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # a tokenizer config's named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def token(self, name: str) -> str | None:
        """``bos_token`` / ``eos_token`` as a string (a tokenizer config may give ``{"content": ...}``)."""
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    def summary(self) -> str:
        """One line for ``mlscale models show``."""
        parts = ["tokenizer" if self.tokenizer_json is not None else "token ids (no tokenizer)"]
        if self.chat_template:
            parts.append("chat template")
        parts += [f"{key} {self.config[key]}" for key in ("max_new_tokens", "max_tokens", "temperature", "top_p",
                                                          "top_k", "eos_token_id", "stop") if key in self.config]
        return ", ".join(parts)


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    if not path.is_file():
        raise UsageError(f"bad value {what}={str(path)!r}: no such file")
    size = path.stat().st_size
    if size > limit:
        raise UsageError(f"bad value {what}={str(path)!r}: {size:,} bytes, over the {limit:,}-byte limit")
    return path.read_bytes()


def check_config(data: bytes, where: str) -> dict[str, Any]:
    """A generation config's JSON object, its known keys of the right types (a ``UsageError`` otherwise)."""
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"bad value {where}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"bad value {where}: a JSON object is expected")
    for key, kinds in KEYS.items():
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise UsageError(f"bad value {where}: {key} is {value!r}")
    return config


def check_tokenizer(data: bytes, where: str) -> None:
    """The file must load as a ``tokenizers.Tokenizer`` (what the server will load)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("registering a tokenizer needs the tokenizers package: pip install 'mlscale[generate]'") \
            from None
    try:
        Tokenizer.from_str(data.decode())
    except Exception as exc:
        raise UsageError(f"bad value {where}: not a tokenizers file ({str(exc).splitlines()[0]})") from None


def generation_files(tokenizer: str | Path | None = None, generation_config: str | Path | None = None
                     ) -> dict[str, Path]:
    """The artifacts to register beside the weights (artifact name -> path), each checked and bounded."""
    files = {}
    if tokenizer is not None:
        path = Path(tokenizer)
        check_tokenizer(_read_bounded(path, MAX_TOKENIZER_BYTES, "tokenizer"), f"tokenizer={str(path)!r}")
        files[TOKENIZER_ARTIFACT] = path
    if generation_config is not None:
        path = Path(generation_config)
        check_config(_read_bounded(path, MAX_CONFIG_BYTES, "generation-config"), f"generation-config={str(path)!r}")
        files[GENERATION_ARTIFACT] = path
    return files


def read_generation(registry: Registry, version: ModelVersion) -> GenerationConfig:
    """A version's generation artifacts, verified against their registered SHA-256 (none: the defaults)."""
    artifacts = version.artifacts
    tokenizer = (registry.artifact_bytes(version, TOKENIZER_ARTIFACT).decode()
                 if TOKENIZER_ARTIFACT in artifacts else None)
    config = {}
    if GENERATION_ARTIFACT in artifacts:
        data = registry.artifact_bytes(version, GENERATION_ARTIFACT)
        config = check_config(data, f"{version.uri} {GENERATION_ARTIFACT}")
    return GenerationConfig(tokenizer, config)
