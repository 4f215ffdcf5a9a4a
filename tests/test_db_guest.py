"""The database guest under real libvirt/QEMU: a short TPC-C-like run traced from the host, and
failures.

Needs root, libvirtd, qemu-system-x86_64, debootstrap and the Debian mirror
(for the first image build, a few minutes; cached afterwards). Skips, saying
why, only when one of those is truly absent.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "controller"))

from scalebench.db import cli
from scalebench.db.errors import DbTraceError

REQUIRED_TOOLS = (
    "libvirtd",
    "qemu-system-x86_64",
    "qemu-img",
    "debootstrap",
    "mkfs.ext4",
    "chroot",
)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (libvirtd, debootstrap, chroot)"
)
# The first test to run may build the image (a few minutes on a fresh machine, cached outside the
# checkout afterwards).
guest_timeout = pytest.mark.timeout(1500)


def _require_deps() -> None:
    """Tools from packages.apt and Python packages are installed by `make deps`: their absence is a
    failure."""
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: run `make deps` first")
    for module in ("libvirt", "pg8000"):
        if importlib.util.find_spec(module) is None:
            pytest.fail(
                f"Python package {module} is not installed (pip install libvirt-python pg8000)"
            )


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The session's image (conftest.db_image), once this module's tools are known present."""
    _require_deps()
    return request.getfixturevalue("db_image")


def _base_state(path: str) -> tuple[int, float, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime, st.st_mode


def _domain_names(conn) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.name() for d in conn.listAllDomains()]


@needs_root
@guest_timeout
def test_short_tpcc_run_traces_reads_and_writes_inside_the_disk(
    image, libvirt_conn, tmp_path: Path
) -> None:
    from scalebench.db.guest import DbGuest, GuestConfig
    from scalebench.db.run import WORKLOADS, RunOptions, run_on_guest
    from scalebench.db.workload import run_workload

    before = _base_state(image.rootfs)
    opts = RunOptions(
        workload="tpcc",
        mix="standard",
        clients=2,
        duration_s=15,
        guest=GuestConfig(image=image, run_dir=tmp_path, disk="flash8"),
        warmup_s=0.0,
    )
    with DbGuest(opts.guest, libvirt_conn) as guest:
        name = guest.name
        assert name in _domain_names(libvirt_conn)
        result = run_on_guest(guest, opts)
        # Recording switched off: the guest's commits (WAL writes and flushes) still reach the
        # disk, and none is recorded; switched on again, they are.
        tpcc = WORKLOADS["tpcc"]
        guest.set_tracing(False)
        recorded = len(guest.server.records)
        run_workload(tpcc, "standard", guest.port, 1, 3.0, check=guest.check_alive)
        assert len(guest.server.records) == recorded
        guest.set_tracing(True)
        run_workload(tpcc, "standard", guest.port, 1, 3.0, check=guest.check_alive)
        assert len(guest.server.records) > recorded
    assert name not in _domain_names(libvirt_conn)
    assert result.throughput.completed > 0
    # No warm-up: measured from a cold start, and the result says so.
    assert result.steady.mode == "none" and not result.steady.reached
    # PostgreSQL's own counters for the same window, beside the trace's.
    assert result.postgres is not None and result.postgres.pg.commits > 0
    assert set(result.throughput.by_interaction) <= {
        "new_order",
        "payment",
        "order_status",
        "delivery",
        "stock_level",
    }
    m = result.metrics
    assert m is not None and m.reads > 0 and m.writes > 0
    assert m.sectors_read > 0 and m.sectors_written > 0
    assert result.lba_in_range
    rows = Path(result.trace_csv).read_text().splitlines()
    assert rows[0] == "t_s,op,lba,sectors,latency_ms"
    disk_sectors = os.stat(image.rootfs).st_size // 512
    for row in rows[1:]:
        _t, op, lba, sectors, _lat = row.split(",")
        assert op in ("R", "W", "F")
        assert int(lba) >= 0 and int(lba) + int(sectors) <= disk_sectors
    assert Path(result.lba_plot).stat().st_size > 0
    assert _base_state(image.rootfs) == before
    assert not list(tmp_path.glob("*.overlay"))


