"""Processes and sockets as /proc shows them (no psutil here): children of a process, its command line,
and which process holds the server end of a TCP connection."""

from __future__ import annotations

import http.client
import os
import signal
from pathlib import Path


def children(pid: int) -> list[int]:
    """Every process whose parent is ``pid`` (task/*/children would miss those a thread started)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def tree(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out += [child, *tree(child)]
    return out


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def owner(conn: http.client.HTTPConnection, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the server end of ``conn`` (its socket inode, from /proc/net/tcp)."""
    client_port = conn.sock.getsockname()[1]
    server_port = conn.sock.getpeername()[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, remote, inode = f[1], f[2], f[9]
            if int(local.rsplit(":", 1)[1], 16) == server_port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                inodes.add(f"socket:[{inode}]")
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None
