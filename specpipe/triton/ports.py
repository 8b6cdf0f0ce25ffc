"""Who listens on a TCP port, read from /proc (Linux): a server about to start names what holds its port,
instead of trusting whatever answers there or dying seconds later with "Address already in use"."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

LISTEN = "0A"  # TCP state in /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    """A socket listening on `port`, and the process that holds it (None: one this user cannot see)."""

    port: int
    address: str
    pid: Optional[int]
    command: str

    def describe(self) -> str:
        if self.pid is None:
            return f"a process this user cannot see (listening on {self.address}:{self.port})"
        command = " ".join(self.command.split())  # one line, whatever the command line holds
        command = command if len(command) <= 120 else command[:117] + "..."
        return f"pid {self.pid} ({command})"


def listeners(port: int, host: str = "127.0.0.1") -> list[Listener]:
    """The sockets that would stop a server binding `host:port`: those listening on that port at `host`'s
    address or at a wildcard address (any address, when `host` is itself a wildcard)."""
    ours = _address(host)
    sockets = {inode: address for inode, address in _listening(port)
               if ours is None or address.is_unspecified or ours.is_unspecified or _same(address, ours)}
    if not sockets:
        return []
    held = _holders(set(sockets))
    return [Listener(port, str(address), *held.get(inode, (None, ""))) for inode, address in sockets.items()]


def _listening(port: int) -> list[tuple[int, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address_hex, port_hex = fields[1].split(":")
            if fields[3] == LISTEN and int(port_hex, 16) == port:
                # /proc writes each 32-bit word of the address in host (little-endian) byte order
                raw = b"".join(bytes.fromhex(address_hex[i:i + 8])[::-1] for i in range(0, len(address_hex), 8))
                found.append((int(fields[9]), ipaddress.ip_address(raw) if len(raw) == width else None))
    return [(inode, address) for inode, address in found if address is not None]


def _holders(inodes: set[int]) -> dict[int, tuple[int, str]]:
    """inode -> (pid, command line) of a process with that socket open."""
    held: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed since it was listed
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                held.setdefault(int(link[8:-1]), (int(entry.name), _cmdline(int(entry.name))))
    return held


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").strip()
    except OSError:
        return ""


def _address(host: str):
    if host in ("", "0.0.0.0", "::"):
        return ipaddress.ip_address("0.0.0.0")
    try:
        return ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None  # cannot tell: every listener on the port counts


def _same(a, b) -> bool:
    mapped = lambda x: x.ipv4_mapped if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped else x  # noqa: E731
    return mapped(a) == mapped(b)
