"""The ClientApp of a warm node: it hands each message to the node's worker and returns
the worker's reply.

Flower starts a fresh ClientApp process for every message. Run there, fedpeft's client
(:mod:`fedpeft.flower.apps`) would import torch, rebuild the backbone and reload its data
for every message, every round. This module imports Flower and the standard library
only: the process sends the message over a Unix socket to a long-lived worker
(:mod:`fedpeft.flower.worker`, one per node) that holds the model, the data and the
personal state across rounds and runs, and answers with the reply.

The worker is started on first use, next to the node's state (``state-dir``); its socket
is readable and writable by the node's user alone. A worker that is gone (killed, or
never started) is started again from the state directory, and a message whose worker
died before replying is sent again: a local round is seeded by (seed, round, client) and
starts from the personal state before that round, so training it twice gives the same
reply, and nothing is lost.
"""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.serde import (
    context_to_proto,
    message_to_proto,
    recorddict_from_proto,
    recorddict_to_proto,
)
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611

client_app = ClientApp()

DEFAULT_STATE_DIR = ".fedpeft-node"  # as fedpeft.flower.apps
START_TIMEOUT = 300.0  # a worker imports torch and fedpeft before it listens
ATTEMPTS = 3  # a message is sent this many times at most when its worker dies under it
FORKED_CLIENTAPP = "flwr-clientapp, forked warm"  # the name fedpeft.flower.superexec gives it
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
OK, FAILED = b"ok", b"failed"


class WorkerError(RuntimeError):
    """The node's worker could not be started, or raised while handling a message."""


# ---------------------------------------------------------------- where a node's worker lives
def worker_files(state_dir: Path, cid: int) -> dict[str, Path]:
    """The socket, lock, log and status file of client ``cid``'s worker under ``state_dir``.
    A socket path too long for ``sun_path`` goes to a private folder of this user under
    the temporary directory instead."""
    state_dir = state_dir.resolve()
    sock = state_dir / f"worker-{cid}.sock"
    if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
        private = private_folder(Path(tempfile.gettempdir()) / f"fedpeft-{os.getuid()}")
        digest = hashlib.sha256(os.fsencode(state_dir)).hexdigest()[:16]
        sock = private / f"{digest}-{cid}.sock"
    return {
        "socket": sock,
        "lock": state_dir / f"worker-{cid}.lock",
        "log": state_dir / f"worker-{cid}.log",
        "status": state_dir / f"worker-{cid}.json",
    }


def private_folder(folder: Path) -> Path:
    """``folder`` (the sockets' folder under the temporary directory), made for this user
    alone (mode 0700) where it is not there yet. Its name can be guessed, so another user
    may have made it first: a folder that is a symbolic link, is not this user's, or that
    others may open or write to is refused (:class:`WorkerError`), never used. Checked
    after making it, on the entry itself (``lstat``); the temporary directory must keep
    others from renaming it (the sticky bit, as ``/tmp`` has) or be closed to them."""
    try:
        os.mkdir(folder, 0o700)  # the umask can only take more away
    except FileExistsError:
        pass
    except OSError as err:
        raise WorkerError(f"{folder}: cannot make the workers' socket folder: {err.strerror}") from None
    parent = os.stat(folder.parent)  # the temporary directory itself (/tmp may be a link to it)
    if parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
        raise WorkerError(
            f"{folder}: refusing the workers' socket folder: {folder.parent} lets others rename what is in "
            "it (writable by others, no sticky bit); set TMPDIR to a folder of your own"
        )
    st = os.lstat(folder)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "it is not a folder"
    elif st.st_uid != os.getuid():
        why = f"it belongs to user {st.st_uid}, not to this user ({os.getuid()})"
    elif st.st_mode & 0o077:
        why = f"others may open it (mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700)"
    if why is not None:
        raise WorkerError(
            f"{folder}: refusing the workers' socket folder: {why}; remove it, or give the node a shorter "
            "state-dir (its sockets then lie in it)"
        )
    return folder


def node_identity(context: Context) -> tuple[Path, int]:
    nc = context.node_config
    if "partition-id" not in nc:
        raise ValueError(
            "node config: 'partition-id' is missing (flower-supernode --node-config 'partition-id=0')"
        )
    return Path(str(nc.get("state-dir", DEFAULT_STATE_DIR))), int(nc["partition-id"])


