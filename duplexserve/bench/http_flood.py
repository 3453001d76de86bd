"""Keep-alive connections pipelining ``GET /health``, beside another run (issue 67, item 1).

``duplexserve bench http-flood --port 18990 --wait-s 20 --seconds 30``

The attack that stalled every session before the HTTP budgets (server/http_budgets.py): each
connection writes 32 requests at a time as fast as the socket takes them and reads whatever
comes back; a connection the server closes is opened again at once. It binds to ``--source``
(127.0.0.2 by default: on loopback, an address of its own, so that the budgets of the address
it floods from are not those of the sessions measured beside it). It waits for the port to
accept, then ``--wait-s`` more (the sessions beside it ramping up), floods for ``--seconds``,
and prints (and writes to ``--out``) how many connections it opened and requests it sent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
import time

from duplexserve.bench.attacks import Threads

PIPELINED = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" * 32


class Pipeliner(Threads):
    """``connections`` threads, each a connection from ``source`` pipelining :data:`PIPELINED`,
    reconnected whenever closed, until the ``with`` block ends."""

    def __init__(self, port: int, source: str, connections: int = 2, host: str = "127.0.0.1") -> None:
        super().__init__(connections)
        self.host, self.port, self.source = host, port, source
        self.connects = self.requests = 0

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            sock = socket.socket()
            try:
                sock.bind((self.source, 0))
                sock.connect((self.host, self.port))
                self.connects += 1
                threading.Thread(target=_drain, args=(sock,), daemon=True).start()
                while not self._stop.is_set():
                    sock.sendall(PIPELINED)
                    self.requests += 32
            except OSError:
                time.sleep(0.01)  # refused or reset: connect again
            finally:
                sock.close()


def _drain(sock: socket.socket) -> None:
    """Read the answers, so that they never hold the sender back."""
    with contextlib.suppress(OSError):
        while sock.recv(1 << 16):
            pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18990, help="the server's (bench moshi-rtf's default)")
    p.add_argument("--source", default="127.0.0.2", help="the address to flood from")
    p.add_argument("--connections", type=int, default=2)
    p.add_argument("--wait-s", type=float, default=0.0, help="once the port accepts, wait this long")
    p.add_argument("--seconds", type=float, default=30.0, help="how long to flood")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="give up if the port never accepts")
    p.add_argument("--out", default="", help="write the counts as JSON here")


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.start_timeout_s
    while True:
        try:
            socket.create_connection((args.host, args.port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                print(f"http-flood: {args.host}:{args.port} never accepted")
                return 1
            time.sleep(0.5)
    time.sleep(args.wait_s)
    began = time.monotonic()
    with Pipeliner(args.port, args.source, args.connections, args.host) as flood:
        time.sleep(args.seconds)
    result = {"connections": args.connections, "seconds": time.monotonic() - began,
              "connects": flood.connects, "requests_sent": flood.requests}  # fmt: skip
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0
