"""What every ``fedpeft`` command shares: the console, the config argument and its
``--set`` overrides, library noise turned down, and errors as one line and exit code 2.

Commands print through ``common.console``, looked up when they print, so that a console
put in its place here (a test's 80-column one) is the one every command uses.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from fedpeft.config import ConfigError, ExperimentConfig, load_config, scrub
from fedpeft.config.io import yaml_value

console = Console()

ConfigArg = Annotated[Path | None, typer.Argument(help="Experiment YAML (default: the built-in one).")]  # noqa: UP007
SetOpt = Annotated[
    list[str] | None,  # noqa: UP007
    typer.Option("--set", "-s", help="Override a key, e.g. --set train.rounds=5 (YAML value)."),
]


def quiet_libraries() -> None:
    """Other libraries' progress bars ("Loading weights"), info logs and warnings off;
    fedpeft's own warnings stay. Through the variables each library reads when it is
    imported, so that a command that loads no model (and every --help) imports none of
    them; a library imported already is told directly."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is imported (log.to)
    os.environ.setdefault("WANDB_SILENT", "true")
    # bitsandbytes (a quantised run) logs at import that its CPU kernels cannot be fetched
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"fedpeft(\.|$)")


def parse_overrides(sets: list[str] | None) -> dict:
    """The ``--set KEY=VALUE`` options as a mapping, each value read as YAML."""
    overrides = {}
    for item in sets or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(
                f"--set {item!r}: the key {key.strip()!r} has an empty part (e.g. train.rounds)"
            )
        overrides[key.strip()] = yaml_value(value, f"--set {item!r}")
    return overrides


def read_config(path: Path | None, sets: list[str] | None) -> ExperimentConfig:
    """The config at ``path`` (none: the built-in one) with the ``--set`` overrides."""
    return load_config(path, parse_overrides(sets))


def checked_config(path: Path | None, sets: list[str] | None) -> ExperimentConfig:
    """The config, or exit 2 saying what is wrong with it: called before a command imports
    torch and the rest, so that a bad key is named at once."""
    try:
        return read_config(path, sets)
    except ConfigError as err:
        fail(err)


def fail(err: Exception | str) -> NoReturn:
    """Print ``err`` as one line and leave with exit code 2 (its brackets as they are: a
    library's message may hold some, ``[gloo/pair.cc:152]``, that are not rich markup)."""
    err = scrub(str(err))  # no credential on the console: a URI's password, a token the environment holds
    # a byte the locale could not decode (a file's name) is kept as a lone surrogate: shown escaped
    text = str(err).encode("utf-8", "backslashreplace").decode("utf-8")
    console.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True)  # paths in one piece, to copy
    raise typer.Exit(2)
