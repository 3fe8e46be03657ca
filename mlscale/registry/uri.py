"""Model URIs in MLflow's form: ``models:/NAME/VERSION``, ``models:/NAME@ALIAS``, ``models:/NAME/STAGE``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlscale.errors import UsageError

STAGES = ("None", "Staging", "Production", "Archived")
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}"
NAME_RE = re.compile(rf"^{_NAME}$")
ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]{0,63}$")
_URI = re.compile(rf"^models:/(?P<name>{_NAME})(?:/(?P<ref>[^/@]+)|@(?P<alias>[^/@]+))$")


def canonical_stage(text: str) -> str:
    for stage in STAGES:
        if stage.lower() == text.lower():
            return stage
    raise UsageError(f"bad value stage={text!r}: must be one of {', '.join(STAGES)}")


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise UsageError(f"bad value name={name!r}: use letters, digits, '_', '-' and '.', starting with a letter "
                         "or digit (at most 128)")
    return name


def check_alias(alias: str) -> str:
    if not ALIAS_RE.fullmatch(alias) or alias.isdigit():
        raise UsageError(f"bad value alias={alias!r}: use letters, digits, '_' and '-', starting with a letter")
    return alias


@dataclass(frozen=True)
class ModelURI:
    """A parsed model URI: exactly one of ``version``, ``alias`` or ``stage`` is set."""

    name: str
    version: int | None = None
    alias: str | None = None
    stage: str | None = None

    def __str__(self) -> str:
        if self.version is not None:
            return f"models:/{self.name}/{self.version}"
        if self.alias is not None:
            return f"models:/{self.name}@{self.alias}"
        return f"models:/{self.name}/{self.stage}"


def parse_uri(text: str) -> ModelURI:
    match = _URI.fullmatch(text)
    if not match:
        raise UsageError(f"bad model URI {text!r}: expected models:/NAME/VERSION, models:/NAME@ALIAS or "
                         "models:/NAME/STAGE")
    name, ref, alias = match["name"], match["ref"], match["alias"]
    if alias is not None:
        return ModelURI(name, alias=check_alias(alias))
    if ref.isdigit():
        if int(ref) < 1:
            raise UsageError(f"bad model URI {text!r}: versions start at 1")
        return ModelURI(name, version=int(ref))
    return ModelURI(name, stage=canonical_stage(ref))
