"""Bad inputs through the CLI (issue 72): each one is ONE line naming the file (and line)
with the reason, exit code 2, never a traceback, and caught before any model loads where
it can be; names that would lead out of their folder are refused; the workers' socket
folder under the temporary directory is used only when it is this user's alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedpeft.cli import app
from fedpeft.config import dump_config


def error_line(args: list[str]) -> str:
    """The one line of error a refused command prints (asserting exit code 2, no
    traceback; ``fedpeft run`` says which run it starts before that)."""
    res = CliRunner().invoke(app, args)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    assert lines and lines[-1].startswith("error: "), res.output
    before = lines[:-1]  # nothing, or the run's header (its path may wrap): no second error
    assert not before or (args[0] == "run" and " -> " in before[0] and "error" not in "".join(before)), (
        res.output
    )
    return lines[-1].removeprefix("error: ")


def no_model_loaded(monkeypatch) -> None:
    """A model load fails the test: a config error is caught before any model loads."""
    from fedpeft.models import backbone

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a bad config")

    monkeypatch.setattr(backbone, "build_model", refuse)


# ---------------------------------------------------------------- config files
@pytest.mark.parametrize("command", ["run", "partition", "sweep"])
def test_a_config_with_a_byte_that_is_not_utf8_is_one_line_naming_its_line(tmp_path, monkeypatch, command):
    no_model_loaded(monkeypatch)
    path = tmp_path / "exp.yaml"
    path.write_bytes(b"name: x\ntrain:\n  rounds: 2 # caf\xe9\n")
    line = error_line([command, str(path)])
    assert line == f"config {path}:3: not UTF-8 text (byte 0xe9 at column 18); save it as UTF-8"


@pytest.mark.parametrize("text", ["", "\n", "# nothing but a comment\n", "null\n"])
@pytest.mark.parametrize("command", ["run", "partition", "sweep"])
def test_an_empty_config_is_refused_not_the_default_trained(tmp_path, monkeypatch, text, command):
    no_model_loaded(monkeypatch)
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    assert (
        error_line([command, str(path), "--set", f"output_dir={tmp_path / 'out'}"]) == f"config {path}: empty"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "kind"),
    [("[]\n", "a list"), ("- name: x\n", "a list"), ("false\n", "a boolean (false)"), ("0\n", "a number (0)"),
     ("fedlr\n", "a string (fedlr)")],
)  # fmt: skip
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_config_whose_top_level_is_no_mapping_is_refused(tmp_path, monkeypatch, text, kind, command):
    no_model_loaded(monkeypatch)
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    line = error_line([command, str(path), "--set", f"output_dir={tmp_path / 'out'}"])
    assert line == f"config {path}: the top level must be a mapping of sections, not {kind}"
    assert not (tmp_path / "out").exists()


def test_a_config_that_is_not_yaml_names_its_line_and_column(tmp_path, monkeypatch):
    no_model_loaded(monkeypatch)
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  rounds: [1\nname: x\n")
    line = error_line(["run", str(path)])
    assert line.startswith(f"config {path}:3:5: not valid YAML: expected ',' or ']', but got ':'")
    assert "line 2, column 11" in line  # where the list began
    path.write_text("name: x\n\x07\n")  # a control character
    assert (
        error_line(["run", str(path)])
        == f"config {path}:2:1: not valid YAML: character U+0007 is not allowed"
    )


def test_an_unreadable_config_is_one_line(tmp_path, monkeypatch):
    no_model_loaded(monkeypatch)
    path = tmp_path / "exp.yaml"
    path.write_text("name: x\n")
    read_bytes = Path.read_bytes

    def forbidden(self):  # as chmod 0 would, for a user other than root
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", forbidden)
    assert error_line(["run", str(path)]) == f"config {path}: cannot be read: Permission denied"


# ---------------------------------------------------------------- --set and --grid values
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "train.rounds=["], "--set 'train.rounds=[': not valid YAML (column 2): expected the node "
         "content, but found '<stream end>' (while parsing a flow node)"),
        (["--set", "name=caf\udce9"], "--set 'name=caf\\udce9': not UTF-8 text (character 4 of the value)"),
        (["--set", "train..rounds=2"], "--set 'train..rounds=2': the key 'train..rounds' has an empty part "
         "(e.g. train.rounds)"),
        (["--set", "=2"], "--set '=2': the key '' has an empty part (e.g. train.rounds)"),
        (["--set", "train.rounds"], "--set 'train.rounds': expected KEY=VALUE"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["run", "partition", "sweep"])
def test_a_bad_set_value_is_one_line_naming_it(monkeypatch, args, expected, command):
    no_model_loaded(monkeypatch)
    assert error_line([command, *args]) == expected


def test_a_bad_grid_value_is_one_line_naming_it(monkeypatch):
    no_model_loaded(monkeypatch)
    line = error_line(["sweep", "--grid", "seed=0,[1"])
    assert line.startswith("--grid 'seed=0,[1': not valid YAML (column 3): ")
    assert error_line(["sweep", "--grid", "seed=0,\udcff"]) == (
        "--grid 'seed=0,\\udcff': not UTF-8 text (character 1 of the value)"
    )


def test_a_config_file_name_that_is_not_utf8_is_shown_escaped(tmp_path, monkeypatch):
    no_model_loaded(monkeypatch)
    line = error_line(["run", str(tmp_path / "caf\udce9.yaml")])
    assert line.startswith(f"{tmp_path}/caf\\udce9.yaml: no such config file")


# ---------------------------------------------------------------- names that leave their folder
@pytest.mark.parametrize("value", ["../../x", "a/b", "/abs"])
def test_a_sweep_value_that_leads_out_of_the_sweep_folder_is_refused(tmp_path, monkeypatch, value):
    no_model_loaded(monkeypatch)
    sweep_dir = tmp_path / "a" / "b" / "sw"
    line = error_line(["sweep", "--grid", f"name=ok,{value}", "--set", f"output_dir={sweep_dir}"])
    assert line == (
        f"sweep point 'name={value}': its run folder would not be one folder inside {sweep_dir} (a value "
        "holds '/'); sweep values without one"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, inside or out


def test_sweep_points_with_plain_values_get_one_folder_each_inside_the_sweep_folder(tmp_path):
    from fedpeft import sweep as S

    points = S.expand(None, S.parse_grid(["name=a,..b", "seed=0,1"]), {"output_dir": str(tmp_path / "sw")})
    dirs = [Path(cfg.output_dir) for _, cfg in points]
    assert [d.name for d in dirs] == ["name=a_seed=0", "name=a_seed=1", "name=..b_seed=0", "name=..b_seed=1"]
    assert all(d.parent == tmp_path / "sw" for d in dirs)


def test_a_method_name_that_is_a_path_names_no_folder_of_the_default_run(tmp_path, monkeypatch):
    """The built-in config with another method runs in runs/default-<method>: a method
    name that is a path is refused as an unknown method, and names no folder first."""
    no_model_loaded(monkeypatch)
    monkeypatch.chdir(tmp_path)
    line = error_line(["partition", "--set", "method.name=../../x"])
    assert line.startswith("default.yaml: method: Input tag '../../x' found using 'name' does not match")
    assert list(tmp_path.iterdir()) == []


def test_the_default_run_with_another_method_is_named_after_it():
    from fedpeft.config import load_config

    cfg = load_config(None, {"method.name": "federa"})
    assert cfg.name == "default-federa" and cfg.output_dir == Path("runs/default-federa")


# ---------------------------------------------------------------- data files
@pytest.mark.parametrize("command", ["partition", "run"])
def test_a_jsonl_line_that_is_no_object_names_the_file_and_line(tiny_config, tmp_path, command):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a cat", "label": 0}\n\n{"text": "a dog", "label": 1}\n[1, 2]\n')
    cfg = tiny_config(**{"data.source": "file", "data.path": str(data), "output_dir": str(tmp_path / "out")})
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))
    assert (
        error_line([command, str(path)]) == f"{data}:4: each line must be a JSON object ({{...}}), not a list"
    )
    data.write_text('{"text": "a cat", "label": 0}\n"just text"\n')
    assert (
        error_line([command, str(path)])
        == f"{data}:2: each line must be a JSON object ({{...}}), not a string"
    )


def test_a_data_line_that_is_not_utf8_or_not_json_names_the_file_and_line(tiny_config, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    cfg = tiny_config(**{"data.source": "file", "data.path": str(data), "output_dir": str(tmp_path / "out")})
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))
    data.write_bytes(b'{"text": "a cat", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    assert error_line(["partition", str(path)]) == f"{data}:2: not UTF-8 text (byte 0xe9 at column 14)"
    data.write_text('{"text": "a cat", "label": 0}\n{"text": cat}\n')
    assert error_line(["partition", str(path)]) == f"{data}:2: not valid JSON: Expecting value (column 10)"
    csv = tmp_path / "train.csv"
    csv.write_bytes(b"text,label\na cat,0\ncaf\xe9,1\n")
    path.write_text(dump_config(cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": csv})})))
    assert error_line(["partition", str(path)]) == f"{csv}:3: not UTF-8 text (byte 0xe9 at column 4)"


def test_conll_squad_and_chat_files_name_the_line_that_is_not_utf8_or_no_object(tmp_path):
    from fedpeft.data.conll import read_conll
    from fedpeft.data.qa import read_squad
    from fedpeft.data.tables import read_table
    from fedpeft.data.types import DataError

    conll = tmp_path / "train.conll"
    conll.write_bytes(b"EU B-ORG\n\ncaf\xe9 O\n")
    with pytest.raises(DataError) as err:
        read_conll(conll)
    assert str(err.value) == f"{conll}:3: not UTF-8 text (byte 0xe9 at column 4)"
    squad = tmp_path / "train.json"
    squad.write_bytes(b'{"data": [\n{"title": "caf\xe9"}]}\n')
    with pytest.raises(DataError) as err:
        read_squad(squad)
    assert str(err.value) == f"{squad}:2: not UTF-8 text (byte 0xe9 at column 15)"
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": []}\n7\n')
    with pytest.raises(DataError) as err:
        read_table(chat, objects=True)
    assert str(err.value) == f"{chat}:2: each line must be a JSON object ({{...}}), not a number"


# ---------------------------------------------------------------- checkpoints
def resume_line(tiny_config, tmp_path, write) -> tuple[str, Path]:
    """What ``fedpeft run --resume`` says when the run's only checkpoint is ``write(path)``."""
    out = tmp_path / "out"
    out.mkdir()
    write(out / "checkpoint.pt")
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(tiny_config(output_dir=str(out))))
    return error_line(["run", str(path), "--resume"]), out / "checkpoint.pt"


