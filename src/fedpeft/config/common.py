"""What every config section shares: the strict model settings and :class:`ConfigError`."""

from __future__ import annotations

from pydantic import ConfigDict

#: every section refuses unknown keys and re-checks a value assigned after validation
Strict = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config that cannot run; the message names the file and the key at fault."""
