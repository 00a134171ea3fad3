"""A node's long-lived worker: it runs fedpeft's client (:mod:`fedpeft.flower.apps`) on the
messages the node's ClientApp processes hand it (:mod:`fedpeft.flower.relay`).

It is one process per node, started by the node's first message and serving a Unix
socket that only the node's user can open. It keeps what the per-message ClientApp
process would rebuild every time: torch and fedpeft imported, the model built, the data
encoded, the personal state in memory (and on disk, as before, after every local round).
It handles one message at a time, in order, and stops when the node's process is gone.

Its status file (``worker-<cid>.json`` beside the node's state) says what it does and has
done: its pid, how many workers this node has started (``starts``), the messages handled
(and of them, those whose ClientApp process was forked warm by
:mod:`fedpeft.flower.superexec`) and the models built in this worker's life, and the
message in hand (``handling``).

    python -m fedpeft.flower.worker --socket PATH --status PATH --watch PID
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
import traceback
from pathlib import Path

from flwr.common.serde import context_from_proto, message_from_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=E0611
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611

from fedpeft.flower import apps
from fedpeft.flower.node import Node
from fedpeft.flower.relay import FAILED, WorkerError, encode_reply, private_folder, recv_frames, send_frames

WATCH_SECONDS = 1.0  # how often the worker checks that its node is still there


class Worker:
    def __init__(self, sock: Path, status: Path, watch: int):
        self.sock, self.status_path, self.watch = sock, status, watch
        previous = json.loads(status.read_text()) if status.is_file() else {}
        self.status = {
            "pid": os.getpid(),
            "starts": int(previous.get("starts", 0)) + 1,
            "started": time.time(),
            "messages": 0,
            "messages_forked": 0,  # of them, handed over by a ClientApp forked warm
            "models_built": 0,
            "handling": None,  # the type of the message in hand
        }
        self.write_status()

    def write_status(self) -> None:
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.status, indent=1) + "\n")
        os.replace(tmp, self.status_path)

    def handle(self, frames: list[bytes]) -> list[bytes]:
        """One message through fedpeft's ClientApp (its frames: the message, the node's
        context, the node's process id, how its ClientApp process started): the reply's
        frames, or the error's."""
        proto_msg, proto_ctx = ProtoMessage(), ProtoContext()
        proto_msg.ParseFromString(frames[0])
        proto_ctx.ParseFromString(frames[1])
        message, context = message_from_proto(proto_msg), context_from_proto(proto_ctx)
        self.watch = int(frames[2])  # the process of the node that sent it
        built = Node.models_built
        self.status["handling"] = message.metadata.message_type
        self.write_status()
        try:
            reply = apps.client_app(message=message, context=context)
            if reply.has_error():
                raise RuntimeError(f"error {reply.error.code}: {reply.error.reason}")
            answer = encode_reply(reply, context)
        except Exception as err:  # noqa: BLE001 - the node's reply says what failed
            traceback.print_exc()
            answer = [FAILED, f"{type(err).__name__}: {err}".encode()]
        self.status["messages"] += 1
        self.status["messages_forked"] += frames[3:4] == [b"forked"]
        self.status["models_built"] += Node.models_built - built
        self.status["handling"] = None
        self.write_status()
        return answer

    def serve(self) -> None:
        self.sock.unlink(missing_ok=True)  # a socket left by a worker that was killed
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file: read and write for this user only
        try:
            server.bind(str(self.sock))
        finally:
            os.umask(old)
        server.listen(4)
        threading.Thread(target=self._watch, daemon=True).start()
        print(f"worker {os.getpid()} serving {self.sock}", flush=True)
        with server:
            while True:
                conn, _ = server.accept()
                with conn:
                    try:
                        frames = recv_frames(conn)
                        send_frames(conn, *self.handle(frames))
                    except (ConnectionError, OSError) as err:  # the message's process went away
                        print(f"a message's connection broke: {err}", flush=True)

    def _watch(self) -> None:
        """Exit once the node's process is gone (everything worth keeping is on disk:
        every file is written whole, then moved into place)."""
        while _alive(self.watch):
            time.sleep(WATCH_SECONDS)
        print(f"the node's process {self.watch} is gone; stopping", flush=True)
        self.sock.unlink(missing_ok=True)
        os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--status", type=Path, required=True)
    parser.add_argument("--watch", type=int, required=True, help="the node's process: stop when it is gone")
    args = parser.parse_args(argv)
    if args.socket.parent.resolve() != args.status.parent.resolve():  # the sockets' folder in the temp dir
        try:
            private_folder(args.socket.parent)  # the relay checked it too; a worker started by hand did not
        except WorkerError as err:
            raise SystemExit(f"error: {err}") from None
    Worker(args.socket, args.status, args.watch).serve()


if __name__ == "__main__":
    main()
