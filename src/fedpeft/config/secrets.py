"""Secrets in a config: which values are credentials, and the config as fedpeft writes or
sends it, without them.

A value is secret when its field is

- a URI (a field named ``uri``, ``url`` or ending in ``_uri`` / ``_url``, such as
  ``log.mlflow_uri``): its userinfo's password (``https://user:TOKEN@host``), a userinfo
  alone (``https://TOKEN@host``) and the values of its query parameters named like a
  credential (``?token=...``, ``?password=...``);
- a field named like a credential (``token``, ``password``, ``secret``, ``api_key``, ...)
  or declared one with ``Field(..., json_schema_extra={"secret": True})``: its whole value.

:func:`public_config` (and :func:`fedpeft.config.dump_config`, built on it) is the config
with each of them replaced by :data:`REDACTED`, ``https://user:***@host``: what every
writer uses (``config.yaml``, an export's ``fedpeft_model.json``, the trackers, the run
config a deployment sends to its nodes). A config read back from such a file holds
``***`` where the secret was: that means "take it from the environment", which is what
the code that needs the credential does (:func:`from_environment`), refusing in one line
naming the key and the variable when the environment lacks it. :func:`scrub` takes
credentials out of free text: log lines, error messages.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from pydantic import BaseModel

from fedpeft.config.common import ConfigError

#: what a secret is replaced by
REDACTED = "***"

#: field (and environment variable) names that hold a credential: ``hub_token``, ``api_key``, ...
SECRET_NAME = re.compile(
    r"(^|_)(token|password|passwd|secret|api_?key|access_?key|credentials?)($|_)", re.IGNORECASE
)

#: query parameters of a URI that carry a credential: ``token``, ``access_token``, ``sig``, ...
SECRET_PARAM = re.compile(r"token|passw|pwd|secret|key|sig|auth|credential", re.IGNORECASE)

_URI_IN_TEXT = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^\s/?#@'\"<>]+)@")
_PARAM_IN_TEXT = re.compile(r"([?&;]([^=&\s'\"#]+)=)([^&\s'\"#]*)")


def is_uri_field(name: str) -> bool:
    return name in ("uri", "url") or name.endswith(("_uri", "_url"))


def is_secret_field(name: str, declared: Any = None) -> bool:
    """Whether a field's whole value is a credential: named like one, or ``declared`` (its
    ``json_schema_extra``) says ``secret: true``."""
    return (isinstance(declared, dict) and bool(declared.get("secret"))) or bool(SECRET_NAME.search(name))


def secret_fields(model: BaseModel) -> Iterator[tuple[list[str | int], str, Any]]:
    """``(path, kind, value)`` for every secret field of ``model`` that is set: ``path`` the
    keys down to it (``["log", "mlflow_uri"]``), ``kind`` ``"uri"`` (only its credentials are
    secret) or ``"secret"`` (all of it)."""
    yield from _walk(model, [])


def _walk(model: BaseModel, path: list[str | int]) -> Iterator[tuple[list[str | int], str, Any]]:
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        here = [*path, name]
        if isinstance(value, BaseModel):
            yield from _walk(value, here)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _walk(item, [*here, i])
        elif not isinstance(value, str) or not value:  # a flag or a number is no credential
            continue
        elif is_secret_field(name, info.json_schema_extra):
            yield here, "secret", value
        elif is_uri_field(name):
            yield here, "uri", value


#: what a change returns to remove a field from a dump
_DROP = object()


def _apply(data: Any, model: BaseModel, change: Callable[[str, Any], Any]) -> Any:
    """``data`` (``model`` dumped as JSON) with each secret field's value replaced by
    ``change(kind, value)``; a field the dump left out (``exclude_defaults``) stays out,
    and one ``change`` returns :data:`_DROP` for is removed."""
    for path, kind, _ in secret_fields(model):
        node = data
        for key in path[:-1]:
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                node = None
                break
        leaf = path[-1]
        if not isinstance(node, dict) or leaf not in node:
            continue
        new = change(kind, node[leaf])
        if new is _DROP:
            del node[leaf]
        else:
            node[leaf] = new
    return data


def public_config(cfg: BaseModel) -> dict:
    """``cfg`` dumped as JSON with every secret redacted: what fedpeft writes or sends."""
    return _apply(cfg.model_dump(mode="json"), cfg, redact_value)


def identity_dump(cfg: BaseModel, **dump: Any) -> dict:
    """``cfg.model_dump(mode="json", **dump)`` with no credential in it, whether given in the
    config, redacted (``***``) or left to the environment: a secret field is left out, a URI
    keeps all but its credentials. What a run's identity (its fingerprint) is hashed from."""
    data = cfg.model_dump(mode="json", **dump)
    return _apply(data, cfg, lambda kind, value: _DROP if kind == "secret" else bare_uri(value))


