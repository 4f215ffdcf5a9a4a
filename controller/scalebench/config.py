"""One run's configuration, its defaults and its validation.

Validation happens before anything is started; every problem is a ConfigError
whose message is one line (the CLI prints it as `scalebench: error: ...`, exit 2).
"""

from __future__ import annotations

import ipaddress
import math
import socket
from dataclasses import asdict, dataclass, field, fields, replace

# Re-exported for the modules that import them from here.
from .binaries import REPO_ROOT as REPO_ROOT
from .binaries import bin_dir as bin_dir
from .binaries import binary as binary
from .cgroup import memory_limit
from .describe import describe_config, fact
from .disks import disk_model
from .errors import ConfigError
from .units import KIB, is_power_of_two, parse_size

OBJECTS = ("small", "large")


@dataclass(frozen=True)
class RunConfig:
    """Every knob of one run. Sizes are kept as written ("32k") and validated into bytes."""

    vms: int = 4000
    alpha: float = 1.0
    block: str = "32k"
    mem: str = "1G"
    policy: str = "demand"
    disk: str = "none"
    duration: float = 60.0
    warmup: float = 10.0
    object: str = "small"
    ws: str = "896K"
    concurrency: int = 64
    calls_per_conn: int = 1
    seed: int = 1
    touch: bool = True  # one request per VM before the warm-up (touch.py)
    timeout: float = 60.0  # zipfperf --timeout: a cold VM on a modeled disk takes seconds
    cpu_us: float | None = None
    calibration_s: float = (
        10.0  # calibration phase of out-of-core runs; its second half is measured
    )
    fault_us: float | None = None  # the model's host time per fault; None: calibrated by the run
    addr_base: str = "127.1.0.0"
    port: int = 8080
    out: str | None = None  # run directory; default runs/<run-id>
    json: str | None = None  # extra copy of the result JSON
    idle_after: float | None = None  # densevm --idle-after: hibernate VMs idle this long (s)
    max_live: int | None = None  # densevm --max-live: most VMs awake (needs idle_after)
    clone_boot: bool = False  # densevm --clone-boot: VMs created asleep start as clones
    db_guests: int = 0
    db_workload: str | None = None
    db_mix: str | None = None
    labels: dict = field(default_factory=dict)  # sweep point key etc., carried into the result

    @property
    def block_bytes(self) -> int:
        return parse_size(self.block)

    @property
    def mem_bytes(self) -> int:
        return parse_size(self.mem)

    @property
    def ws_bytes(self) -> int:
        return parse_size(self.ws)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(block_bytes=self.block_bytes, mem_bytes=self.mem_bytes, ws_bytes=self.ws_bytes)
        return d

    def with_(self, **changes) -> RunConfig:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemTotal from /proc/meminfo")


