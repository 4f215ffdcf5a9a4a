"""Start a real densevm for a test, talk HTTP/1.1 to its VMs, stop it."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import release_binary
from scalebench.densevm import control


def wait_for(predicate, timeout: float = 20) -> bool:
    """Polls `predicate` until it holds or `timeout` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def kvm_available() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


@dataclass
class Monitor:
    """A densevm process with its VMs at addr_base + i."""

    proc: subprocess.Popen
    api: Path
    addr_base: str
    port: int
    ready: dict
    stderr_path: Path

    def addr(self, vm: int) -> tuple[str, int]:
        return str(ipaddress.IPv4Address(self.addr_base) + vm), self.port

    def control(self, request: dict) -> dict:
        return control(self.api, request)

    def raw_control(self, line: bytes) -> dict:
        """Sends one raw line and returns the reply, whatever it says."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(self.api))
            s.sendall(line)
            return json.loads(s.makefile("rb").readline())

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def start(
    tmp_path: Path, vms: int, addr_base: str, *extra: str, port: int = 8080, timeout: float = 60
) -> Monitor:
    api = tmp_path / "densevm.sock"
    stderr_path = tmp_path / "densevm.err"
    argv = [
        str(release_binary("densevm")),
        "serve",
        "--vms",
        str(vms),
        "--addr-base",
        addr_base,
        "--port",
        str(port),
        "--api",
        str(api),
        *extra,
    ]
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, cwd=tmp_path)
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    if not line or time.monotonic() > deadline:
        proc.kill()
        raise AssertionError(f"densevm did not become ready: {stderr_path.read_text()}")
    return Monitor(proc, api, addr_base, port, json.loads(line), stderr_path)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = field(repr=False)


class HttpClient:
    """A blocking HTTP/1.x client over one TCP connection, for exact-byte checks."""

    def __init__(self, addr: tuple[str, int], timeout: float = 10):
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 16)
        self.buf += chunk
        return bool(chunk)

    def response(self, head: bool = False) -> Response:
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError(f"connection closed mid-header: {self.buf[:200]!r}")
        header, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
        length = 0 if head else int(headers["content-length"])
        while len(self.buf) < length:
            if not self._fill():
                raise ConnectionError("connection closed mid-body")
        body, self.buf = self.buf[:length], self.buf[length:]
        return Response(status, headers, body)

    def closed_by_peer(self) -> bool:
        """True when the server has closed (EOF after any buffered bytes)."""
        try:
            return not self._fill()
        except (TimeoutError, ConnectionResetError):
            return False

    def close(self) -> None:
        self.sock.close()


def get(addr: tuple[str, int], path: str = "/") -> Response:
    client = HttpClient(addr)
    try:
        client.send(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        return client.response()
    finally:
        client.close()


def fd_targets(pids: list[int]) -> list[str]:
    """What every descriptor of the processes `pids` points at (`socket:[123]`,
    `anon_inode:kvm-vm`, a path); processes and descriptors gone meanwhile are skipped."""
    targets = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except FileNotFoundError:
                continue
    return targets
