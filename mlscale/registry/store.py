"""The model registry: registered models, immutable numbered versions, stages, aliases, tags, lineage
and an append-only audit log, on SQLAlchemy (SQLite by default, PostgreSQL for teams).

Registration is all or nothing: artifacts are copied and hashed into a staging folder first, then one
transaction takes the next version number, moves the folder into place and inserts the rows; on any
failure the folder is removed, so a failed registration leaves no orphan version. On SQLite every
transaction starts with ``BEGIN IMMEDIATE`` (writers queue on the lock instead of failing); on other
databases the model's row is locked ``FOR UPDATE``; a duplicate version number from a race is
retried in any case.
"""

from __future__ import annotations

import getpass
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, event, func, insert, make_url, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError

from mlscale.common.redact import ambiguous_userinfo, redact_text, redact_url
from mlscale.errors import MlscaleError, UsageError, first_line
from mlscale.registry import schema
from mlscale.registry.artifacts import (
    OWNER_MARK,
    ArtifactExists,
    ArtifactStore,
    LocalArtifactStore,
    StoredArtifact,
    sha256_file,
)
from mlscale.registry.uri import ModelURI, canonical_stage, check_alias, check_name, parse_uri
from mlscale.rundir import RunDir

DEFAULT_LOCATION = "mlscale-registry"
WEIGHTS_ARTIFACT = "model.safetensors"
REGISTRY_ENV = "MLSCALE_REGISTRY"


class RegistryError(MlscaleError):
    """The registry could not do what was asked (exit 1)."""


