"""No secret leaves the process: URLs with credentials are redacted wherever they are printed, logged
or put in an error.

``redact_url`` keeps what a reader needs to tell one location from another (scheme, user, host, port,
path) and replaces the password with ``***``. It is robust to passwords that were not
percent-encoded: the credentials end at the *last* ``@``, and when the part before it is ambiguous
(holds ``/``, ``?``, ``#`` or another ``@``) everything between ``://`` and that ``@`` is replaced.
``redact_text`` applies it to every URL in a message and also removes a known password (and its
fragments around unencoded ``@``) that a library echoed on its own, outside a URL.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

MASK = "***"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
# credentials passed as query parameters (redis://host?password=..., ...?access_token=...)
_SECRET_PARAM = re.compile(r"(?i)([?&;](?:password|passwd|pwd|pass|secret|token|access_token|api_key|apikey|"
                           r"auth|sslpassword)=)([^&#;\s]*)")


def _split(url: str) -> tuple[str, str, str] | None:
    """(scheme://, userinfo, rest after the last '@') or None when ``url`` carries no userinfo."""
    match = _SCHEME.match(url)
    if match is None:
        return None
    head, body = match.group(0), url[match.end():]
    at = body.rfind("@")
    if at < 0:
        return None
    return head, body[:at], body[at + 1:]


def ambiguous_userinfo(url: str) -> bool:
    """Whether the text before the last '@' cannot be a well-formed ``user:password``: a character that
    has to be percent-encoded in it ('@', '/', '?', '#') was not."""
    parts = _split(_SECRET_PARAM.sub(lambda m: m.group(1) + MASK, url))
    return parts is not None and any(c in parts[1] for c in "@/?#")


def redact_url(url: str) -> str:
    """``url`` with its password (and any credential query parameter) replaced by ``***``."""
    url = _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, str(url))  # first: such a value may hold an '@'
    parts = _split(url)
    if parts is None:
        return url
    head, userinfo, rest = parts
    if any(c in userinfo for c in "@/?#"):  # not parsable: nothing of it is shown
        return f"{head}{MASK}@{rest}"
    user, colon, password = userinfo.partition(":")
    return f"{head}{user}:{MASK}@{rest}" if colon and password else url


def secrets_of(url: str) -> list[str]:
    """The secret parts of ``url`` as written: its password (everything after the user's ':' and before
    the last '@'; all of the credentials when they are ambiguous) and credential query parameters."""
    url = str(url)
    found = [m.group(2) for m in _SECRET_PARAM.finditer(url) if m.group(2)]
    parts = _split(_SECRET_PARAM.sub(lambda m: m.group(1) + MASK, url))
    if parts is not None:
        user, colon, password = parts[1].partition(":")
        if any(c in parts[1] for c in "@/?#"):
            found.append(parts[1] if any(c in user for c in "@/?#") or not colon else password)
        elif password:
            found.append(password)
    return found


def _fragments(secret: str) -> set[str]:
    """The secret as written, decoded and encoded, and its pieces between unencoded '@', '/', ':' (a
    parser that split it there echoes a piece of it: the part after an '@' as a host name)."""
    forms = {secret, unquote(secret), quote(secret, safe=""), quote(unquote(secret), safe="")}
    for form in list(forms):
        forms.update(re.split(r"[@/:?#]", form))
    return {form for form in forms if len(form) >= 2}


def redact_text(text: str, *urls: str | None) -> str:
    """``text`` with every URL in it redacted, and the secrets of each of ``urls`` removed wherever they
    (or a piece of them) still appear, for messages of libraries that echo parts of a URL."""
    text = _URL.sub(lambda m: redact_url(m.group(0)), str(text))
    pieces = {piece for url in urls if url for secret in secrets_of(url) for piece in _fragments(secret)}
    for piece in sorted(pieces, key=len, reverse=True):
        if piece != MASK:
            text = text.replace(piece, MASK)
    return text
