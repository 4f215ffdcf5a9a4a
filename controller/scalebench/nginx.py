"""A throw-away nginx on loopback: the host's reference server for zipfperf's tests, the
benchmarks and the nightly's host probe.

Runs Debian's nginx as a non-daemon with its own temporary prefix and config:
one worker (or more), access_log off, listening on 127.0.0.1 and on extra
addresses from 127.1.0.0 (or another base) on, serving the 2,258-byte object
at `/` and the 134,007-byte object at `/large`. Never binds anything outside
127.0.0.0/8.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SMALL_BYTES = 2258
LARGE_BYTES = 134007

_CONFIG = """\
daemon off;
master_process on;
worker_processes {workers};
worker_rlimit_nofile 65536;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log error;
events {{ worker_connections 32768; }}
http {{
    access_log off;
    default_type application/octet-stream;
    keepalive_requests 1000000;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
{listens}
        root {prefix}/html;
        location = / {{ try_files /index.html =404; }}
    }}
}}
"""


def _object(size: int) -> bytes:
    """Deterministic printable bytes of the given size."""
    line = b"zipfperf test object 0123456789abcdefghijklmnopqrstuvwxyz\n"
    return (line * (size // len(line) + 1))[:size]


class NginxServer:
    """nginx listening on `port` at 127.0.0.1 and addr_base + i for i < extra_targets."""

    def __init__(
        self,
        port: int,
        extra_targets: int = 0,
        nginx: str = "nginx",
        workers: int = 1,
        addr_base: str = "127.1.0.0",
    ) -> None:
        self.port = port
        base = ipaddress.IPv4Address(addr_base)
        if base not in ipaddress.IPv4Network(
            "127.0.0.0/8"
        ) or base + extra_targets not in ipaddress.IPv4Network("127.0.0.0/8"):
            raise ValueError(f"{extra_targets} addresses from {addr_base} leave 127.0.0.0/8")
        self.addresses = ["127.0.0.1"] + [str(base + i) for i in range(extra_targets)]
        self.nginx = nginx
        self.workers = workers
        self.prefix = Path(tempfile.mkdtemp(prefix="zipfperf-nginx-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> NginxServer:
        self.prefix.chmod(0o755)
        html = self.prefix / "html"
        html.mkdir()
        (html / "index.html").write_bytes(_object(SMALL_BYTES))
        (html / "large").write_bytes(_object(LARGE_BYTES))
        listens = "\n".join(
            f"        listen {addr}:{self.port} backlog=4096;" for addr in self.addresses
        )
        conf = self.prefix / "nginx.conf"
        conf.write_text(_CONFIG.format(prefix=self.prefix, listens=listens, workers=self.workers))
        self.proc = subprocess.Popen(
            [
                self.nginx,
                "-p",
                str(self.prefix),
                "-c",
                str(conf),
                "-e",
                str(self.prefix / "error.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10 + len(self.addresses) / 200
        while time.monotonic() < deadline:
            answering = all(self._answers(addr) for addr in self.addresses)
            # Checked after the probe: another server on the same port must not pass for ours.
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                shutil.rmtree(self.prefix, ignore_errors=True)
                raise RuntimeError(f"nginx exited at start: {err.strip()}")
            if answering:
                time.sleep(0.1)
                if self.proc.poll() is None:
                    return self
            else:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("nginx did not start listening within 10 s")

    def _answers(self, addr: str) -> bool:
        try:
            with socket.create_connection((addr, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        """Stop nginx (SIGTERM, then SIGKILL) and remove its prefix."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.prefix, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.stop()