def test_an_empty_checkpoint_is_said_to_be_empty(tiny_config, tmp_path):
    line, ckpt = resume_line(tiny_config, tmp_path, lambda p: p.write_bytes(b""))
    assert (
        line == f"{ckpt}: unreadable checkpoint: the file is empty (0 bytes) (no kept checkpoint can be read)"
    )


def test_a_checkpoint_holding_a_list_names_the_file_and_what_was_expected(tiny_config, tmp_path):
    line, ckpt = resume_line(tiny_config, tmp_path, lambda p: torch.save([1, 2], p))
    assert line == (
        f"{ckpt}: unreadable checkpoint: expected a mapping of round, fingerprint, server, personal, "
        "records, joined, got list (no kept checkpoint can be read)"
    )


def test_a_checkpoint_that_is_another_file_says_so(tiny_config, tmp_path):
    line, ckpt = resume_line(tiny_config, tmp_path, lambda p: p.write_text("not a checkpoint\n"))
    assert line == (
        f"{ckpt}: unreadable checkpoint: not a torch checkpoint: no whole zip archive in its 17 bytes "
        "(truncated, or another file) (no kept checkpoint can be read)"
    )


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one_saying_why(tmp_path):
    from fedpeft.engines import checkpoint as C

    said: list[str] = []
    kept = C.Checkpoints(tmp_path / "checkpoint.pt", keep=2, say=said.append)
    good = C.Checkpoint(1, "fp", C.ServerState({"w": torch.ones(3)}), {}, [{"round": 1}], [0])
    C.save_checkpoint(kept.of_round(1), good)
    for newest in ([1, 2], {"round": 2}, b""):
        path = tmp_path / "checkpoint.pt"
        path.write_bytes(newest) if isinstance(newest, bytes) else torch.save(newest, path)
        said.clear()
        ckpt = kept.load("fp")
        assert ckpt.round == 1 and torch.equal(ckpt.server.tensors["w"], torch.ones(3))
        why = {0: "expected a mapping of round, fingerprint, server, personal, records, joined, got list",
               1: "expected a mapping of round, fingerprint, server, personal, records, joined; it has no "
                  "fingerprint, server, personal, records, joined",
               2: "the file is empty (0 bytes)"}[[list, dict, bytes].index(type(newest))]  # fmt: skip
        assert said[0] == (
            f"checkpoint.pt could not be read ({path}: unreadable checkpoint: {why}); kept aside as "
            "checkpoint.pt.unreadable"
        )
        assert said[1] == "resuming from the previous checkpoint, checkpoint.round1.pt (round 1)"
        assert (tmp_path / "checkpoint.pt.unreadable").is_file()
        # the previous one is the newest again: put it back as round 1's for the next case
        os.replace(path, kept.of_round(1))
        (tmp_path / "checkpoint.pt.unreadable").unlink()