def _size(name: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise ConfigError(f"--{name}: {e}") from None


def validate(cfg: RunConfig) -> RunConfig:
    """Raise ConfigError for the first problem found; otherwise return cfg, with scale to
    zero turned on where its VMs cannot all be live (`with_scale_to_zero_if_needed`)."""
    if cfg.vms < 1:
        raise ConfigError(f"--vms must be at least 1 (got {cfg.vms})")
    if cfg.alpha < 0:
        raise ConfigError(f"--alpha must be >= 0 (got {cfg.alpha})")
    block = _size("block", cfg.block)
    lo, hi = fact("pager.block.min"), fact("pager.block.max")
    if not is_power_of_two(block) or not lo <= block <= hi:
        raise ConfigError(
            f"--block must be a power of two from {lo // KIB}k to {hi // KIB}k (got {cfg.block})"
        )
    mem = _size("mem", cfg.mem)
    host = host_memory_bytes()
    if mem <= 0 or mem > host:
        raise ConfigError(f"--mem {cfg.mem} is not within this host's memory ({host // 2**20} MiB)")
    cfg = with_scale_to_zero_if_needed(cfg, mem, host)
    needed = memory_limit(mem, cfg.vms, cfg.max_live)
    if needed > host:
        raise ConfigError(
            f"--vms {cfg.vms} with --mem {cfg.mem}"
            + (f" and --max-live {cfg.max_live}" if cfg.max_live is not None else "")
            + f" needs about {needed / 2**30:.1f} GiB "
            f"(the budget, the VMs' kernel memory and the monitor): more than this host's memory "
            f"({host / 2**30:.1f} GiB)"
        )
    if _size("ws", cfg.ws) <= 0:
        raise ConfigError(f"--ws must be positive (got {cfg.ws})")
    try:
        describe_config("--policy", cfg.policy)  # densevm's own grammar, checked by densevm
    except ConfigError as e:
        raise ConfigError(
            f"--policy must be demand, wsswap[,after=N] or an existing PATH.so[,ARGS]: {e}"
        ) from None
    try:
        disk_model(cfg.disk)
    except ValueError as e:
        raise ConfigError(f"--disk: {e}") from None
    if cfg.duration <= 0 or cfg.warmup < 0:
        raise ConfigError("--duration must be > 0 and --warmup >= 0")
    if cfg.concurrency < 1 or cfg.calls_per_conn < 1:
        raise ConfigError("--concurrency and --calls-per-conn must be at least 1")
    if cfg.object not in OBJECTS:
        raise ConfigError(f"--object must be small or large (got {cfg.object})")
    if cfg.timeout <= 0:
        raise ConfigError(f"--timeout must be positive (got {cfg.timeout})")
    if cfg.fault_us is not None and cfg.fault_us < 0:
        raise ConfigError(f"--fault-us must be >= 0 (got {cfg.fault_us})")
    if cfg.cpu_us is not None and cfg.cpu_us <= 0:
        raise ConfigError(f"--cpu-us must be positive (got {cfg.cpu_us})")
    try:
        first = ipaddress.IPv4Address(cfg.addr_base)
    except ValueError:
        raise ConfigError(f"--addr-base is not an IPv4 address: {cfg.addr_base}") from None
    if first not in ipaddress.IPv4Network("127.0.0.0/8") or int(first) + cfg.vms - 1 > int(
        ipaddress.IPv4Address("127.255.255.254")
    ):
        raise ConfigError(f"--vms {cfg.vms} from {cfg.addr_base} does not fit in 127.0.0.0/8")
    if cfg.db_guests < 0 or (cfg.db_guests > 0 and not cfg.db_workload):
        raise ConfigError("--db-guests K needs K >= 0 and --db-workload NAME")
    _check_hibernation(cfg)
    return cfg


# Scale to zero when --vms cannot all be live and neither hibernation flag was given.
# The cap: 10,000 live VMs is the most measured live on this kind of host (they boot in
# about 15 s and hold 0.67-0.71 MiB of host memory each, hypervisor/README.md); a host
# whose memory holds fewer gets fewer. The timer is long, so that memory, not a short
# idle spell, decides who sleeps (Denali's gatekeeper swaps out only under pressure),
# and a tenant idle for five minutes still gives its memory back.
DEFAULT_MAX_LIVE = 10_000
DEFAULT_IDLE_AFTER_S = 300.0


def with_scale_to_zero_if_needed(cfg: RunConfig, mem: int, host: int) -> RunConfig:
    """cfg with --idle-after DEFAULT_IDLE_AFTER_S and --max-live (DEFAULT_MAX_LIVE, or what
    the host's memory holds live) when its VMs do not all fit live and neither flag was
    given; else cfg."""
    if cfg.idle_after is not None or cfg.max_live is not None or memory_limit(mem, cfg.vms) <= host:
        return cfg
    # The limit grows by the same step for each VM kept live rather than asleep.
    all_asleep = memory_limit(mem, cfg.vms, 0)
    fits = (host - all_asleep) // (memory_limit(mem, cfg.vms, 1) - all_asleep)
    return cfg.with_(idle_after=DEFAULT_IDLE_AFTER_S, max_live=max(1, min(DEFAULT_MAX_LIVE, fits)))


def hibernation_flags(cfg: RunConfig) -> tuple[str, ...]:
    """densevm serve's flags for the run's hibernation (none when it is off)."""
    flags: tuple[str, ...] = ()
    if cfg.idle_after is not None:
        flags += ("--idle-after", str(cfg.idle_after))
    if cfg.max_live is not None:
        flags += ("--max-live", str(cfg.max_live))
    if cfg.clone_boot:
        flags += ("--clone-boot",)
    return flags


def _check_hibernation(cfg: RunConfig) -> None:
    """The hibernation flags' shape here, their ranges by densevm itself (`densevm describe`
    checks them as `serve` does), so the limits are not copied."""
    if cfg.max_live is not None and cfg.idle_after is None:
        raise ConfigError("--max-live needs --idle-after (only idle VMs are hibernated)")
    if cfg.max_live is not None and cfg.max_live < 1:
        raise ConfigError(f"--max-live must be at least 1 (got {cfg.max_live})")
    if cfg.clone_boot and cfg.idle_after is None:
        raise ConfigError("--clone-boot needs --idle-after (only VMs created asleep are clones)")
    if cfg.idle_after is None:
        return
    if not math.isfinite(cfg.idle_after) or cfg.idle_after <= 0:
        raise ConfigError(
            f"--idle-after must be a positive number of seconds (got {cfg.idle_after:g})"
        )
    describe_config(*hibernation_flags(cfg))  # densevm's own one-line reason, naming the flag


def check_addresses_free(cfg: RunConfig) -> None:
    """ConfigError if the first, middle or last VM's address is already taken on this host.

    The loopback network is shared by everything on the host (another densevm,
    a test's nginx): finding that out before starting gives one clear line
    instead of a densevm that fails half-way through its boot.
    """
    base = ipaddress.IPv4Address(cfg.addr_base)
    for i in sorted({0, cfg.vms // 2, cfg.vms - 1}):
        addr = str(base + i)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, cfg.port))
            except OSError as e:
                raise ConfigError(
                    f"{addr}:{cfg.port} is not free ({e.strerror}): another densevm? "
                    "choose other addresses with --addr-base"
                ) from None
