"""A node's ClientApp processes forked warm: fedpeft's SuperExec and the SuperNode that
starts it (the deployment tests run them end to end)."""

from __future__ import annotations

import subprocess
import sys

from flwr.supercore.superexec.executor import subprocess_executor

from fedpeft.flower import relay, superexec, supernode


def test_a_clientapp_is_forked_from_the_fork_server_with_its_command_line():
    starts = superexec.WarmStarts()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    helped = starts.Popen(["flwr-clientapp", "--help"], **quiet)
    refused = starts.Popen(["/any/bin/flwr-clientapp", "--no-such-flag"], **quiet)
    for process in (helped, refused):
        process.join(120)
        assert process.name == relay.FORKED_CLIENTAPP  # what the relay tells its worker
    # flwr-clientapp's own argument parser ran on the command line given: --help exits 0,
    # an unknown flag 2
    assert (helped.exitcode, refused.exitcode) == (0, 2)
    # any other command is a plain subprocess
    other = starts.Popen([sys.executable, "-c", "print(6 * 7)"], stdout=subprocess.PIPE)
    assert isinstance(other, subprocess.Popen) and other.communicate()[0].strip() == b"42"


def test_flowers_executor_starts_clientapps_warm_once_patched(monkeypatch):
    monkeypatch.setattr(subprocess_executor, "subprocess", subprocess)  # restored afterwards
    assert superexec.start_clientapps_warm()
    patched = subprocess_executor.subprocess
    assert patched.Popen.__self__.__class__ is superexec.WarmStarts
    assert patched.DEVNULL == subprocess.DEVNULL
    assert not superexec.start_clientapps_warm()  # not twice: it is not Flower's own any more
    assert subprocess_executor.subprocess is patched


def test_the_supernode_starts_fedpefts_superexec(monkeypatch):
    started = []
    monkeypatch.setattr(supernode.subprocess, "Popen", lambda args, **kw: started.append(list(args)))
    supernode._popen(["/venv/bin/flower-superexec", "--insecure", "--parent-pid", "7"])
    supernode._popen(["flwr-serverapp", "--insecure"])
    assert started == [
        [sys.executable, "-m", "fedpeft.flower.superexec", "--insecure", "--parent-pid", "7"],
        ["flwr-serverapp", "--insecure"],
    ]