# ---------------------------------------------------------------- the workers' socket folder
@pytest.fixture
def long_state_dir(tmp_path, monkeypatch) -> Path:
    """A node state directory too deep for a socket path (the sockets go to the temporary
    directory, here ``tmp_path / "tmp"``)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)  # as /tmp: anyone may make a folder in it, only its owner rename it
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp))
    state = tmp_path / ("state-" + "x" * 120)
    state.mkdir()
    return state


def test_the_socket_folder_is_made_this_users_alone(long_state_dir, tmp_path):
    from fedpeft.flower import relay

    files = relay.worker_files(long_state_dir, 3)
    folder = tmp_path / "tmp" / f"fedpeft-{os.getuid()}"
    assert files["socket"].parent == folder and files["socket"].name.endswith("-3.sock")
    st = folder.lstat()
    assert st.st_uid == os.getuid() and (st.st_mode & 0o777) == 0o700
    assert relay.worker_files(long_state_dir, 3) == files  # there already, this user's: used again
    short = tmp_path / "node"
    assert relay.worker_files(short, 0)["socket"] == short.resolve() / "worker-0.sock"  # beside the state


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o750, 0o705, 0o701])
def test_a_socket_folder_open_to_others_is_refused(long_state_dir, tmp_path, mode):
    from fedpeft.flower import relay

    folder = tmp_path / "tmp" / f"fedpeft-{os.getuid()}"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(relay.WorkerError) as err:
        relay.worker_files(long_state_dir, 0)
    assert str(err.value) == (
        f"{folder}: refusing the workers' socket folder: others may open it (mode {mode:04o}; it must be "
        "0700); remove it, or give the node a shorter state-dir (its sockets then lie in it)"
    )
    assert list(folder.iterdir()) == []


def test_a_socket_folder_that_is_a_symlink_is_refused(long_state_dir, tmp_path):
    from fedpeft.flower import relay

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    folder = tmp_path / "tmp" / f"fedpeft-{os.getuid()}"
    folder.symlink_to(elsewhere)
    with pytest.raises(relay.WorkerError, match="refusing the workers' socket folder: it is a symbolic link"):
        relay.worker_files(long_state_dir, 0)
    (tmp_path / "tmp" / f"fedpeft-{os.getuid()}").unlink()
    (tmp_path / "tmp" / f"fedpeft-{os.getuid()}").write_text("")  # a file in its place
    with pytest.raises(relay.WorkerError, match="it is not a folder"):
        relay.worker_files(long_state_dir, 0)


def test_a_socket_folder_of_another_user_is_refused(long_state_dir, tmp_path, monkeypatch):
    from fedpeft.flower import relay

    other = os.getuid() + 1  # who we pretend to be: the folder (made now, by us) is someone else's
    monkeypatch.setattr(relay.os, "getuid", lambda: other)
    with pytest.raises(relay.WorkerError) as err:
        relay.worker_files(long_state_dir, 0)
    folder = tmp_path / "tmp" / f"fedpeft-{other}"
    assert str(err.value) == (
        f"{folder}: refusing the workers' socket folder: it belongs to user {other - 1}, not to this user "
        f"({other}); remove it, or give the node a shorter state-dir (its sockets then lie in it)"
    )


def test_a_temporary_directory_others_may_rename_in_is_refused(long_state_dir, tmp_path):
    from fedpeft.flower import relay

    (tmp_path / "tmp").chmod(0o777)  # no sticky bit
    with pytest.raises(relay.WorkerError, match="lets others rename what is in it"):
        relay.worker_files(long_state_dir, 0)


def test_a_worker_started_by_hand_refuses_a_socket_folder_open_to_others(tmp_path):
    from fedpeft.flower import worker

    folder = tmp_path / "sockets"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(SystemExit) as err:
        worker.main(
            ["--socket", str(folder / "w.sock"), "--status", str(tmp_path / "w.json"), "--watch", "1"]
        )
    assert "others may open it (mode 0777" in str(err.value.code)
