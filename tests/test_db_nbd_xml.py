"""Domain XML, and our NBD server driven by QEMU's own NBD client (qemu-io): COW, trace, model."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "controller"))

from scalebench.db.diskmodel import Hdd15k, NoDisk
from scalebench.db.domain import DomainSpec
from scalebench.db.guest import DbGuest, GuestConfig
from scalebench.db.image import GuestImage
from scalebench.db.nbd import NbdServer

QEMU_NS = "{http://libvirt.org/schemas/domain/qemu/1.0}"


def spec(**kw: object) -> DomainSpec:
    base = dict(
        name="sb-test",
        domain_type="qemu",
        memory_mib=256,
        kernel=Path("/k/vmlinuz"),
        initrd=Path("/k/initrd.img"),
        console_log=Path("/r/console.log"),
        host_port=40123,
        nbd_socket=Path("/r/disk.sock"),
    )
    base.update(kw)
    return DomainSpec(**base)  # type: ignore[arg-type]


def test_xml_nbd_disk_network_and_boot() -> None:
    root = ET.fromstring(spec().to_xml())
    assert root.get("type") == "qemu"
    assert root.findtext("memory") == "256" and root.find("memory").get("unit") == "MiB"
    assert root.findtext("os/kernel") == "/k/vmlinuz"
    assert "init=/sbin/sbinit" in root.findtext("os/cmdline")
    assert root.find("features/acpi") is not None
    disk = root.find("devices/disk")
    assert disk.get("type") == "network"
    assert disk.find("source").get("protocol") == "nbd"
    assert disk.find("source/host").get("socket") == "/r/disk.sock"
    assert disk.find("target").get("bus") == "virtio"
    args = [a.get("value") for a in root.find(f"{QEMU_NS}commandline")]
    netdev = args[args.index("-netdev") + 1]
    assert "restrict=on" in netdev and "hostfwd=tcp:127.0.0.1:40123-10.0.2.15:5432" in netdev
    assert root.find("devices/serial/source").get("path") == "/r/console.log"


def test_the_database_memory_cap_reaches_the_guest_kernel_command_line() -> None:
    capped = ET.fromstring(spec(db_cache_mib=4).to_xml()).findtext("os/cmdline")
    assert f"scalebench.db_cache_max={4 << 20}" in capped.split()
    assert "db_cache_max" not in ET.fromstring(spec().to_xml()).findtext("os/cmdline")


def test_xml_qcow2_disk_and_kvm() -> None:
    root = ET.fromstring(
        spec(domain_type="kvm", nbd_socket=None, qcow2_overlay=Path("/r/o.qcow2")).to_xml()
    )
    assert root.get("type") == "kvm"
    disk = root.find("devices/disk")
    assert disk.get("type") == "file" and disk.find("driver").get("type") == "qcow2"
    assert disk.find("source").get("file") == "/r/o.qcow2"


def test_xml_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="exactly one disk"):
        spec(qcow2_overlay=Path("/r/o.qcow2"))
    with pytest.raises(ValueError, match="kvm or qemu"):
        spec(domain_type="xen")


def test_paths_handed_to_libvirt_are_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libvirtd starts QEMU in its own working directory: a relative run directory
    # (dbtrace --out runs/x) must not reach the domain XML as a relative path.
    monkeypatch.chdir(tmp_path)
    image = GuestImage("/k/vmlinuz", "/k/initrd.img", "/k/rootfs.img", "key", ("tpcc",), 1, 1.0)
    guest = DbGuest(GuestConfig(image=image, run_dir=Path("runs/x"), domain_type="qemu"), conn=None)
    assert guest.config.run_dir == tmp_path / "runs" / "x"
    assert guest.console_log.is_absolute() and guest.console_log.parent == tmp_path / "runs" / "x"


def test_xml_escapes_paths() -> None:
    root = ET.fromstring(spec(nbd_socket=Path("/r/a'b&c.sock")).to_xml())
    assert root.find("devices/disk/source/host").get("socket") == "/r/a'b&c.sock"


def _qemu_io(sock: Path, *commands: str) -> str:
    args = ["qemu-io", "-f", "raw"]
    for command in commands:
        args += ["-c", command]
    proc = subprocess.run(
        [*args, f"nbd+unix:///?socket={sock}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def base_image(tmp_path: Path) -> Path:
    if shutil.which("qemu-io") is None:
        pytest.skip("qemu-io (qemu-utils) is not installed")
    base = tmp_path / "base.img"
    base.write_bytes(bytes([0xAB]) * (1 << 20))
    base.chmod(0o444)
    return base


def _serve(tmp_path: Path, base: Path, model: object) -> NbdServer:
    return NbdServer(tmp_path / "nbd.sock", base, tmp_path / "overlay", model)  # type: ignore[arg-type]


def test_nbd_copy_on_write_and_trace(tmp_path: Path, base_image: Path) -> None:
    before = base_image.read_bytes()
    server = _serve(tmp_path, base_image, NoDisk())
    try:
        out = _qemu_io(
            server.socket_path,
            "write -P 0x5a 4608 1024",
            "read -P 0x5a 4608 1024",
            "read -P 0xab 0 4608",
            "read -P 0xab 5632 2560",
            "flush",
        )
        assert "Pattern verification failed" not in out
        time.sleep(0.2)
    finally:
        server.stop()
    assert base_image.read_bytes() == before  # the base image is never written
    ops = [(r.op, r.lba, r.sectors) for r in server.records]
    assert ("W", 9, 2) in ops and ("R", 9, 2) in ops and ("F", 0, 0) in ops
    assert all(r.latency >= 0 for r in server.records)
    assert not (tmp_path / "nbd.sock").exists()


def test_nbd_applies_the_disk_model(tmp_path: Path, base_image: Path) -> None:
    server = _serve(tmp_path, base_image, Hdd15k())
    try:
        # Random single-sector reads: each pays at least half a rotation (2 ms) on the
        # modelled disk.
        _qemu_io(
            server.socket_path,
            *[f"read {off} 512" for off in (0, 600 * 512, 200 * 512, 1400 * 512, 100 * 512)],
        )
        time.sleep(0.2)
    finally:
        server.stop()
    reads = [r for r in server.records if r.op == "R" and r.sectors == 1]
    assert len(reads) == 5
    assert min(r.latency for r in reads) >= 0.0019
