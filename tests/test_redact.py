"""No secret is printed: URLs lose their password wherever they are shown, also when it was not
percent-encoded, and a library's message loses any piece of it that it echoed."""

from __future__ import annotations

import pytest

from mlscale.cli import main
from mlscale.common.redact import redact_text, redact_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:PASSWORD@host:6379/0", "redis://:***@host:6379/0"),
    ("postgresql+psycopg://user:PASSWORD@db.example:5432/reg", "postgresql+psycopg://user:***@db.example:5432/reg"),
    ("postgresql://user:PASS@WORD@db/reg", "postgresql://***@db/reg"),  # unencoded '@': all of it hidden
    ("postgresql://user:PA/SS@db/reg", "postgresql://***@db/reg"),
    ("rediss://host:6380/0?password=PASS@WORD&db=1", "rediss://host:6380/0?password=***&db=1"),
    ("http://user@host:5000", "http://user@host:5000"),  # no password: nothing to hide
    ("sqlite:///tmp/reg.db", "sqlite:///tmp/reg.db"),
    ("/a/folder@2", "/a/folder@2"),
])
def test_a_url_is_shown_without_its_password(url, shown):
    assert redact_url(url) == shown


def test_a_message_loses_every_piece_of_the_password_a_library_echoed():
    url = "postgresql+psycopg://user:PASS@WORD@db.example/reg"
    message = f"connecting to {url} failed: could not translate host name \"WORD@db.example\""
    redacted = redact_text(message, url)
    assert "PASS" not in redacted and "WORD" not in redacted and "db.example" in redacted


@pytest.mark.parametrize("args", [["models", "list", "--regsitry", "postgresql://u:PASSWORD@h/db"],
                                  ["serve", "models:/m/1", "--port", "redis://:PASSWORD@h"]])
def test_an_argument_error_is_printed_without_the_password_it_quotes(args, capsys):
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "***" in err and "PASSWORD" not in err
