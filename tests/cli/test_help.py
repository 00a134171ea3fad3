"""The CLI answers at once (issue 61): ``import fedpeft.cli``, every ``--help`` and a
config's errors load no model library; the help is plain text rewrapped to the terminal."""

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

HEAVY = ("torch", "transformers", "flwr", "bitsandbytes", "peft", "datasets")

# run in a fresh interpreter: the CLI with argv, exit code and heavy modules as JSON last
PROBE = f"""
import json, sys
import fedpeft.cli
from typer.main import get_command

calls = json.loads(sys.argv[1])
if calls == "every help":
    calls = [["--help"]] + [[name, "--help"] for name in get_command(fedpeft.cli.app).commands]
codes = []
for argv in calls:
    try:
        fedpeft.cli.app(argv, prog_name="fedpeft")
    except SystemExit as stop:
        codes.append(stop.code)
heavy = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps({{"codes": codes, "heavy": heavy, "calls": len(calls)}}))
"""


def probe(calls, cwd, columns=100) -> tuple[dict, str]:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    res = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(calls)], capture_output=True, text=True, env=env, cwd=cwd
    )
    assert res.returncode == 0, res.stderr
    *output, last = res.stdout.rstrip("\n").splitlines()
    return json.loads(last), "\n".join(output)


def test_import_and_every_help_load_no_model_library(tmp_path):
    result, output = probe("every help", tmp_path)
    assert result["calls"] >= 13  # the group's help and every command's
    assert result["codes"] == [0] * result["calls"], output
    assert result["heavy"] == []
    assert "Usage: fedpeft join" in output and "Usage: fedpeft run" in output


def test_a_config_error_is_reported_before_any_model_library_loads(tmp_path):
    (tmp_path / "bad.yaml").write_text("train:\n  rounds: 3\n  roundz: 4\n")
    result, output = probe(
        [["run", "bad.yaml"], ["run", "--set", "train.rounds=abc"]]
        + [[command, "bad.yaml"] for command in ("partition", "methods", "sweep", "serve")],
        tmp_path,
    )
    assert result["codes"] == [2] * 6, output
    assert result["heavy"] == []
    assert "bad.yaml: train.roundz: unknown key" in output
    assert "default.yaml: train.rounds: Input should be a valid integer" in output


def help_text(*argv: str, columns: int) -> str:
    from fedpeft.cli import app

    res = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": str(columns), "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    return res.output


def test_help_has_no_rst_markup_and_rewraps_its_paragraphs():
    from typer.main import get_command

    from fedpeft.cli import app

    texts = [help_text(columns=80)] + [help_text(name, columns=80) for name in get_command(app).commands]
    for text in texts:
        assert "``" not in text and ":mod:" not in text, text
    # a docstring paragraph of four source lines reads as one line on a wide terminal
    wide = help_text("report", columns=300)
    paragraph = (
        "The time to 90/95/99 % of the target (--target); with --baseline, the rounds each run took to "
        "reach it and its speed-up over the baseline. The plots put every run on one figure: accuracy "
        "against rounds and bytes, LoRA update variation, client drift. --html: a page of it all."
    )
    assert any(paragraph in line for line in wide.splitlines()), wide
    # ... and as several, none wider than the terminal, on a narrow one
    narrow = help_text("report", columns=80)
    assert "The time to 90/95/99 % of the target" in narrow
    assert max(len(line) for line in narrow.splitlines()) <= 80
    # the commands list: each command's first sentence, on one line when there is room
    overview = help_text(columns=200)
    assert re.search(
        r"keys +Make nodes' key pairs for a SuperLink that admits enrolled nodes only\. *│", overview
    )
    # an argument's help is shown (typer 0.20 under click 8.5 drops it on its own)
    assert "Experiment YAML (default: the built-in one)." in help_text("run", columns=120)


def test_plain_help_text():
    from fedpeft.cli.help import first_sentence, plain

    doc = """Join with ``fedpeft join`` (``--key K``),
    or `fedpeft certs` and :mod:`fedpeft.flower`.

    A second
    paragraph. And more, e.g. A.

    \b
    kept
    as is"""
    assert plain(doc) == (
        "Join with 'fedpeft join' (--key K), or 'fedpeft certs' and fedpeft.flower.\n\n"
        "A second paragraph. And more, e.g. A.\n\n\b\nkept\nas is"
    )
    assert (
        first_sentence(plain(doc))
        == "Join with 'fedpeft join' (--key K), or 'fedpeft certs' and fedpeft.flower."
    )
    assert first_sentence("One, e.g. X. Two.") == "One, e.g. X."


def test_an_error_with_brackets_prints_them_as_they_are(capsys):
    """A library's message may hold brackets that are not markup (gloo's ``[.../pair.cc:152]``)."""
    import typer

    from fedpeft.cli.common import fail

    with pytest.raises(typer.Exit):
        fail(RuntimeError("[/__w/gloo/tcp/pair.cc:152] timed out connecting [bold]"))
    assert "error: [/__w/gloo/tcp/pair.cc:152] timed out connecting [bold]" in capsys.readouterr().out
