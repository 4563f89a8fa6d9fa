"""Faults for the S3 tests: a moto server that can be killed and started again on its port, and
a small TCP proxy on 127.0.0.1 that drops connections after a random number of bytes.

Both stop by themselves: the proxy drops at most ``max_drops`` connections (then it forwards
every byte), its threads end when it is closed, and each socket has a timeout."""

from __future__ import annotations

import random
import socket
import struct
import threading
from typing import Any

__all__ = ["DroppingProxy", "MotoServer", "fast_client"]


class MotoServer:
    """moto's threaded server on a fixed port of 127.0.0.1: ``stop()`` kills it (connections
    are refused), ``start()`` brings it back on the same port with the same buckets (moto keeps
    them per process)."""

    def __init__(self) -> None:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.server: Any = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def fast_client(endpoint: str) -> dict[str, Any]:
    """``storage_options`` for ``endpoint`` with botocore's own retries off and short timeouts,
    so a dead endpoint fails in about a second and hookscope's retries are the ones counted."""
    return {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True,
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2,
                              "read_timeout": 5}}


class DroppingProxy:
    """Forward 127.0.0.1:``port`` to 127.0.0.1:``upstream``; each new connection is, with
    probability ``rate`` (seeded), reset after a random number of bytes (both directions
    counted, 0 to ``max_bytes``), until ``max_drops`` connections were dropped."""

    def __init__(self, upstream: int, *, rate: float, seed: int, max_drops: int,
                 max_bytes: int = 6000):
        self.upstream, self.rate, self.max_drops, self.max_bytes = upstream, rate, max_drops, max_bytes
        self.rng, self.drops, self.connections = random.Random(seed), 0, 0
        self.lock, self.closed = threading.Lock(), False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.closed = True
        self.thread.join(timeout=5)
        self.listener.close()

    def __enter__(self) -> DroppingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.connections += 1
                drop = self.drops < self.max_drops and self.rng.random() < self.rate
                cut = self.rng.randrange(self.max_bytes) if drop else -1
                self.drops += drop
            threading.Thread(target=self._serve, args=(client, cut), daemon=True).start()

    def _serve(self, client: socket.socket, cut: int) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
        except OSError:
            _reset(client)
            return
        client.settimeout(30)
        left = [cut]  # bytes still to forward before the reset (-1: never)
        lock = threading.Lock()

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    with lock:
                        if left[0] >= 0:
                            data = data[:left[0]]
                            left[0] -= len(data)
                    if data:
                        dst.sendall(data)
                    if left[0] == 0:
                        break
            except OSError:
                pass
            _reset(client)
            _reset(upstream)

        other = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        other.start()
        pump(client, upstream)
        other.join(timeout=30)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (linger 0): the peer sees the connection dropped."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
