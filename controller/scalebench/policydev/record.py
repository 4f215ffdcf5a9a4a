"""`scalebench trace record`: a short real densevm run that keeps its request trace.

densevm records every request it serves (`--record-trace`); zipfperf drives a
Zipf load for a few seconds; the trace is then given its metadata (source,
VMs, working set, alpha, seed, the densevm and zipfperf settings).
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import ConfigError, RunConfig, binary, check_addresses_free
from ..densevm import DenseVM, DenseVMArgs, DenseVMError
from ..units import parse_size
from ..zipfperf import LoadSpec, ZipfperfError, run_load
from . import traces


@dataclass(frozen=True)
class RecordSpec:
    """What to run while recording."""

    vms: int
    alpha: float
    seconds: float
    seed: int
    block: str
    mem: str
    ws: str
    policy: str
    concurrency: int
    addr_base: str
    port: int


def record(out: Path, spec: RecordSpec, boot_timeout_s: float = 300.0) -> traces.TraceInfo:
    """Runs densevm with --record-trace under zipfperf load; returns the trace written to `out`.

    ConfigError for bad settings (nothing started); DenseVMError/ZipfperfError for a run
    that failed (everything started is stopped first).
    """
    if spec.vms < 1 or spec.seconds <= 0 or spec.alpha < 0:
        raise ConfigError("trace record needs --vms >= 1, --seconds > 0 and --alpha >= 0")
    for name in ("block", "mem", "ws"):
        try:
            parse_size(getattr(spec, name))
        except ValueError as e:
            raise ConfigError(f"--{name}: {e}") from None
    densevm_bin, zipfperf_bin = binary("densevm"), binary("zipfperf")
    check_addresses_free(RunConfig(vms=spec.vms, addr_base=spec.addr_base, port=spec.port))
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="trace-record-") as tmp:
        work = Path(tmp)
        args = DenseVMArgs(
            vms=spec.vms,
            addr_base=spec.addr_base,
            port=spec.port,
            ws=spec.ws,
            mem=spec.mem,
            block=spec.block,
            policy=spec.policy,
            disk="none",
            swap=work / "swap.img",
            api=work / "densevm.sock",
        )
        vm = DenseVM(
            densevm_bin,
            args,
            work / "densevm.log",
            wrap=lambda argv: [*argv, "--record-trace", str(out.resolve())],
        )
        try:
            vm.wait_ready(boot_timeout_s)
            load = LoadSpec(
                targets=spec.vms,
                addr_base=spec.addr_base,
                port=spec.port,
                alpha=spec.alpha,
                seed=spec.seed,
                duration_s=spec.seconds,
                concurrency=spec.concurrency,
                calls_per_conn=1,
                uri="/",
                timeout_s=60.0,
            )
            doc = run_load(zipfperf_bin, load, work, "record", alive=_alive(vm))
        except (DenseVMError, ZipfperfError):
            vm.stop()
            raise
        code = vm.stop()
        if code not in (0, None):
            raise DenseVMError(f"densevm exited with status {code}: {vm.last_error()}")
    info, _ = traces.read(out)
    ranges = info.header["request_ranges"]
    return traces.add_metadata(
        out,
        {
            "source": "densevm --record-trace",
            "alpha": spec.alpha,
            "seed": spec.seed,
            "working_set_bytes": sum(length for _, length in ranges),
            "recorded_with": asdict(spec),
            "replies_2xx": doc.get("replies", {}).get("status", {}).get("2xx"),
        },
    )


def _alive(vm: DenseVM):
    def check() -> None:
        why = vm.failure()
        if why:
            raise DenseVMError(why)

    return check