@needs_root
@guest_timeout
def test_boot_timeout_destroys_the_domain_and_keeps_the_base_image(
    image, libvirt_conn, tmp_path: Path
) -> None:
    from scalebench.db.guest import DbGuest, GuestConfig

    before = _base_state(image.rootfs)
    guest = DbGuest(
        GuestConfig(image=image, run_dir=tmp_path, disk="none", boot_timeout_s=2.0), libvirt_conn
    )
    with pytest.raises(DbTraceError, match="did not come up within 2 s"), guest:
        pass
    assert guest.name not in _domain_names(libvirt_conn)
    assert not list(tmp_path.glob("*.overlay")) and not list(tmp_path.glob("*.sock"))
    assert _base_state(image.rootfs) == before


@needs_root
@guest_timeout
def test_tracer_or_qemu_dying_mid_run_is_a_clear_error(image, libvirt_conn, tmp_path: Path) -> None:
    from scalebench.db.guest import DbGuest, GuestConfig

    with DbGuest(GuestConfig(image=image, run_dir=tmp_path, disk="none"), libvirt_conn) as guest:
        guest.server.stop()  # the tracer dies under a running guest
        with pytest.raises(DbTraceError, match="block tracer stopped"):
            guest.check_alive()
        guest.server = None
        guest.domain.destroy()  # QEMU dies
        with pytest.raises(DbTraceError, match="QEMU is gone"):
            guest.check_alive()
        name = guest.name
    assert name not in _domain_names(libvirt_conn)


@needs_root
@guest_timeout
def test_postgres_dying_in_the_guest_is_a_clear_error(image, libvirt_conn, tmp_path: Path) -> None:
    """The guest's server gone while its QEMU runs (the kernel's OOM killer did it under a
    memory.max cap): one error naming it, not pg8000's traceback."""
    from scalebench.db.guest import DbGuest, GuestConfig
    from scalebench.db.run import RunOptions, run_on_guest
    from scalebench.db.sql import connect, lost_connection

    config = GuestConfig(image=image, run_dir=tmp_path, disk="none", trace=False)
    with DbGuest(config, libvirt_conn) as guest:
        conn = connect(guest.port, "postgres")
        with pytest.raises(lost_connection()):  # the server kills itself, this backend first
            conn.run("COPY (SELECT 1) TO PROGRAM 'pkill -KILL -u postgres'")
        opts = RunOptions("tpcc", "standard", 1, 5.0, config, warmup_s=0)
        with pytest.raises(DbTraceError, match="PostgreSQL went away") as raised:
            run_on_guest(guest, opts)
        assert str(guest.console_log) in str(raised.value)
        assert len(str(raised.value).splitlines()) == 1


@needs_root
@guest_timeout
def test_the_servers_page_cache_is_held_to_its_limit(image, libvirt_conn, tmp_path: Path) -> None:
    """A scan of TPC-C's stock table (more than 64 MiB): under a limit of 128 MiB its pages
    stay in the server's page cache; under --db-cache 12 the cache stays near 12 MiB."""
    from scalebench.db.guest import DbGuest, GuestConfig
    from scalebench.db.sql import connect

    def cache_mib_after_scan(limit: int) -> float:
        config = GuestConfig(
            image=image, run_dir=tmp_path / str(limit), disk="none", trace=False, db_cache_mib=limit
        )
        with DbGuest(config, libvirt_conn) as guest:
            conn = connect(guest.port, "tpcc", timeout=300)
            ((size,),) = conn.run("SELECT pg_relation_size('stock')")
            assert size > 64 << 20
            conn.run("SELECT count(*) FROM stock")
            time.sleep(2)  # the guest's reclaimer runs twice a second
            (stat,) = conn.run("SELECT pg_read_file('/sys/fs/cgroup/db/memory.stat')")[0]
            conn.close()
        values = dict(line.split() for line in stat.splitlines())
        return (int(values["file"]) - int(values["shmem"])) / 2**20

    assert cache_mib_after_scan(12) < 16
    assert cache_mib_after_scan(128) > 40


def test_a_lost_server_is_explained_by_the_guest_kernels_oom_kill(tmp_path: Path) -> None:
    from scalebench.db.guest import DbGuest, GuestConfig

    guest = DbGuest(GuestConfig(image=None, run_dir=tmp_path, domain_type="qemu"), conn=None)
    guest.console_log.write_text(
        "SCALEBENCH-DB-READY\n[  313.891182] Memory cgroup out of memory: Killed process 183 "
        "(postgres) total-vm:109316kB\n"
    )
    message = str(guest.server_lost(ConnectionError("network error")))
    assert message.startswith("the guest's PostgreSQL went away (network error): the guest's")
    assert 'kernel said "[  313.891182] Memory cgroup out of memory: Killed process 183' in message
    guest.console_log.write_text("SCALEBENCH-DB-READY\n")
    assert "kernel said" not in str(guest.server_lost(ConnectionError("network error")))