def redact_value(kind: str, value: Any) -> Any:
    if kind == "secret":
        return REDACTED
    return redact_uri(value) if isinstance(value, str) else value


def redact_uri(uri: str) -> str:
    """``uri`` with its credentials redacted: ``https://user:***@host/?token=***``;
    a userinfo without a password (a token as the user) is redacted whole, ``***@host``."""
    parts = urlsplit(uri)
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        uri = _with_netloc(uri, parts.netloc, f"{_redact_userinfo(userinfo)}@{host}")
    return _with_query(uri, parts.query, _redact_query(parts.query))


def _redact_userinfo(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{REDACTED}" if colon else REDACTED


def _redact_query(query: str) -> str:
    pairs = []
    for pair in query.split("&") if query else []:
        name, eq, _ = pair.partition("=")
        pairs.append(f"{name}={REDACTED}" if eq and SECRET_PARAM.search(unquote(name)) else pair)
    return "&".join(pairs)


def _with_netloc(uri: str, old: str, new: str) -> str:
    """``uri`` with its authority ``old`` (right after ``scheme://``) replaced by ``new``; the
    rest as it was written (``urlunsplit`` would turn ``sqlite:///x.db`` into ``sqlite:/x.db``)."""
    scheme, sep, rest = uri.partition("://")
    return f"{scheme}{sep}{new}{rest.removeprefix(old)}" if sep and rest.startswith(old) else uri


def _with_query(uri: str, old: str, new: str) -> str:
    if old == new:
        return uri
    head, _, tail = uri.partition("?" + old)
    return f"{head}?{new}{tail}" if new else head + tail


def bare_uri(uri: str) -> str:
    """``uri`` without its userinfo and its credential query parameters."""
    parts = urlsplit(uri)
    uri = _with_netloc(uri, parts.netloc, parts.netloc.rpartition("@")[2])
    kept = [p for p in parts.query.split("&") if p and not SECRET_PARAM.search(unquote(p.partition("=")[0]))]
    return _with_query(uri, parts.query, "&".join(kept))


def uri_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """``(uri without its userinfo, user, password)``, decoded; None where not given, and
    :data:`REDACTED` where a written config redacted it."""
    parts = urlsplit(uri)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return uri, None, None
    user, colon, password = userinfo.partition(":")
    return _with_netloc(uri, parts.netloc, host), unquote(user), unquote(password) if colon else None


def with_credentials(uri: str, user: str | None, password: str | None) -> str:
    """``uri`` (without userinfo) with ``user`` and ``password`` put in, percent-encoded."""
    if user is None and password is None:
        return uri
    netloc = urlsplit(uri).netloc
    userinfo = quote(user or "", safe="") + ("" if password is None else ":" + quote(password, safe=""))
    return _with_netloc(uri, netloc, f"{userinfo}@{netloc}")


def redacted_params(uri: str) -> list[str]:
    """The query parameters of ``uri`` whose value a written config redacted."""
    return [
        unquote(name)
        for name, eq, value in (pair.partition("=") for pair in urlsplit(uri).query.split("&"))
        if eq and value == REDACTED
    ]


def from_environment(value: str | None, key: str, what: str, variable: str) -> str | None:
    """``value``, unless a written config redacted it: then the environment's ``variable``,
    or a :class:`ConfigError` naming ``key`` and ``variable`` (never the ``***``, which
    would otherwise be sent as the credential)."""
    if value != REDACTED:
        return value
    found = os.environ.get(variable)
    if not found:
        raise ConfigError(
            f"{key}: its {what} was redacted (***) in the config this run read; set {variable} in the "
            "environment"
        )
    return found


def environment_secrets() -> list[str]:
    """The values of the environment variables named like a credential (``MLFLOW_TRACKING_PASSWORD``,
    ``MLFLOW_TRACKING_TOKEN``, ``WANDB_API_KEY``, ``HF_TOKEN``, ...), longest first."""
    found = {v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 6}
    return sorted(found, key=len, reverse=True)


def scrub(text: str) -> str:
    """``text`` (a log line, an error message) with every URI's credentials and every
    credential the environment holds replaced by :data:`REDACTED`."""
    text = _URI_IN_TEXT.sub(lambda m: f"{m[1]}{_redact_userinfo(m[2])}@", text)
    text = _PARAM_IN_TEXT.sub(lambda m: m[1] + (REDACTED if SECRET_PARAM.search(m[2]) else m[3]), text)
    for value in environment_secrets():
        text = text.replace(value, REDACTED)
    return text