# ---------------------------------------------------------------- framing
def send_frames(conn: socket.socket, *frames: bytes) -> None:
    conn.sendall(struct.pack("!I", len(frames)))
    for frame in frames:
        conn.sendall(struct.pack("!Q", len(frame)))
        conn.sendall(frame)


def recv_frames(conn: socket.socket) -> list[bytes]:
    """The frames of one request or reply; :class:`ConnectionError` if the peer went away."""
    (count,) = struct.unpack("!I", _recv_exactly(conn, 4))
    frames = []
    for _ in range(count):
        (size,) = struct.unpack("!Q", _recv_exactly(conn, 8))
        frames.append(_recv_exactly(conn, size))
    return frames


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = conn.recv(min(size - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the worker closed the connection")
        buf += chunk
    return bytes(buf)


# ---------------------------------------------------------------- the worker's life
def connect(files: dict[str, Path]) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(files["socket"]))
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None
    return conn


def ensure_worker(state_dir: Path, cid: int, watch: int) -> socket.socket:
    """A connection to client ``cid``'s worker, started first if none answers (one start
    at a time: a lock file); it stops when process ``watch`` (the node's) is gone."""
    files = worker_files(state_dir, cid)
    if (conn := connect(files)) is not None:
        return conn
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(files["lock"], "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (conn := connect(files)) is not None:  # another message started it meanwhile
            return conn
        command = [sys.executable, "-m", "fedpeft.flower.worker", "--socket", str(files["socket"]),
                   "--status", str(files["status"]), "--watch", str(watch)]  # fmt: skip
        with open(files["log"], "ab") as log:  # this interpreter, fedpeft's own module
            proc = subprocess.Popen(  # noqa: S603
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this message's process
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while (conn := connect(files)) is None:
            if proc.poll() is not None:
                tail = files["log"].read_text(errors="replace")[-1500:]
                raise WorkerError(f"client {cid}: its worker exited with code {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                proc.kill()
                raise WorkerError(f"client {cid}: its worker did not answer within {START_TIMEOUT:g} s")
            time.sleep(0.05)
        return conn


def relay(message: Message, context: Context) -> Message:
    """Send ``message`` (with the node's context) to the worker; its reply, and the
    context state it leaves (SecAgg+ keeps its protocol state there)."""
    state_dir, cid = node_identity(context)
    # Flower's SuperExec, or the fork server it started: either lives as long as the SuperNode
    node_process = os.getppid()
    forked = multiprocessing.current_process().name == FORKED_CLIENTAPP
    request = (
        message_to_proto(message).SerializeToString(),
        context_to_proto(context).SerializeToString(),
        str(node_process).encode(),
        b"forked" if forked else b"started",
    )
    for attempt in range(1, ATTEMPTS + 1):
        conn = ensure_worker(state_dir, cid, watch=node_process)
        try:
            with conn:
                send_frames(conn, *request)
                status, *reply = recv_frames(conn)
            break
        except (ConnectionError, OSError):  # the worker died under this message: start it again
            if attempt == ATTEMPTS:
                raise WorkerError(
                    f"client {cid}: its worker died {ATTEMPTS} times while handling one message "
                    f"(log: {worker_files(state_dir, cid)['log']})"
                ) from None
    if status != OK:
        raise WorkerError(reply[0].decode(errors="replace"))
    content, state = (recorddict_from_proto(_parse(frame)) for frame in reply)
    context.state = state
    return Message(content, reply_to=message)


def _parse(frame: bytes) -> ProtoRecordDict:
    proto = ProtoRecordDict()
    proto.ParseFromString(frame)
    return proto


def encode_reply(reply: Message, context: Context) -> list[bytes]:
    """The worker's side of :func:`relay`: a reply's content and the context state."""
    return [OK, *(recorddict_to_proto(r).SerializeToString() for r in (reply.content, context.state))]


@client_app.query()
def roll_call(message: Message, context: Context) -> Message:
    return relay(message, context)


@client_app.train()
def train(message: Message, context: Context) -> Message:
    return relay(message, context)


@client_app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    return relay(message, context)
