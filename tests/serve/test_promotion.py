"""The promotion gate on plain reports, no server: the checks a Python pipeline gets from the library
are the ones `mlscale models compare` prints and exits by (tests/serve/test_rollout.py runs it live)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mlscale.errors import UsageError
from mlscale.serve.promotion import Thresholds, judge


def _row(version: str, role: str, success: int, failed: int = 0, p99_ms: float | None = 10.0, **extra: object):
    return {"version": version, "uri": f"models:/digits/{version}", "role": role, "aliases": [],
            "success": success, "failed": failed, "error_rate": failed / max(success + failed, 1),
            "p99_ms": p99_ms, **extra}


def _report(*rows: dict) -> dict:
    return {"versions": list(rows)}


def test_a_canary_with_enough_answers_and_no_regression_passes_and_too_few_fails():
    report = _report(_row("1", "primary", 2000), _row("2", "canary", 2000, p99_ms=12.5))
    verdict = judge(report, "digits", "2", Thresholds(), "http://server")
    assert verdict.passed and len(verdict.checks) == 3  # answers, p99, error rate
    too_few = judge(report, "digits", "2", Thresholds(min_requests=100_000), "http://server")
    assert not too_few.passed
    assert too_few.checks[0] == (False, "2000 answers to judge (at least 100000: --min-requests)")


def test_a_canary_s_errors_and_latency_fail_it_past_their_thresholds():
    report = _report(_row("1", "primary", 2000), _row("2", "canary", 1900, failed=100, p99_ms=40.0))
    failed = [what for ok, what in judge(report, "digits", "2", Thresholds(), "s").checks if not ok]
    assert [what.split(" ")[0] for what in failed] == ["p99", "error"]
    slow_few = _report(_row("1", "primary", 200), _row("2", "canary", 200, p99_ms=40.0))
    assert judge(slow_few, "digits", "2", Thresholds(), "s").passed  # a p99 of 200 answers is not judged


def test_a_shadow_is_judged_by_agreement_and_an_unknown_challenger_is_a_usage_error():
    shadow = {"compared": 500, "p99_ms": 11.0, "served_p99_ms": 10.0, "agreement": 0.98, "mean_abs_diff": 0.2}
    report = _report(_row("1", "primary", 500), _row("3", "shadow", 500, shadow=shadow))
    verdict = judge(report, "digits", "3", Thresholds(max_mean_abs_diff=0.1), "s")
    assert [ok for ok, _ in verdict.checks] == [True, True, False, False]  # answers, p99, agreement, difference
    with pytest.raises(UsageError, match="holds no canary or shadow '7' of digits"):
        judge(report, "digits", "7", Thresholds(), "s")


def test_the_command_s_defaults_are_the_library_s():
    from mlscale.cli import build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (models,) = [a for a in commands.choices["models"]._actions if isinstance(a, argparse._SubParsersAction)]
    defaults = {action.dest: action.default for action in models.choices["compare"]._actions}
    assert {field.name: defaults[field.name] for field in dataclasses.fields(Thresholds)} == \
        dataclasses.asdict(Thresholds())
