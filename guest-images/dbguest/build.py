#!/usr/bin/env python3
"""Build and cache the Linux database guest image.

The image has three parts, all derived from Debian bookworm packages:

- ``vmlinuz``: the Debian cloud kernel (virtio drivers are modules),
- ``initrd.img``: made by initramfs-tools inside the build root with just the
  modules the root disk needs (virtio_pci, virtio_blk),
- ``rootfs.img``: an ext4 image made with ``mkfs.ext4 -d`` (no mounting) from
  a ``debootstrap --variant=minbase`` tree with PostgreSQL 15 and the three
  e-commerce databases (TPC-C-like, TPC-W-like, RUBiS-like) already loaded.

The databases are loaded natively at build time by running PostgreSQL inside
the build root (Unix socket only) and feeding it the SQL files in ``sql/``: a
TCG guest would need hours for the same work.

Two cache levels, each in a directory named by a SHA-256 of its inputs
(``buildcache.py``: built aside, checked against a manifest, renamed in;
concurrent builders wait on an flock):

- ``base-<key>/``: debootstrap + packages + kernel. Key: the suite, the
  package list, the kernel package, the initrd modules and the source of the
  functions that build it.
- ``image-<key>/``: base + databases + guest init. Key: the base key and the
  bytes of ``build.py``, ``sbinit.sh`` and every file under ``sql/``.

Usage: ``build.py [--cache DIR] [--verify]``; prints one JSON object with the
paths. The cache lives outside the checkout, shared by every clone on the
host: ``$SCALEBENCH_CACHE_DIR/dbguest`` (default
``/var/cache/scalebench/dbguest``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

# The image record is the controller's (scalebench.db.image reads what this prints).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "controller"))
from buildcache import BuildCache, input_key, tree_inputs, verify
from scalebench.db.image import GuestImage

HERE = Path(__file__).resolve().parent
SQL_DIR = HERE / "sql"
GUEST_INIT = HERE / "sbinit.sh"

SUITE = "bookworm"
KERNEL_PACKAGE = "linux-image-cloud-amd64"
BASE_PACKAGES = ("postgresql-15", "iproute2", "initramfs-tools", "kmod", "util-linux", "procps")
INITRD_MODULES = ("virtio_pci", "virtio_blk", "virtio_net")
DATABASES = ("tpcc", "tpcw", "rubis")
CPU_PROBE_N = 200_000
ROOTFS_SLACK_MIB = 768
RECYCLED_WAL_SEGMENTS = 24
PG_BIN = "/usr/lib/postgresql/15/bin"
PG_DATA = "/var/lib/postgresql/15/main"
PG_CONF_DIR = "/etc/postgresql/15/main"

# Server settings of the guest (256 MiB of RAM): a small buffer pool so that
# the databases (1-4x guest memory) are out of core, as in the study.
GUEST_PG_CONF = """\
# scalebench database guest
listen_addresses = '*'
port = 5432
max_connections = 80
shared_buffers = 24MB
work_mem = 2MB
maintenance_work_mem = 16MB
effective_cache_size = 128MB
dynamic_shared_memory_type = posix
fsync = on
synchronous_commit = on
full_page_writes = off
wal_compression = lz4
checkpoint_timeout = 30min
max_wal_size = 1GB
wal_buffers = 1MB
autovacuum = off
ssl = off
jit = off
log_min_messages = warning
logging_collector = off
"""

GUEST_PG_HBA = """\
# The guest is reachable only through a host-side port forward on loopback.
local all all trust
host all all 0.0.0.0/0 trust
"""


class BuildError(RuntimeError):
    """The image could not be built; the message says which step failed."""


DEFAULT_CACHE_ROOT = Path("/var/cache/scalebench")


def default_cache_dir() -> Path:
    """``$SCALEBENCH_CACHE_DIR/dbguest``, else ``/var/cache/scalebench/dbguest``: outside the
    checkout, so that a fresh clone finds the image another one built."""
    env = os.environ.get("SCALEBENCH_CACHE_DIR")
    return (Path(env) if env else DEFAULT_CACHE_ROOT) / "dbguest"


def apt_mirror() -> str:
    """The Debian mirror apt is configured with (first `URIs:`/`deb` entry)."""
    candidates = [
        Path("/etc/apt/sources.list"),
        *sorted(Path("/etc/apt/sources.list.d").glob("*.sources")),
    ]
    for path in candidates:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
            if line.startswith("deb ") and "security" not in line:
                parts = [p for p in line.split() if not p.startswith("[")]
                return parts[1]
    return "http://deb.debian.org/debian"


def base_key() -> str:
    """What the base level is made from: the distribution, its packages and the code that
    installs them (a change anywhere else in build.py keeps the base)."""
    recipe = {
        "suite": SUITE,
        "packages": BASE_PACKAGES,
        "kernel": KERNEL_PACKAGE,
        "modules": INITRD_MODULES,
    }
    code = "".join(inspect.getsource(f) for f in (_build_base, _run, _chroot_env, apt_mirror))
    return input_key(
        [("recipe", json.dumps(recipe, sort_keys=True).encode()), ("code", code.encode())]
    )


def image_key(base: str, src: Path = HERE) -> str:
    """What the image level is made from: its base and every file of the recipe in ``src``
    (build.py, sbinit.sh, sql/**)."""
    parts = [("base", base.encode())]
    parts += [(name, (src / name).read_bytes()) for name in ("build.py", "sbinit.sh")]
    parts += tree_inputs(src / "sql", "sql")
    return input_key(parts)


def _run(cmd: list[str], step: str, log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-5:]
        raise BuildError(
            f"image build failed at {step} (exit {proc.returncode}); see {log}: {' | '.join(tail)}"
        )


def _chroot_env() -> dict[str, str]:
    return {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "DEBIAN_FRONTEND": "noninteractive",
        "LC_ALL": "C",
        "HOME": "/root",
    }


def _build_base(root: Path, log: Path) -> None:
    """debootstrap minbase + PostgreSQL, then the cloud kernel with a small initrd."""
    for tool in ("debootstrap", "mkfs.ext4", "chroot"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed (apt-get install debootstrap e2fsprogs)")
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            SUITE,
            str(root),
            apt_mirror(),
        ],
        "debootstrap",
        log,
    )
    conf = root / "etc/initramfs-tools"
    (conf / "conf.d").mkdir(parents=True, exist_ok=True)
    (conf / "conf.d/scalebench").write_text("MODULES=list\nCOMPRESS=zstd\n")
    (conf / "modules").write_text("\n".join(INITRD_MODULES) + "\n")
    shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
    env = _chroot_env()
    _run(["chroot", str(root), "apt-get", "update", "-qq"], "apt-get update (chroot)", log, env)
    _run(
        [
            "chroot",
            str(root),
            "apt-get",
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            KERNEL_PACKAGE,
        ],
        "kernel install (chroot)",
        log,
        env,
    )
    _run(["chroot", str(root), "apt-get", "clean"], "apt-get clean (chroot)", log, env)
    for junk in ("usr/share/doc", "usr/share/man", "usr/share/locale", "var/lib/apt/lists"):
        shutil.rmtree(root / junk, ignore_errors=True)
        (root / junk).mkdir(parents=True, exist_ok=True)


def _pg(root: Path, log: Path, step: str, *args: str) -> None:
    _run(["chroot", str(root), "runuser", "-u", "postgres", "--", *args], step, log, _chroot_env())


def _postgres_ids(root: Path) -> tuple[int, int]:
    """uid and gid of the build root's postgres user (not necessarily the host's)."""
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == "postgres":
            return int(fields[2]), int(fields[3])
    raise BuildError("the build root has no postgres user")


def _build_image(base_root: Path, out: Path, log: Path) -> None:
    """Copy the base tree, load the databases natively, install the guest init, make the ext4
    image."""
    root = out / "root"
    _run(["cp", "-a", "--reflink=auto", str(base_root), str(root)], "copy base tree", log)
    (root / "etc/resolv.conf").write_text("")
    (root / PG_CONF_DIR.lstrip("/") / "conf.d").mkdir(exist_ok=True)
    (root / PG_CONF_DIR.lstrip("/") / "conf.d/scalebench.conf").write_text(GUEST_PG_CONF)
    (root / PG_CONF_DIR.lstrip("/") / "pg_hba.conf").write_text(GUEST_PG_HBA)
    shutil.copy(GUEST_INIT, root / "sbin/sbinit")
    (root / "sbin/sbinit").chmod(0o755)
    (root / "etc/hostname").write_text("dbguest\n")
    (root / "etc/fstab").write_text("/dev/vda / ext4 rw,noatime 0 1\n")
    sock = "/tmp"
    (root / "run/postgresql").mkdir(parents=True, exist_ok=True)
    shutil.chown(root / "run/postgresql", *_postgres_ids(root))
    server = [
        f"{PG_BIN}/pg_ctl",
        "-D",
        PG_DATA,
        "-w",
        "-t",
        "120",
        "-l",
        "/tmp/pg-build.log",
        "-o",
        f"-c config_file={PG_CONF_DIR}/postgresql.conf -c listen_addresses='' -c "
        f"unix_socket_directories={sock} "
        "-c dynamic_shared_memory_type=mmap -c shared_buffers=256MB -c fsync=off -c "
        "full_page_writes=off "
        "-c synchronous_commit=off -c max_wal_size=4GB -c maintenance_work_mem=256MB",
    ]
    _pg(root, log, "start PostgreSQL (build)", *server, "start")
    try:
        for name in DATABASES:
            _pg(root, log, f"create database {name}", "createdb", "-h", sock, name)
            shutil.copy(SQL_DIR / f"{name}.sql", root / f"tmp/{name}.sql")
            _pg(
                root,
                log,
                f"load database {name}",
                "psql",
                "-h",
                sock,
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                name,
                "-f",
                f"/tmp/{name}.sql",
            )
            _pg(
                root,
                log,
                f"vacuum database {name}",
                "psql",
                "-h",
                sock,
                "-q",
                "-d",
                name,
                "-c",
                "VACUUM (FREEZE, ANALYZE)",
            )
            (root / f"tmp/{name}.sql").unlink()
        shutil.copy(SQL_DIR / "probe.sql", root / "tmp/probe.sql")
        _pg(
            root,
            log,
            "install the CPU probe",
            "psql",
            "-h",
            sock,
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            "postgres",
            "-f",
            "/tmp/probe.sql",
        )
        probe = subprocess.run(
            [
                "chroot",
                str(root),
                "runuser",
                "-u",
                "postgres",
                "--",
                "psql",
                "-h",
                sock,
                "-At",
                "-d",
                "postgres",
                "-c",
                f"SELECT min(scalebench_cpu_probe({CPU_PROBE_N})) FROM generate_series(1, 5)",
            ],
            capture_output=True,
            text=True,
            env=_chroot_env(),
            check=False,
        )
        if probe.returncode != 0:
            raise BuildError(f"the CPU probe failed: {probe.stderr.strip()}")
        (out / "cpu_probe.json").write_text(
            json.dumps({"n": CPU_PROBE_N, "native_s": float(probe.stdout)}) + "\n"
        )
    finally:
        _pg(root, log, "stop PostgreSQL (build)", *server, "-m", "fast", "stop")
    # After a clean shutdown only the segment holding the shutdown checkpoint (its REDO point)
    # is needed. Older
    # segments go; of the recycled ones waiting under future names, a few stay, as on a server
    # that has been
    # running (new segments would otherwise be zero-filled during the measured run).
    control = subprocess.run(
        [
            "chroot",
            str(root),
            "runuser",
            "-u",
            "postgres",
            "--",
            f"{PG_BIN}/pg_controldata",
            PG_DATA,
        ],
        capture_output=True,
        text=True,
        env=_chroot_env(),
        check=False,
    )
    redo = [
        line.split(":", 1)[1].strip()
        for line in control.stdout.splitlines()
        if line.startswith("Latest checkpoint's REDO WAL file")
    ]
    if (
        control.returncode != 0
        or not redo
        or "Database cluster state:               shut down\n" not in control.stdout
    ):
        raise BuildError(
            f"PostgreSQL did not shut down cleanly after the load: {control.stderr.strip()}"
        )
    segments = sorted(
        p
        for p in (root / PG_DATA.lstrip("/") / "pg_wal").iterdir()
        if p.is_file() and len(p.name) == 24
    )
    keep = {p.name for p in segments if p.name >= redo[0]}
    keep = set(sorted(keep)[: 1 + RECYCLED_WAL_SEGMENTS])
    for segment in segments:
        if segment.name not in keep:
            segment.unlink()
    for leftover in (root / "tmp").iterdir():
        if leftover.is_file():
            leftover.unlink()
    boot = root / "boot"
    kernel = next(boot.glob("vmlinuz-*"))
    initrd = next(boot.glob("initrd.img-*"))
    shutil.copy(kernel, out / "vmlinuz")
    shutil.copy(initrd, out / "initrd.img")
    used_kib = int(
        subprocess.run(
            ["du", "-sk", str(root)], capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )
    size_mib = used_kib // 1024 + ROOTFS_SLACK_MIB
    _run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "dbroot",
            "-E",
            "root_owner=0:0",
            "-d",
            str(root),
            str(out / "rootfs.img"),
            f"{size_mib}M",
        ],
        "mkfs.ext4 -d",
        log,
    )
    shutil.rmtree(root)
    (out / "rootfs.img").chmod(0o444)


def build(cache_dir: Path | None = None) -> GuestImage:
    """Return the cached image, building whatever level is missing."""
    cache_dir = (cache_dir or default_cache_dir()).resolve()
    log = cache_dir / "build.log"
    cache = BuildCache(cache_dir, log=lambda msg: print(f"build.py: {msg}", file=sys.stderr))
    bname = f"base-{base_key()}"
    ikey = image_key(base_key())

    def build_image(out: Path) -> None:
        base = cache.ensure(bname, lambda d: _build_base(d / "root", log))
        _build_image(base / "root", out, log)

    image = cache.ensure(f"image-{ikey}", build_image)
    probe = json.loads((image / "cpu_probe.json").read_text())
    return GuestImage(
        kernel=str(image / "vmlinuz"),
        initrd=str(image / "initrd.img"),
        rootfs=str(image / "rootfs.img"),
        key=ikey,
        databases=DATABASES,
        cpu_probe_n=probe["n"],
        cpu_probe_native_s=probe["native_s"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache directory (default $SCALEBENCH_CACHE_DIR/dbguest or "
        "/var/cache/scalebench/dbguest)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check every cached file of the image against its SHA-256, large ones too",
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print(
            "build.py: error: building the image needs root (debootstrap, chroot)", file=sys.stderr
        )
        return 2
    # A SIGTERM unwinds like an error: the build's PostgreSQL is stopped and the partial level
    # removed.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit("build.py: error: terminated"))
    try:
        image = build(args.cache)
    except BuildError as err:
        print(f"build.py: error: {err}", file=sys.stderr)
        return 1
    if args.verify:
        bad = verify(Path(image.rootfs).parent, full=True)
        if bad is not None:
            print(f"build.py: error: the cached image is damaged: {bad}", file=sys.stderr)
            return 1
    print(json.dumps(asdict(image)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
