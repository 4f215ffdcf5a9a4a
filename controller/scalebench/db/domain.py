"""Libvirt domain XML for the database guest, and the choice of domain type."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import quoteattr

GUEST_ADDR = "10.0.2.15"
GUEST_DB_PORT = 5432
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"


def is_pvm_host() -> bool:
    """True when /dev/kvm is provided by kvm_pvm (stock kernels cannot run natively there)."""
    return Path("/sys/module/kvm_pvm").exists()


def pick_domain_type() -> str:
    """``kvm`` where guests run natively, ``qemu`` (TCG) otherwise (docs/host-facts.md).

    ``SCALEBENCH_DOMAIN_TYPE`` overrides the choice.
    """
    forced = os.environ.get("SCALEBENCH_DOMAIN_TYPE")
    if forced in ("kvm", "qemu"):
        return forced
    if os.access("/dev/kvm", os.R_OK | os.W_OK) and not is_pvm_host():
        return "kvm"
    return "qemu"


@dataclass(frozen=True)
class DomainSpec:
    """Everything the domain XML depends on."""

    name: str
    domain_type: str
    memory_mib: int
    kernel: Path
    initrd: Path
    console_log: Path
    host_port: int
    nbd_socket: Path | None = None  # the traced path: our NBD server
    qcow2_overlay: Path | None = None  # the untraced path: QEMU opens the overlay itself
    vcpus: int = 1
    db_cache_mib: int | None = None  # the page cache the server's files keep (sbinit.sh); None: any
    base_cmdline: str = "console=ttyS0 root=/dev/vda rw init=/sbin/sbinit quiet panic=-1"

    @property
    def cmdline(self) -> str:
        if self.db_cache_mib is None:
            return self.base_cmdline
        return f"{self.base_cmdline} scalebench.db_cache_max={self.db_cache_mib << 20}"

    def __post_init__(self) -> None:
        if (self.nbd_socket is None) == (self.qcow2_overlay is None):
            raise ValueError("a domain needs exactly one disk: an NBD socket or a qcow2 overlay")
        if self.domain_type not in ("kvm", "qemu"):
            raise ValueError(f"domain type must be kvm or qemu, not {self.domain_type!r}")

    def disk_xml(self) -> str:
        if self.nbd_socket is not None:
            return (
                "<disk type='network' device='disk'><driver name='qemu' type='raw'/>"
                "<source protocol='nbd'><host transport='unix' "
                f"socket={quoteattr(str(self.nbd_socket))}/>"
                "</source><target dev='vda' bus='virtio'/></disk>"
            )
        return (
            "<disk type='file' device='disk'><driver name='qemu' type='qcow2'/>"
            f"<source file={quoteattr(str(self.qcow2_overlay))}/><target dev='vda' "
            "bus='virtio'/></disk>"
        )

    def netdev(self) -> str:
        """User-mode network, restricted to the host: only the port forward reaches the guest."""
        return (
            f"user,id=sbnet0,net=10.0.2.0/24,restrict=on,"
            f"hostfwd=tcp:127.0.0.1:{self.host_port}-{GUEST_ADDR}:{GUEST_DB_PORT}"
        )

    def to_xml(self) -> str:
        return f"""<domain type='{self.domain_type}' xmlns:qemu='{QEMU_NS}'>
  <name>{self.name}</name>
  <memory unit='MiB'>{self.memory_mib}</memory>
  <vcpu>{self.vcpus}</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{self.kernel}</kernel>
    <initrd>{self.initrd}</initrd>
    <cmdline>{self.cmdline}</cmdline>
  </os>
  <features><acpi/></features>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    {self.disk_xml()}
    <serial type='file'><source path={quoteattr(str(self.console_log))}/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>
    <qemu:arg value='-netdev'/>
    <qemu:arg value={quoteattr(self.netdev())}/>
    <qemu:arg value='-device'/>
    <qemu:arg value='virtio-net-pci,netdev=sbnet0,bus=pci.0,addr=0x10'/>
  </qemu:commandline>
</domain>
"""
