#!/usr/bin/env python3
"""Acceptance figures of densevm + webguest (issue: thousands of microVMs).

1. Boot N VMs (default 4,000): seconds and VMs/s; every VM answers GET /
   with the exact 2,258 bytes.
2. Host memory per booted idle VM, kernel and monitor, excluding the guests'
   own resident pages: (MemAvailable before - after - guest RAM resident) / N.
3. Native execution: KVM's insn_emulation and exits per request on one VM
   under wrk load (KVM binary stats through densevm --vcpu-stats).
4. One VM's keep-alive throughput under wrk (1 thread, 32 connections) against
   nginx (1 worker) serving the same bytes, interleaved rounds, same run.

Usage: experiments/bench/densevm_acceptance.py [--vms 4000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import Build, Session  # noqa: E402
from scalebench.webobject import SMALL  # noqa: E402

BUILD = Build(ROOT / "target" / "release" / "densevm", ROOT / "target" / "release" / "zipfperf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(addr: str, port: int) -> bytes:
    with socket.create_connection((addr, port), timeout=30) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return body if head.startswith(b"HTTP/1.1 200") else b""


def vm_addr(base: str, i: int) -> str:
    a, b, c, d = (int(x) for x in base.split("."))
    n = (a << 24 | b << 16 | c << 8 | d) + i
    return ".".join(str((n >> s) & 255) for s in (24, 16, 8, 0))


def boot_and_memory(workdir: Path, vms: int) -> dict:
    with Session(BUILD, workdir, vms, "127.1.0.0") as dv:
        boot = dv.boot
        with ThreadPoolExecutor(64) as pool:
            bodies = list(pool.map(lambda i: http_get(vm_addr("127.1.0.0", i), 8080), range(vms)))
        exact = sum(body == SMALL for body in bodies)
        shutdown = dv.stop()
    return {
        "vms": vms,
        "boot_seconds": boot.boot_seconds,
        "vms_per_second": vms / boot.boot_seconds,
        "exact_answers": exact,
        "memavailable_drop_bytes": boot.memavailable_drop_bytes,
        "guest_ram_resident_bytes": boot.guest_ram_resident_bytes,
        "host_bytes_per_idle_vm": boot.host_bytes_per_vm,
        "shutdown_seconds": shutdown,
        "platform": boot.platform,
    }


def wrk(url: str, seconds: int) -> float:
    out = subprocess.run(
        ["wrk", "-t1", "-c32", f"-d{seconds}s", url], capture_output=True, text=True, check=True
    ).stdout
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def native_execution(workdir: Path) -> dict:
    with Session(BUILD, workdir, 1, "127.1.0.0", "--vcpu-stats") as dv:
        before = dv.stats(per_vm=True)["vms"][0]
        wrk("http://127.1.0.0:8080/", 5)
        after = dv.stats(per_vm=True)["vms"][0]
    requests = after["requests"] - before["requests"]
    delta = {
        k: after["kvm"][k] - before["kvm"][k]
        for k in ("insn_emulation", "exits", "halt_exits", "irq_injections")
    }
    return {"requests": requests, **{f"{k}_per_request": v / requests for k, v in delta.items()}}


def throughput(workdir: Path, rounds: int, seconds: int) -> dict:
    www = workdir / "www"
    www.mkdir(exist_ok=True)
    (www / "index.html").write_bytes(SMALL)
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(f"""worker_processes 1; daemon off;
pid {workdir}/nginx.pid; error_log {workdir}/nginx.err;
events {{ worker_connections 1024; }}
http {{ access_log off; keepalive_requests 10000000;
  server {{ listen 127.0.0.1:{port}; root {www}; }} }}
""")
    nginx = subprocess.Popen(["nginx", "-c", str(conf)], stderr=subprocess.DEVNULL)
    try:
        with Session(BUILD, workdir, 1, "127.1.0.0"):
            time.sleep(0.5)
            nginx_rps, vm_rps = [], []
            for _ in range(rounds):
                nginx_rps.append(wrk(f"http://127.0.0.1:{port}/", seconds))
                vm_rps.append(wrk("http://127.1.0.0:8080/", seconds))
    finally:
        nginx.terminate()
        nginx.wait(10)
    return {
        "nginx_rps": nginx_rps,
        "densevm_rps": vm_rps,
        "ratio_median": statistics.median(v / n for v, n in zip(vm_rps, nginx_rps, strict=False)),
    }


def main() -> None:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for tool in ("wrk", "nginx"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (make deps)")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        boot = boot_and_memory(workdir, args.vms)
        print(
            f"boot: {boot['vms']} VMs in {boot['boot_seconds']:.2f} s "
            f"({boot['vms_per_second']:.0f} VMs/s) on {boot['platform']}; "
            f"{boot['exact_answers']}/{boot['vms']} answered GET / with the exact {len(SMALL)} "
            "bytes; "
            f"shutdown {boot['shutdown_seconds']:.1f} s"
        )
        print(
            f"memory: MemAvailable fell {boot['memavailable_drop_bytes'] / 2**20:.0f} MiB, guest "
            "RAM resident "
            f"{boot['guest_ram_resident_bytes'] / 2**20:.0f} MiB -> "
            f"{boot['host_bytes_per_idle_vm'] / 2**20:.3f} MiB "
            f"of kernel + monitor memory per idle VM"
        )
        native = native_execution(workdir)
        print(
            f"native: {native['requests']} requests, {native['insn_emulation_per_request']:.3f} "
            "emulated instructions, "
            f"{native['exits_per_request']:.3f} exits, {native['halt_exits_per_request']:.3f} "
            "halts per request"
        )
        tput = throughput(workdir, args.rounds, args.seconds)
        print(
            "throughput (wrk -t1 -c32, 2,258 B): "
            + ", ".join(
                f"nginx {n:.0f} / densevm {v:.0f}"
                for n, v in zip(tput["nginx_rps"], tput["densevm_rps"], strict=False)
            )
            + f" -> ratio {tput['ratio_median']:.2f} (median)"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"boot": boot, "native": native, "throughput": tput}, indent=2)
        )


if __name__ == "__main__":
    main()