@needs_root
@guest_timeout
def test_sigterm_to_results_make_ecommerce_tears_its_guest_down(
    image, libvirt_conn, tmp_path: Path
) -> None:
    """The findings bench runs dbtrace two processes below `scalebench results make`. SIGTERM
    at the top used to kill the bench outright, which left dbtrace, its tracer and the guest
    running; now each level stops the one below and waits for its teardown."""
    before = set(_domain_names(libvirt_conn))
    # The run's NBD socket lies three levels below --work: a short one keeps its path within
    # AF_UNIX's 108 bytes.
    work = Path(tempfile.mkdtemp(prefix="sbe.", dir="/tmp"))
    argv = ["results", "make", "ecommerce", "--work", str(work)]
    log = tmp_path / "make.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scalebench", *argv, "--dest", str(tmp_path / "results")],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        while not set(_domain_names(libvirt_conn)) - before:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
        left = [
            pid
            for pid in os.listdir("/proc")
            if pid.isdigit() and str(work).encode() in _cmdline(int(pid))
        ]
        shutil.rmtree(work, ignore_errors=True)
    assert "interrupted" in log.read_text()
    assert set(_domain_names(libvirt_conn)) == before
    assert not left, [_cmdline(int(pid)) for pid in left]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@needs_root
@guest_timeout
def test_db_guests_alongside_run_in_background_and_report(
    image, libvirt_conn, tmp_path: Path
) -> None:
    from scalebench.db.alongside import db_guests

    with db_guests(1, "rubis", None, tmp_path) as dbs:
        names = [g.name for g in dbs._guests]
        assert names and names[0] in _domain_names(libvirt_conn)
        # The microVM run: until the guest's workload has done some work (how long that takes
        # depends on the emulated guest's speed, so the test waits for it, not for a time).
        deadline = time.monotonic() + 180
        while dbs.completed[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert dbs.completed[0] >= 3, "the background workload completed nothing in 180 s"
    assert names[0] not in _domain_names(libvirt_conn)
    (result,) = dbs.results
    assert result["error"] is None, result["error"]
    assert (result["workload"], result["mix"]) == ("rubis", "browsing")
    assert result["throughput"] > 0 and result["metrics"]["reads"] >= 0


def test_libvirtd_not_startable_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in ``libvirtd`` that exits at once (a fake of libvirtd, inside this test of the
    daemon manager)."""
    pytest.importorskip("libvirt")
    from scalebench.db import daemon

    fake = tmp_path / "libvirtd"
    fake.write_text("#!/bin/sh\necho 'libvirtd: cannot start (test stand-in)' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(daemon, "prepare_host", lambda: None)
    manager = daemon.Libvirt(
        uri=f"qemu+unix:///system?socket={tmp_path}/absent.sock",
        start_timeout_s=10,
        log_path=tmp_path / "libvirtd.log",
        run_dir=tmp_path,
    )
    with pytest.raises(DbTraceError, match=r"libvirtd exited at start-up .*cannot start"), manager:
        pass
    assert manager.started is None


class StandInLibvirt:
    """A FAKE of the libvirt client module, inside this test of the daemon manager: a connection
    opens while the stand-in daemon whose pid file it watches is running."""

    class libvirtError(Exception):  # the libvirt module's own name
        pass

    def __init__(self, pid_file: Path) -> None:
        self.pid_file = pid_file

    def open(self, uri: str) -> object:
        from scalebench.db import daemon

        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            raise self.libvirtError(f"no daemon answers at {uri}") from None
        if not daemon._running(pid):
            raise self.libvirtError(f"the daemon at {uri} has exited")
        return types.SimpleNamespace(close=lambda: None)


@pytest.mark.parametrize("first_out", ["the starter", "the other user"])
def test_libvirtd_is_stopped_by_its_last_user_whoever_started_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_out: str
) -> None:
    """Two users of one libvirtd (a results run and a test, say): the first to leave does not
    stop it under the other, and the last one stops it. A stand-in ``libvirtd`` (a fake, in this
    test of the daemon manager) writes its pid file and waits to be stopped."""
    from scalebench.db import daemon

    stand_in = tmp_path / "libvirtd"
    stand_in.write_text(
        "#!/bin/sh\ntrap 'exit 0' TERM\necho $$ > \"$2\"\nwhile :; do sleep 0.05; done\n"
    )
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(daemon, "prepare_host", lambda: None)
    fake = StandInLibvirt(tmp_path / "scalebench-libvirtd.pid")
    monkeypatch.setattr(daemon, "_import_libvirt", lambda: fake)

    def user() -> daemon.Libvirt:
        return daemon.Libvirt(start_timeout_s=10, log_path=tmp_path / "log", run_dir=tmp_path)

    starter, other = user(), user()
    starter.__enter__()
    assert starter.started is not None
    pid = int(fake.pid_file.read_text())
    other.__enter__()
    assert other.started is None  # it found the daemon running
    first, last = (starter, other) if first_out == "the starter" else (other, starter)
    first.__exit__(None, None, None)
    assert daemon._running(pid), f"{first_out} stopped libvirtd under the other user"
    last.__exit__(None, None, None)
    assert not daemon._running(pid), "the last user left libvirtd running"


def test_libvirtd_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from scalebench.db import daemon

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(DbTraceError, match="libvirtd is not installed"):
        daemon.prepare_host()


def test_image_build_failure_is_a_clear_error(tmp_path: Path) -> None:
    from scalebench.db.image import ensure_image

    broken = tmp_path / "build.py"
    broken.write_text(
        "import sys\nprint('build.py: error: image build failed at debootstrap (exit 1)', "
        "file=sys.stderr)\nsys.exit(1)\n"
    )
    with pytest.raises(DbTraceError, match="image build failed at debootstrap"):
        ensure_image(cache=tmp_path / "cache", builder=broken)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dbtrace", "--workload", "oracle", "--mix", "x"], "invalid choice: 'oracle'"),
        (["dbtrace", "--workload", "tpcc", "--mix", "browsing"], "tpcc has no mix 'browsing'"),
        (
            ["dbtrace", "--workload", "tpcw", "--mix", "browsing", "--clients", "0"],
            "--clients must be at least 1",
        ),
        (
            ["dbtrace", "--workload", "rubis", "--mix", "bidding", "--duration", "-5"],
            "--duration must be positive",
        ),
        (
            ["dbtrace", "--workload", "tpcc", "--mix", "standard", "--disk", "floppy"],
            "invalid choice: 'floppy'",
        ),
        (["dbtrace", "--clients", "many"], "invalid int value"),
        (
            ["dbtrace", "--workload", "tpcc", "--mix", "standard", "--dilate", "0.5"],
            "--dilate must be at least 1",
        ),
        (["dbtrace", "--mix", "standard"], "--workload and --mix are required"),
        (
            ["dbtrace", "--workload", "tpcc", "--mix", "standard", "--warmup-cap", "0"],
            "--warmup-cap must be positive",
        ),
        (["dbtrace", "--workload", "pgbench", "--scale", "0"], "--scale must be at least 1"),
        (
            ["dbtrace", "--workload", "pgbench", "--mix", "standard"],
            "pgbench has no mix 'standard'",
        ),
        (["dbtrace", "--compare", "--workload", "pgbench"], "no study figures for pgbench"),
        (
            ["dbtrace", "--workload", "tpcc", "--mix", "standard", "--db-cache", "300"],
            "--db-cache must be 0 to 128 MiB (half of --memory), not 300",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err


@pytest.mark.parametrize("configured, expected", [(None, 31.5), (12.0, 12.0)])
def test_dilation_is_the_configured_factor_else_the_measured_slowdown(
    configured: float | None, expected: float
) -> None:
    from scalebench.db.guest import DbGuest, GuestConfig

    class FakeTracedDisk:
        """FAKE stand-in for the NBD tracer: records the factor it is told (dilation's own
        arithmetic is
        tested in test_db_diskmodel.py; this is about which factor reaches it)."""

        factor = 0.0

        def dilate(self, factor: float) -> None:
            self.factor = factor

    guest = DbGuest(
        GuestConfig(
            image=None,
            run_dir=Path("."),
            dilate=True,
            dilation=configured,  # type: ignore[arg-type]
            domain_type="qemu",
        ),
        conn=None,
    )
    guest.server = FakeTracedDisk()  # type: ignore[assignment]
    guest.measure_cpu_slowdown = lambda: 31.5  # type: ignore[method-assign]
    guest.apply_dilation()
    assert guest.dilation == expected and guest.server.factor == expected  # type: ignore[union-attr]


def test_python_m_entry_point_reports_bad_input() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scalebench.db", "dbtrace", "--workload", "tpcc"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent / "controller",
        check=False,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == "scalebench dbtrace: error: --workload and --mix are required (or use --compare)"
    )
