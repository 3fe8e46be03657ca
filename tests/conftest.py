"""Real services for the tests that need them: PostgreSQL (and MLflow, a package) are used for real.

Each test gets its own PostgreSQL schema. Without the service a test is skipped with its reason, so a
user's ``make test`` runs everywhere; in CI (``MLSCALE_REQUIRE_SERVICES=1``, set by ``.ci/run``) a
missing server or package fails the test instead, so nothing is silently left untested.

``make test`` runs the suite on 4 pytest-xdist workers, a module at a time each, the slowest modules
first (``SLOW_FIRST``); then the tests marked ``alone`` one at a time, with nothing beside them.
"""

from __future__ import annotations

import importlib
import os
import uuid
from pathlib import Path
from types import ModuleType
from urllib.parse import quote

import pytest

POSTGRES_URL = os.environ.get("MLSCALE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def services_required() -> bool:
    return os.environ.get("MLSCALE_REQUIRE_SERVICES") == "1"


def unavailable(reason: str) -> None:
    """Skip, or fail where the services are required."""
    if services_required():
        pytest.fail(f"{reason} (MLSCALE_REQUIRE_SERVICES=1: the test may not skip)", pytrace=False)
    pytest.skip(reason)


def require_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        unavailable(f"{name} is not installed ({exc})")
        raise  # unreachable: unavailable() raises


@pytest.fixture
def postgres_url():
    """A SQLAlchemy URL whose connections use a fresh schema of the PostgreSQL server; dropped after."""
    sqlalchemy = require_module("sqlalchemy")
    require_module("psycopg")
    engine = sqlalchemy.create_engine(POSTGRES_URL)
    schema = f"mlscale_test_{uuid.uuid4().hex[:12]}"
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    except sqlalchemy.exc.OperationalError as exc:
        engine.dispose()
        unavailable(f"no PostgreSQL server at {POSTGRES_URL.split('@')[-1]} ({str(exc.orig).strip().splitlines()[0]})")
    separator = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        engine.dispose()


# The slowest modules first (measured with `pytest --durations`), so that none of them starts last
# while the other workers sit idle; the rest keep their order. `make test` hands out whole modules
# (`--dist loadscope`: a module's tests share its module-scoped fixtures, built once) in this order
# (`--no-loadscope-reorder`). Only the order depends on this list, never a result. (Not `--dist loadgroup`
# with xdist_group marks: pytest 9.2 ignores the node ids xdist 3.8 rewrites for them, so the marks are
# silently dropped, pytest-dev/pytest-xdist#1386.)
SLOW_FIRST = (
    "tests/test_readme.py",
    "tests/test_demo.py",
    "tests/train/test_fault_tolerance.py",
    "tests/ui/test_browser.py",
    "tests/train/test_model_parallel.py",
    "tests/train/test_user_models.py",
    "tests/train/test_user_models_sharded.py",
    "tests/train/test_memory_plan.py",
    "tests/train/test_too_big.py",
    "tests/train/test_warm.py",
    "tests/serve/generation/test_endpoints.py",
    "tests/serve/generation/test_operations.py",
    "tests/serve/generation/test_engine.py",
    "tests/train/test_pipeline.py",
    "tests/test_declared_tasks.py",
    "tests/train/test_accumulation.py",
    "tests/train/test_resume.py",
    "tests/train/test_per_step.py",
    "tests/train/test_compression.py",
    "tests/train/test_training_options.py",
    "tests/deploy/test_local_job.py",
    "tests/data/test_parquet.py",
    "tests/data/test_pipeline.py",
    "tests/serve/test_interop.py",
    "tests/test_feature_guide.py",
    "tests/train/test_parameter_server.py",
    "tests/test_cli_errors.py",
    "tests/train/test_equivalence.py",
    "tests/train/test_elastic_resume.py",
    "tests/serve/test_hostile.py",
    "tests/serve/test_limits.py",
    "tests/serve/test_serving.py",
    "tests/deploy/test_rolling_update.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest modules first (above); a stable sort, so each module's tests keep their order."""

    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::")[0]
        return SLOW_FIRST.index(module) if module in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)


# -- every test in a working directory and an environment of its own --------------------------------------
# A newcomer runs `make demo` (which leaves ./mlscale-registry and ./runs in the checkout) and then
# `make test`: no test may read those, nor the caller's own settings. So the suite drops the variables a
# user may have set, runs in a folder of its own (a module's fixtures too), and each test in another;
# commands the tests start inherit that folder. The checkout's own ./mlscale-registry and ./runs are
# watched: a test that creates or changes them fails the session (``pytest_sessionfinish``).
CALLERS_SETTINGS = ("MLSCALE_REGISTRY", "MLSCALE_UI_TOKEN", "MLSCALE_ROUTE_SECRET", "MLSCALE_JOB_TOKEN",
                    "OTEL_EXPORTER_OTLP_ENDPOINT")
CHECKOUT = Path(__file__).resolve().parent.parent
WATCHED = (CHECKOUT / "mlscale-registry", CHECKOUT / "runs")


def _state(path: Path) -> tuple[bool, int, int]:
    """Whether ``path`` exists, and its and its newest child's modification times."""
    if not path.exists():
        return (False, 0, 0)
    children = [child.stat().st_mtime_ns for child in path.iterdir()] if path.is_dir() else []
    return (True, path.stat().st_mtime_ns, max(children, default=0))


def pytest_configure(config: pytest.Config) -> None:
    for name in CALLERS_SETTINGS:
        os.environ.pop(name, None)
    config.stash[_WATCHED] = {path: _state(path) for path in WATCHED}


_WATCHED = pytest.StashKey[dict]()


@pytest.fixture(scope="session", autouse=True)
def _suite_folder(tmp_path_factory: pytest.TempPathFactory):
    """The session's working directory: not the checkout (module fixtures run here)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("working-directory"))
        yield


@pytest.fixture(autouse=True)
def _test_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's working directory, its own."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    changed = [str(path) for path, before in session.config.stash[_WATCHED].items() if _state(path) != before]
    if changed:
        session.config.get_terminal_writer().line(
            f"FAILED: tests created or changed the checkout's {', '.join(changed)} (a test must use a folder "
            "of its own)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
