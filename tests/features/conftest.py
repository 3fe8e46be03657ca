"""A Redis key prefix of its own per test, on the machine's real Redis server (required in CI)."""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import require_module, unavailable

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_prefix():
    redis = require_module("redis")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        unavailable(f"no Redis server at {REDIS_URL} ({exc})")
    prefix = f"mlscale-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
