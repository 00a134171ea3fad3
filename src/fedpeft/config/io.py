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
            got = "" if e["type"] == "missing" else f" (got {e.get('input')!r:.60})"
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
        text, origin = path.read_text(), str(path)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{origin}: not valid YAML: {err}") from None
    overrides = overrides or {}
    default_method = _method_name(data)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    method = _method_name(data)
    if path is None and method != default_method:
        # the built-in default with another method: its own name and directory (unless
        # given), so that it neither reads as FedLR nor replaces the default run's records
        if "name" not in overrides:
            data["name"] = f"default-{method}"
        if "output_dir" not in overrides:
            data["output_dir"] = f"runs/default-{method}"
    return parse_config(data, origin)


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
    """The fully resolved config as YAML (what a run actually used)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
