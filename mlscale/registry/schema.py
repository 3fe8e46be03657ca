"""The registry's tables (SQLAlchemy Core) and its schema version, for migrations later."""

from __future__ import annotations

from sqlalchemy import Column, ForeignKeyConstraint, Integer, MetaData, String, Table, Text

SCHEMA_VERSION = 1
metadata = MetaData()
FOLDED_NAME_INDEX = "registered_models_name_folded"  # unique lower(name): created by Registry._migrate

schema_info = Table("schema_info", metadata, Column("version", Integer, nullable=False))

models = Table(
    "registered_models", metadata,
    Column("name", String(128), primary_key=True),
    Column("description", Text, nullable=False, default=""),
    Column("created_at", String(32), nullable=False),
    Column("updated_at", String(32), nullable=False),
)

versions = Table(
    "model_versions", metadata,
    Column("name", String(128), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("stage", String(16), nullable=False, default="None"),
    Column("description", Text, nullable=False, default=""),
    Column("created_at", String(32), nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("source_run", Text),
    Column("config", Text, nullable=False),  # JSON: the resolved run configuration
    Column("metrics", Text, nullable=False),  # JSON
    Column("data_fingerprint", String(80)),
    Column("code_version", Text, nullable=False),  # JSON
    Column("signature", Text, nullable=False),  # JSON
    ForeignKeyConstraint(["name"], ["registered_models.name"]),
)

artifacts = Table(
    "artifacts", metadata,
    Column("name", String(128), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("artifact", String(128), primary_key=True),
    Column("key", Text, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("size_bytes", Integer, nullable=False),
    Column("created_at", String(32), nullable=False),
    Column("info", Text, nullable=False, default="{}"),  # JSON: e.g. ONNX parity errors
    ForeignKeyConstraint(["name", "version"], ["model_versions.name", "model_versions.version"]),
)

aliases = Table(
    "aliases", metadata,
    Column("name", String(128), primary_key=True),
    Column("alias", String(64), primary_key=True),
    Column("version", Integer, nullable=False),
    ForeignKeyConstraint(["name", "version"], ["model_versions.name", "model_versions.version"]),
)

tags = Table(
    "tags", metadata,
    Column("name", String(128), primary_key=True),
    Column("version", Integer, primary_key=True),  # 0: a tag of the registered model itself
    Column("key", String(250), primary_key=True),
    Column("value", Text, nullable=False),
)

audit_log = Table(
    "audit_log", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False),
    Column("version", Integer),
    Column("action", String(32), nullable=False),
    Column("from_value", Text),
    Column("to_value", Text),
    Column("who", String(128), nullable=False),
    Column("at", String(32), nullable=False),
)