class NotFound(UsageError):
    """No such model, version, alias or stage (exit 2)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _who() -> str:
    try:
        return os.environ.get("MLSCALE_USER") or getpass.getuser()
    except Exception:
        return "unknown"


@dataclass
class Artifact:
    name: str
    key: str
    sha256: str
    size_bytes: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelVersion:
    name: str
    version: int
    stage: str
    description: str
    created_at: str
    created_by: str
    source_run: str | None
    config: dict[str, Any]
    metrics: dict[str, Any]
    data_fingerprint: str | None
    code_version: dict[str, Any]
    signature: dict[str, Any]
    aliases: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, Artifact] = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    def source_run_state(self) -> str:
        """Whether the source run directory still holds the run this version was registered from: its
        final weights must be the registered ones (a later run written to the same directory changes
        them), so lineage cannot silently point at another run."""
        if not self.source_run:
            return "unknown"
        weights = RunDir(self.source_run).final_model_path
        if not weights.exists():
            return "gone"
        registered = self.artifacts.get(WEIGHTS_ARTIFACT)
        if registered is None or sha256_file(weights) != registered.sha256:
            return "changed: the directory now holds another run"
        return "verified"

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "artifacts"}
        data["uri"] = self.uri
        data["artifacts"] = {name: a.__dict__ for name, a in self.artifacts.items()}
        return data


def _sqlite_engine(url: str) -> Engine:
    engine = create_engine(url, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        dbapi_connection.execute("PRAGMA foreign_keys = ON")
        dbapi_connection.execute("PRAGMA busy_timeout = 60000")

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _same_or_refuse(uri: str, artifact: str, stored_sha256: str, path: Path, record: Artifact | None) -> Any:
    """``record`` when ``path`` holds the bytes already stored (adding them again is a no-op), else refuse."""
    if sha256_file(path) == stored_sha256:
        return record
    raise UsageError(f"{uri} already has {artifact} (sha256 {stored_sha256[:12]}...) with other content; "
                     "a version's files are write-once: register a new version instead")


def resolve_location(location: str | None, create: bool = True) -> tuple[str, Path]:
    """(database URL, artifact root) from ``--registry``, ``$MLSCALE_REGISTRY`` or the default folder.

    ``create=False`` (the read-only commands): a folder or SQLite file that does not exist is a
    ``NotFound``, never a new empty registry left behind by a typo."""
    location = location or os.environ.get(REGISTRY_ENV) or DEFAULT_LOCATION
    if "://" not in location:  # a folder: SQLite file and artifacts inside it
        folder = Path(location)
        _must_exist(folder / "registry.db", location, create)
        folder.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{folder / 'registry.db'}", folder / "artifacts"
    if location.startswith("sqlite:///"):
        db_path = Path(location.removeprefix("sqlite:///"))
        _must_exist(db_path, location, create)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        return location, db_path.parent / "artifacts"
    check_database_url(location)
    artifacts = os.environ.get("MLSCALE_ARTIFACTS", f"{DEFAULT_LOCATION}/artifacts")
    return location, Path(artifacts)


def check_database_url(url: str) -> None:
    """A database URL SQLAlchemy reads as it was meant: a password with an unencoded '@' (or ':' after
    one) would be split into a host name or port, and a driver's error would then show part of it.
    Refused with one line (exit 2) that shows no part of the credentials."""
    shown = redact_url(url)
    how = ("percent-encode the user and password (python3 -c 'import urllib.parse, getpass; "
           "print(urllib.parse.quote(getpass.getpass(), safe=\"\"))')")
    if ambiguous_userinfo(url):
        raise UsageError(f"bad value registry={shown!r}: an '@' (or '/', '?', '#') in the credentials; {how}")
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        raise UsageError(f"bad value registry={shown!r}: not a folder, sqlite:///FILE or database URL; if it has a "
                         f"password, {how}") from None
    if any("@" in str(part or "") for part in (parsed.host, parsed.port, parsed.database)):
        raise UsageError(f"bad value registry={shown!r}: an '@' after the credentials; {how}")


def _identity(url: str) -> str:
    """The database this registry keeps its rows in, without a password: what owns its artifact folders."""
    if url.startswith("sqlite:///"):
        return f"sqlite:///{Path(url.removeprefix('sqlite:///')).resolve()}"
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("@")[-1]


def _must_exist(db_path: Path, location: str, create: bool) -> None:
    if not create and not db_path.exists():
        raise NotFound(f"no registry at {location!r} (nothing was registered there; check --registry or "
                       f"${REGISTRY_ENV}; `mlscale models register` creates one)")


class Registry:
    def __init__(self, location: str | None = None, artifacts: ArtifactStore | None = None, *,
                 create: bool = True) -> None:
        """``create=False``: open an existing registry only (what read-only commands use)."""
        try:
            url, artifact_root = resolve_location(location, create)
        except OSError as exc:
            raise RegistryError(redact_text(f"cannot open the registry at {location}: {exc.strerror}: {exc.filename}",
                                            location)) from None
        self.url = url
        self.identity = _identity(url)
        self.artifacts: ArtifactStore = artifacts or LocalArtifactStore(artifact_root)
        try:
            self.engine = _sqlite_engine(url) if url.startswith("sqlite") else create_engine(url)
            self._migrate()
        except OperationalError as exc:
            raise RegistryError(self._redact(f"cannot reach the registry database {self._safe_url()}: "
                                             f"{first_line(exc.orig)}")) from None
        except (SQLAlchemyError, ImportError, ValueError) as exc:
            raise RegistryError(self._redact(f"cannot open the registry at {self._safe_url()}: "
                                             f"{first_line(exc)}")) from None

    def _safe_url(self) -> str:
        """The registry's URL without its password: what messages name."""
        return redact_url(self.url)

    def _redact(self, message: str) -> str:
        """A message with no part of the registry's password, whatever a driver echoed of it."""
        return redact_text(message, self.url)

    def _migrate(self) -> None:
        schema.metadata.create_all(self.engine)
        self._fold_names()
        with self._tx() as conn:
            found = conn.execute(select(schema.schema_info.c.version)).scalar()
            if found is None:
                conn.execute(insert(schema.schema_info).values(version=schema.SCHEMA_VERSION))
            elif found > schema.SCHEMA_VERSION:
                raise RegistryError(f"the registry's schema v{found} is newer than this mlscale understands "
                                    f"(v{schema.SCHEMA_VERSION}); upgrade mlscale")

    def _fold_names(self) -> None:
        """A unique index on the lower-cased model name: two registrations of names that differ only by
        case, racing on a database that locks per row, cannot both insert. Not made where a registry from
        before this check holds such names already."""
        exists = {"sqlite": "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = :name",
                  "postgresql": "SELECT 1 FROM pg_indexes WHERE indexname = :name AND schemaname = current_schema()"}
        dialect = self.engine.dialect.name
        try:
            with self.engine.begin() as conn:  # looked up first: creating takes a lock even when it exists
                if dialect in exists and conn.execute(text(exists[dialect]),
                                                      {"name": schema.FOLDED_NAME_INDEX}).first() is not None:
                    return
                conn.exec_driver_sql(f"CREATE UNIQUE INDEX IF NOT EXISTS {schema.FOLDED_NAME_INDEX} "
                                     f"ON {schema.models.name} (lower(name))")
        except (IntegrityError, ProgrammingError):
            pass  # names differing by case exist (an older registry), a concurrent creator won, or a database
            # without such indexes: the check in the transaction still refuses new ones

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except OperationalError as exc:
            raise RegistryError(self._redact(f"registry database error at {self._safe_url()}: "
                                             f"{first_line(exc.orig)}")) from None

    # -- registering ---------------------------------------------------------------------------
    def create_version(self, name: str, files: dict[str, Path], *, config: dict[str, Any],
                       metrics: dict[str, Any], signature: dict[str, Any], source_run: str | None = None,
                       data_fingerprint: str | None = None, code_version: dict[str, Any] | None = None,
                       description: str = "", tags: dict[str, str] | None = None) -> ModelVersion:
        """Register ``files`` (artifact name -> local path) as the next version of ``name``."""
        check_name(name)
        with self._tx() as conn:  # early, before any file is copied; checked again in the transaction below
            self._check_case(conn, name)
        staging = f"{name}/.staging-{uuid.uuid4().hex}"
        self._mark_owner(staging)
        stored = {artifact: self.artifacts.put(f"{staging}/{artifact}", path) for artifact, path in files.items()}
        final_prefix: str | None = None
        try:
            for attempt in range(20):
                try:
                    with self._tx() as conn:
                        version = self._next_version(conn, name)
                        self._check_folder_free(conn, name, version)
                        self.artifacts.move_prefix(staging, f"{name}/{version}")
                        final_prefix = f"{name}/{version}"  # ours only once moved: never delete another's
                        self._insert_version(conn, name, version, stored, final_prefix, config=config,
                                             metrics=metrics, signature=signature, source_run=source_run,
                                             data_fingerprint=data_fingerprint, code_version=code_version or {},
                                             description=description, tags=tags or {})
                    return self.get_version(name, version)
                except IntegrityError:
                    if final_prefix is not None:
                        self.artifacts.move_prefix(final_prefix, staging)
                        final_prefix = None
                    time.sleep(0.01 * (attempt + 1))
            raise RegistryError(f"could not register {name}: too many concurrent registrations")
        except BaseException:
            self.artifacts.delete_prefix(staging)
            if final_prefix is not None and not self._folder_committed(name, int(final_prefix.rsplit("/", 1)[1])):
                self.artifacts.delete_prefix(final_prefix)
            raise

    def _check_case(self, conn: Connection, name: str) -> None:
        """A new name that differs from an existing model's only by case is refused: on a case-insensitive
        file system (macOS, Windows) both would have one artifact folder, and registering one would
        replace the other's files. (A registry from before this check may hold both: it goes on working.)"""
        table = schema.models
        # one statement, one snapshot: two queries would let a concurrent registration of this very name
        # commit between them, and the name would then look like its own case variant
        names = conn.execute(select(table.c.name).where(func.lower(table.c.name) == name.lower())).scalars().all()
        other = next((found for found in names if found != name), None)
        if other is not None and name not in names:
            raise UsageError(f"bad value name={name!r}: model {other!r} exists, and names that differ only by case "
                             f"would share its artifact folder on a case-insensitive file system; use {other!r}")

    def _committed_case_variant(self, conn: Connection, name: str, version: int) -> str | None:
        """The URI of a committed version whose artifact folder is ``name/version`` where case is not told
        apart, or None."""
        table = schema.versions
        found = conn.execute(select(table.c.name).where(
            (func.lower(table.c.name) == name.lower()) & (table.c.version == version))).scalar()
        return None if found is None else f"models:/{found}/{version}"

    def _check_folder_free(self, conn: Connection, name: str, version: int) -> None:
        """Moving a staged folder into ``name/version`` replaces a leftover of this registry there; it must
        never replace the folder of a committed version (another name that differs only by case, on a
        case-insensitive file system)."""
        committed = self._committed_case_variant(conn, name, version)
        if committed is not None:
            raise RegistryError(f"cannot register {name} version {version}: its artifact folder is that of "
                                f"{committed} where case is not told apart; nothing was replaced (register under "
                                "the existing model's name)")

    def _folder_committed(self, name: str, version: int) -> bool:
        """Whether ``name/version`` is the folder of a committed version (of this name, or one differing by
        case): then it is never removed."""
        with self._tx() as conn:
            return self._committed_case_variant(conn, name, version) is not None

    def _mark_owner(self, prefix: str) -> None:
        """Mark a version's folder with this registry's identity, so that a leftover of this registry (a
        registration that died between moving its folder and committing) can be told apart from the
        folder of another registry sharing the artifact store, which must never be replaced."""
        with tempfile.TemporaryDirectory(prefix="mlscale-owner-") as tmp:
            mark = Path(tmp) / OWNER_MARK
            mark.write_text(self.identity + "\n")
            self.artifacts.put(f"{prefix}/{OWNER_MARK}", mark)

    def _next_version(self, conn: Connection, name: str) -> int:
        now = _now()
        exists = conn.execute(select(schema.models.c.name).where(schema.models.c.name == name)
                              .with_for_update()).scalar()
        if exists is None:
            self._check_case(conn, name)  # in the transaction: two registrations racing are told apart
            conn.execute(insert(schema.models).values(name=name, description="", created_at=now, updated_at=now))
            self._audit(conn, name, None, "create_model", None, name)
        latest = conn.execute(select(func.max(schema.versions.c.version))
                              .where(schema.versions.c.name == name)).scalar()
        return (latest or 0) + 1

    def _insert_version(self, conn: Connection, name: str, version: int, stored: dict[str, Any], prefix: str,
                        **fields: Any) -> None:
        now = _now()
        conn.execute(insert(schema.versions).values(
            name=name, version=version, stage="None", description=fields["description"], created_at=now,
            created_by=_who(), source_run=fields["source_run"], config=json.dumps(fields["config"]),
            metrics=json.dumps(fields["metrics"]), data_fingerprint=fields["data_fingerprint"],
            code_version=json.dumps(fields["code_version"]), signature=json.dumps(fields["signature"])))
        for artifact, info in stored.items():
            conn.execute(insert(schema.artifacts).values(
                name=name, version=version, artifact=artifact, key=f"{prefix}/{artifact}", sha256=info.sha256,
                size_bytes=info.size_bytes, created_at=now, info="{}"))
        for key, value in fields["tags"].items():
            conn.execute(insert(schema.tags).values(name=name, version=version, key=key, value=str(value)))
        conn.execute(update(schema.models).where(schema.models.c.name == name).values(updated_at=now))
        self._audit(conn, name, version, "create_version", None, str(version))

    def add_artifact(self, name: str, version: int, artifact: str, path: Path, info: dict[str, Any]) -> Artifact:
        """Attach a derived artifact (an ONNX export, say) to an existing version.

        A version's files are write-once: adding the same bytes again is a no-op that returns the
        stored record; other bytes under a name the version already has are refused."""
        uri = f"models:/{name}/{version}"
        existing = self.get_version(name, version).artifacts.get(artifact)
        if existing is not None:
            return _same_or_refuse(uri, existing.name, existing.sha256, path, existing)
        key = f"{name}/{version}/{artifact}"
        try:
            stored = self.artifacts.put(key, path)
        except ArtifactExists:  # a file without a row: a concurrent add, or one that died before its row
            stored = StoredArtifact(key, self.artifacts.digest(key), path.stat().st_size)
            _same_or_refuse(uri, artifact, stored.sha256, path, None)
        try:
            with self._tx() as conn:
                conn.execute(insert(schema.artifacts).values(
                    name=name, version=version, artifact=artifact, key=key, sha256=stored.sha256,
                    size_bytes=stored.size_bytes, created_at=_now(), info=json.dumps(info)))
                self._audit(conn, name, version, "add_artifact", None, artifact)
        except IntegrityError:  # a concurrent add of the same file won the race for the row
            won = self.get_version(name, version).artifacts[artifact]
            return _same_or_refuse(uri, artifact, won.sha256, path, won)
        return Artifact(artifact, key, stored.sha256, stored.size_bytes, info)

    # -- changing ------------------------------------------------------------------------------
    def set_stage(self, name: str, version: int, stage: str, *, archive_existing: bool = False) -> ModelVersion:
        stage = canonical_stage(stage)
        with self._tx() as conn:
            current = self._stage_of(conn, name, version)
            if archive_existing and stage in ("Staging", "Production"):
                others = conn.execute(select(schema.versions.c.version).where(
                    (schema.versions.c.name == name) & (schema.versions.c.stage == stage)
                    & (schema.versions.c.version != version))).scalars().all()
                for other in others:
                    self._write_stage(conn, name, other, stage, "Archived")
            if current != stage:
                self._write_stage(conn, name, version, current, stage)
        return self.get_version(name, version)

    def _write_stage(self, conn: Connection, name: str, version: int, old: str, new: str) -> None:
        table = schema.versions
        conn.execute(update(table).where((table.c.name == name) & (table.c.version == version)).values(stage=new))
        self._audit(conn, name, version, "stage", old, new)

    def _stage_of(self, conn: Connection, name: str, version: int) -> str:
        table = schema.versions
        stage = conn.execute(select(table.c.stage).where((table.c.name == name) & (table.c.version == version))
                             ).scalar()
        if stage is None:
            self._raise_missing(conn, name, f"version {version}")
        return stage

    def set_alias(self, name: str, version: int, alias: str) -> ModelVersion:
        check_alias(alias)
        with self._tx() as conn:
            self._stage_of(conn, name, version)
            table = schema.aliases
            where = (table.c.name == name) & (table.c.alias == alias)
            old = conn.execute(select(table.c.version).where(where)).scalar()
            conn.execute(table.delete().where(where))
            conn.execute(insert(table).values(name=name, alias=alias, version=version))
            self._audit(conn, name, version, f"alias:{alias}", None if old is None else str(old), str(version))
        return self.get_version(name, version)

    def delete_alias(self, name: str, alias: str) -> None:
        with self._tx() as conn:
            table = schema.aliases
            where = (table.c.name == name) & (table.c.alias == alias)
            old = conn.execute(select(table.c.version).where(where)).scalar()
            if old is None:
                self._raise_missing(conn, name, f"alias {alias!r}")
            conn.execute(table.delete().where(where))
            self._audit(conn, name, old, f"alias:{alias}", str(old), None)

    def set_tag(self, name: str, version: int | None, key: str, value: str) -> None:
        with self._tx() as conn:
            if version:
                self._stage_of(conn, name, version)
            table = schema.tags
            where = (table.c.name == name) & (table.c.version == (version or 0)) & (table.c.key == key)
            conn.execute(table.delete().where(where))
            conn.execute(insert(table).values(name=name, version=version or 0, key=key, value=value))
            self._audit(conn, name, version, f"tag:{key}", None, value)

    def _audit(self, conn: Connection, name: str, version: int | None, action: str, old: str | None,
               new: str | None) -> None:
        conn.execute(insert(schema.audit_log).values(name=name, version=version, action=action, from_value=old,
                                                     to_value=new, who=_who(), at=_now()))

    # -- reading -------------------------------------------------------------------------------
    def _raise_missing(self, conn: Connection, name: str, what: str) -> None:
        if conn.execute(select(schema.models.c.name).where(schema.models.c.name == name)).scalar() is None:
            raise NotFound(f"no registered model named {name!r} in {self._safe_url()}")
        raise NotFound(f"model {name!r} has no {what}")

    def get_version(self, name: str, version: int) -> ModelVersion:
        with self._tx() as conn:
            table = schema.versions
            row = conn.execute(select(table).where((table.c.name == name) & (table.c.version == version))
                               ).mappings().first()
            if row is None:
                self._raise_missing(conn, name, f"version {version}")
            return self._load(conn, row)

    def _load(self, conn: Connection, row: Any) -> ModelVersion:
        name, version = row["name"], row["version"]
        alias_rows = conn.execute(select(schema.aliases.c.alias).where(
            (schema.aliases.c.name == name) & (schema.aliases.c.version == version))).scalars().all()
        tag_rows = conn.execute(select(schema.tags.c.key, schema.tags.c.value).where(
            (schema.tags.c.name == name) & (schema.tags.c.version == version))).all()
        artifact_rows = conn.execute(select(schema.artifacts).where(
            (schema.artifacts.c.name == name) & (schema.artifacts.c.version == version))).mappings().all()
        return ModelVersion(
            name=name, version=version, stage=row["stage"], description=row["description"],
            created_at=row["created_at"], created_by=row["created_by"], source_run=row["source_run"],
            config=json.loads(row["config"]), metrics=json.loads(row["metrics"]),
            data_fingerprint=row["data_fingerprint"], code_version=json.loads(row["code_version"]),
            signature=json.loads(row["signature"]), aliases=sorted(alias_rows), tags=dict(tag_rows),
            artifacts={a["artifact"]: Artifact(a["artifact"], a["key"], a["sha256"], a["size_bytes"],
                                               json.loads(a["info"])) for a in artifact_rows})

    def resolve(self, uri: str | ModelURI) -> ModelVersion:
        """The version a URI points to now (an alias or stage may move later)."""
        parsed = parse_uri(uri) if isinstance(uri, str) else uri
        if parsed.version is not None:
            return self.get_version(parsed.name, parsed.version)
        with self._tx() as conn:
            if parsed.alias is not None:
                table = schema.aliases
                version = conn.execute(select(table.c.version).where(
                    (table.c.name == parsed.name) & (table.c.alias == parsed.alias))).scalar()
                what = f"alias {parsed.alias!r}"
            else:
                table = schema.versions
                version = conn.execute(select(func.max(table.c.version)).where(
                    (table.c.name == parsed.name) & (table.c.stage == parsed.stage))).scalar()
                what = f"version in stage {parsed.stage}"
            if version is None:
                self._raise_missing(conn, parsed.name, what)
        return self.get_version(parsed.name, version)

    def model_tags(self, name: str) -> dict[str, str]:
        """The tags set on the model itself (``set_tag`` with no version), not on one of its versions."""
        with self._tx() as conn:
            table = schema.tags
            rows = conn.execute(select(table.c.key, table.c.value).where(
                (table.c.name == name) & (table.c.version == 0))).all()
            if not rows:
                self._raise_missing_model(conn, name)
            return dict(rows)

    def _raise_missing_model(self, conn: Connection, name: str) -> None:
        if conn.execute(select(schema.models.c.name).where(schema.models.c.name == name)).scalar() is None:
            raise NotFound(f"no registered model named {name!r} in {self._safe_url()}")

    def versions(self, name: str) -> list[ModelVersion]:
        with self._tx() as conn:
            rows = conn.execute(select(schema.versions).where(schema.versions.c.name == name)
                                .order_by(schema.versions.c.version)).mappings().all()
            if not rows:
                self._raise_missing(conn, name, "versions")
            return [self._load(conn, row) for row in rows]

    def list_models(self) -> list[dict[str, Any]]:
        with self._tx() as conn:
            models = conn.execute(select(schema.models).order_by(schema.models.c.name)).mappings().all()
            result = []
            for model in models:
                rows = conn.execute(select(schema.versions.c.version, schema.versions.c.stage).where(
                    schema.versions.c.name == model["name"])).all()
                aliases = conn.execute(select(schema.aliases.c.alias, schema.aliases.c.version).where(
                    schema.aliases.c.name == model["name"])).all()
                result.append({
                    "name": model["name"], "description": model["description"],
                    "latest_version": max((r[0] for r in rows), default=None),
                    "stages": {r[1]: r[0] for r in sorted(rows) if r[1] != "None"},
                    "aliases": {a: v for a, v in aliases}, "updated_at": model["updated_at"],
                })
            return result

    def history(self, name: str) -> list[dict[str, Any]]:
        with self._tx() as conn:
            rows = conn.execute(select(schema.audit_log).where(schema.audit_log.c.name == name)
                                .order_by(schema.audit_log.c.id)).mappings().all()
            if not rows:
                self._raise_missing(conn, name, "history")
            return [dict(row) for row in rows]

    def _record(self, version: ModelVersion, artifact: str) -> Artifact:
        if artifact not in version.artifacts:
            raise NotFound(f"{version.uri} has no artifact {artifact!r} (has: {', '.join(version.artifacts)})")
        return version.artifacts[artifact]

    def artifact_bytes(self, version: ModelVersion, artifact: str) -> bytes:
        """The artifact's bytes, verified against its registered SHA-256: what to load (the bytes hashed
        are the bytes loaded; a file replaced after the check is never read)."""
        record = self._record(version, artifact)
        return self.artifacts.fetch_bytes(record.key, record.sha256)

    def artifact_path(self, version: ModelVersion, artifact: str) -> Path:
        """A local path to the artifact, verified against its registered SHA-256 when this returns. Opening
        it again may read other bytes (a file replaced since): load with ``artifact_bytes`` instead."""
        record = self._record(version, artifact)
        return self.artifacts.fetch(record.key, record.sha256)
