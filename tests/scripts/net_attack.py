"""A hostile host (issue 38), run on a namespace host that is not part of the job.

``flood N SECONDS HOST:PORT...``: opens up to N idle connections, round robin over the
targets, sends a malformed request (``Content-Length: -5``) on every tenth, holds them
for SECONDS; prints ``held K`` (and why it stopped opening, if it did).
``poison HOST:PORT...``: as a torch ``TCPStore`` client, tries to set a key in each
store; prints ``set PORT`` or ``refused PORT: ...`` per target.
"""

from __future__ import annotations

import resource
import socket
import sys
import time


def targets(args: list[str]) -> list[tuple[str, int]]:
    return [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in args]


def flood(count: int, seconds: float, to: list[tuple[str, int]]) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    why = ""
    for i in range(count):
        try:
            sock = socket.create_connection(to[i % len(to)], timeout=5)
            if i % 10 == 0:
                sock.sendall(b"POST /report/x HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
            held.append(sock)
        except OSError as exc:
            why = f" (stopped opening: {exc})"
            break
    print(f"held {len(held)}{why}", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # reopen what the servers close: keep the pressure
        time.sleep(1.0)
        for n, sock in enumerate(held):
            sock.setblocking(False)
            try:
                if sock.recv(1) == b"":
                    raise ConnectionResetError
            except BlockingIOError:
                continue
            except OSError:
                sock.close()
                try:
                    held[n] = socket.create_connection(to[n % len(to)], timeout=1)
                except OSError:
                    held[n] = socket.socket()
    print("flood over", flush=True)


def poison(to: list[tuple[str, int]]) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    for host, port in to:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
            store.set("poison", "x" * 64)
            print(f"set {port}", flush=True)
        except Exception as exc:
            print(f"refused {port}: {str(exc).splitlines()[0][:120]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "flood":
        flood(int(sys.argv[2]), float(sys.argv[3]), targets(sys.argv[4:]))
    else:
        poison(targets(sys.argv[2:]))
