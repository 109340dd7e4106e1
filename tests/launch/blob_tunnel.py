"""An HTTP CONNECT proxy (``HTTPS_PROXY``) that sends every tunnel for ``*.blob.core.windows.net`` to one local
port: an Azurite serving TLS. azure-ai-ml builds storage URLs as ``https://{account}.blob.core.windows.net``
from a datastore's account name, with no endpoint override, so this is how its datastore path reaches the
emulator. TLS stays end to end (the client checks Azurite's certificate for the account's host name) and
Azurite reads the account from the Host header (its "production-style URL"). Bytes are relayed unchanged.
"""

from __future__ import annotations

import socket
import threading

SUFFIX = ".blob.core.windows.net"


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class BlobTunnel:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.hosts: list[str] = []  # every host a tunnel was asked for
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.threads: list[threading.Thread] = []
        self.open: list[socket.socket] = []  # tunnels' sockets: pooled connections keep them open
        self.accepter = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self) -> "BlobTunnel":
        self.accepter.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s in [self.sock, *self.open]:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()/recv(), which close() alone does not
            except OSError:
                pass
        self.sock.close()
        self.accepter.join(timeout=10)
        for t in self.threads:
            t.join(timeout=10)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                conn.close()
                return
            head += chunk
        method, target, *_ = head.split(b"\r\n", 1)[0].decode().split()
        host = target.rsplit(":", 1)[0]
        self.hosts.append(host)
        if method != "CONNECT" or not host.endswith(SUFFIX):
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            conn.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        self.open += [conn, upstream]
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
        back.start()
        _pipe(conn, upstream)
        back.join(timeout=30)
        conn.close()
        upstream.close()
