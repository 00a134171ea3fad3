"""Reading and writing experiment configs: a YAML file (or a built-in config) with dotted
overrides in, a validated :class:`ExperimentConfig` out, every error naming its key; and
the resolved config back out as YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fedpeft.config.common import ConfigError
from fedpeft.config.experiment import ExperimentConfig
from fedpeft.config.secrets import public_config, scrub


def _format_errors(err: ValidationError, origin: str) -> str:
    """One line per error: ``origin: dotted.key: what is wrong (got value)``."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        if len(loc) > 2 and loc[0] == "method":  # drop the union tag: method.fedlr.r -> method.r
            loc.pop(1)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error":  # our own checks already name their key
            lines.append(f"{origin}: {msg}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{origin}: {'.'.join(loc)}: unknown key")
        else:
            got = "" if e["type"] == "missing" else scrub(f" (got {e.get('input')!r:.60})")
            lines.append(f"{origin}: {'.'.join(loc) or '<root>'}: {msg}{got}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], origin: str = "<config>") -> ExperimentConfig:
    """Validate a plain mapping; raise ConfigError naming each bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, origin)) from None


def builtin_configs() -> dict[str, str]:
    """The experiment configs shipped with fedpeft, by name (``default``, ``cross_silo``)."""
    from importlib.resources import files

    folder = files("fedpeft.configs")
    return {f.name.removesuffix(".yaml"): f.read_text() for f in folder.iterdir() if f.name.endswith(".yaml")}


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML config (a file, or the name of a built-in one; None: the built-in
    default experiment) and apply dotted overrides."""
    builtin = builtin_configs()
    if path is None or (str(path) in builtin and not Path(path).is_file()):
        name = "default" if path is None else str(path)
        text, origin = builtin[name], f"{name}.yaml"
    else:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file (built-in configs: {', '.join(sorted(builtin))})")
        text, origin = read_text(path, "config"), str(path)
    data = read_yaml(text, f"config {origin}")
    if data is None:
        raise ConfigError(f"config {origin}: empty")
    if not isinstance(data, dict):
        raise ConfigError(f"config {origin}: the top level must be a mapping of sections, not {_kind(data)}")
    overrides = overrides or {}
    default_method = _method_name(data)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    method = _method_name(data)
    if path is None and method != default_method and _plain_name(method):
        # the built-in default with another method: its own name and directory (unless
        # given), so that it neither reads as FedLR nor replaces the default run's records
        if "name" not in overrides:
            data["name"] = f"default-{method}"
        if "output_dir" not in overrides:
            data["output_dir"] = f"runs/default-{method}"
    return parse_config(data, origin)


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of file ``path``; a ConfigError naming ``what`` (``config``), the file,
    and the line and column of a byte that is not UTF-8, or why the file cannot be read."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{what} {path}: cannot be read: {err.strerror or err}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise ConfigError(
            f"{what} {path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {column}); "
            "save it as UTF-8"
        ) from None


def read_yaml(text: str, origin: str) -> Any:
    """``text`` read as YAML; a ConfigError in one line (``origin:LINE:COLUMN: not valid
    YAML: why``) where it is not."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        line, column, why = yaml_error(err, text)
        where = f":{line}:{column}" if line else ""
        raise ConfigError(f"{origin}{where}: not valid YAML: {why}") from None


def yaml_value(text: str, origin: str) -> Any:
    """A value given on the command line (``--set KEY=VALUE``'s) read as YAML; a
    ConfigError in one line naming ``origin`` where it is not UTF-8 text or not YAML."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a byte the locale could not decode, kept as a lone surrogate
        raise ConfigError(f"{origin}: not UTF-8 text (character {err.start + 1} of the value)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        line, column, why = yaml_error(err, text)
        where = f" (line {line}, column {column})" if "\n" in text.strip() else f" (column {column})"
        where = where if line else ""
        raise ConfigError(f"{origin}: not valid YAML{where}: {why}") from None


def yaml_error(err: yaml.YAMLError, text: str) -> tuple[int | None, int | None, str]:
    """Where in ``text`` a YAML error is (line and column, 1-based; None where it does not
    say) and what it is, in one line."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if isinstance(err, yaml.MarkedYAMLError):
        why = err.problem or err.context or "malformed"
        context, at = err.context, err.context_mark
        if err.problem and context and at is not None and at is not mark:
            why += f" ({context} at line {at.line + 1}, column {at.column + 1})"
        elif err.problem and context:
            why += f" ({context})"
    elif isinstance(err, yaml.reader.ReaderError):
        line = text.count("\n", 0, err.position) + 1
        column = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        char = err.character if isinstance(err.character, int) else ord(err.character)
        return line, column, f"character U+{char:04X} is not allowed"
    else:
        why = str(err)
    if mark is None:
        return None, None, " ".join(why.split())
    return mark.line + 1, mark.column + 1, " ".join(why.split())


def _kind(value: Any) -> str:
    """What a YAML value is, for an error: ``a list``, ``a boolean (false)``."""
    if isinstance(value, list):
        return "a list"
    name = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}.get(type(value))
    shown = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    return f"{name or type(value).__name__} ({shown:.40})"


def _plain_name(name: Any) -> bool:
    """Whether ``name`` can be part of a directory name as it is (no separator, no ``..``)."""
    return isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum()


def _method_name(data: Any) -> Any:
    """``data['method']['name']`` where the config has one (None otherwise: a malformed
    config is left for ``parse_config`` to name)."""
    method = data.get("method") if isinstance(data, dict) else None
    return method.get("name") if isinstance(method, dict) else None


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data['a']['b'] = value`` for ``key = 'a.b'``, creating levels as needed."""
    *parents, leaf = key.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{p}' is not a mapping")
    node[leaf] = value


def dump_config(cfg: ExperimentConfig) -> str:
    """The fully resolved config as YAML (what a run actually used), its secrets redacted
    (:func:`fedpeft.config.secrets.public_config`): what fedpeft writes (``config.yaml``) and
    sends (a deployment's run config)."""
    return yaml.safe_dump(public_config(cfg), sort_keys=False)
