//! A microVM as the cell's front holds it ([`MicroVm`]): its queue of
//! accepted connections, its rings and connections, and the front's view of its vCPU, which runs in a
//! holder (see `holder`).

use crate::devices::stream::StreamDevice;
use crate::guest::abi;
use crate::guest::memory::{Mapping, PackedPages};
use crate::holder::builder::BuildContext;
use crate::holder::RemoteVcpu;
use crate::vstate::stats::VcpuStats;
use std::net::SocketAddrV4;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

/// Tx records one VM may publish per second, after a burst of
/// [`TX_RECORD_BURST`]. A response is a record or two plus a CLOSE, so a VM
/// serving even the whole host's in-core rate (docs/host-facts.md, "The
/// in-core path at scale") stays far below it; a guest flooding empty records costs its cell this many
/// retirements a second, not a core.
pub const TX_RECORDS_PER_SEC: f64 = 100_000.0;
/// Records a VM may publish at once before the rate applies.
pub const TX_RECORD_BURST: f64 = 8192.0;

/// A VM's allowance of tx records: a token bucket refilled at
/// [`TX_RECORDS_PER_SEC`] up to [`TX_RECORD_BURST`].
#[derive(Debug, Clone, Copy)]
pub struct RecordBudget {
    tokens: f64,
    at: Instant,
}

impl RecordBudget {
    /// A full bucket.
    pub fn new(now: Instant) -> Self {
        RecordBudget {
            tokens: TX_RECORD_BURST,
            at: now,
        }
    }

    /// Takes one record's token; false when the bucket is empty.
    pub fn take(&mut self, now: Instant) -> bool {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * TX_RECORDS_PER_SEC;
        self.tokens = (self.tokens + refill).min(TX_RECORD_BURST);
        self.at = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }

    /// When the bucket holds a turn's worth of records again (1/64 of the burst).
    pub fn ready_at(&self) -> Instant {
        let missing = (TX_RECORD_BURST / 64.0 - self.tokens).max(0.0);
        self.at + Duration::from_secs_f64(missing / TX_RECORDS_PER_SEC)
    }
}

/// Why the front could not take a VM its holder built.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The cell's memory has no slot for the VM.
    #[error("VM {vm}: no RAM slot left in this cell")]
    NoSlot {
        /// VM index.
        vm: u32,
    },
    /// The vCPU's KVM statistics could not be mapped.
    #[error("VM {vm}: vCPU statistics: {source}")]
    Stats {
        /// VM index.
        vm: u32,
        /// The mmap or read error.
        source: std::io::Error,
    },
}

/// A booted microVM as the cell's front holds it.
pub struct MicroVm {
    /// Its vCPU, in a holder.
    pub vcpu: RemoteVcpu,
    /// Index of the VM.
    pub id: u32,
    /// Where it serves (the cell's socket gets its connections).
    pub addr: SocketAddrV4,
    /// Host-to-guest interrupt, while it is awake (a sleeping VM keeps no
    /// eventfd; its wake makes new ones).
    pub irq: Option<EventFd>,
    /// Host side of the stream device.
    pub stream: StreamDevice,
    /// Connection (slab key) on each slot.
    pub slots: [Option<usize>; abi::MAX_SLOTS],
    /// Connections whose unread bytes wait for credit or ring room.
    pub waiting: Vec<usize>,
    /// Taking held connections paused until a slot or ring room frees up.
    pub accept_paused: bool,
    /// Connections it released that still hold output (see `proxy`):
    /// they count against its slots.
    pub lingering: usize,
    /// Lingering connections reset (deadline or the cell's byte cap).
    pub linger_resets: u64,
    /// Doorbells whose handling was put off: they rang with no progress
    /// (see `event_loop`).
    pub doorbells_deferred: u64,
    /// The guest reported ready.
    pub ready: bool,
    /// Request bytes the host has put in its rx ring.
    pub rx_bytes: u64,
    /// Response records with bytes that went to one of its connections:
    /// what the host saw of its serving, whatever its counter says.
    pub tx_responses: u64,
    /// The guest's allowance of tx records (a rate, see `proxy`).
    pub tx_records: RecordBudget,
    /// System pages (rings, control page); freed while it sleeps, what it
    /// keeps of them then in `sys_packed`.
    pub sys: Mapping,
    /// What a sleeping VM keeps of its system pages ([`Self::pack_sys`]).
    pub sys_packed: Option<PackedPages>,
    /// Guest RAM.
    pub ram: Mapping,
    /// KVM's counters for the vCPU, when requested.
    pub kvm_stats: Option<VcpuStats>,
    /// Whether its vCPU exists (hibernation, `--idle-after`).
    pub sleep: Sleep,
    /// When a connection or a request last showed it in use.
    pub last_active: Instant,
}

/// A VM's place in hibernation. Only an `Awake` VM has a vCPU, a thread and
/// a KVM VM; the others are their memory and this record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sleep {
    /// Created asleep (`--idle-after`), or the template once saved: it
    /// starts on its first connection, booted or as a clone
    /// (`hibernation::FirstStart`).
    Unbooted,
    /// Running on its vCPU.
    Awake,
    /// Asked to park at a safe point ([`abi::CMD_PARK`]), since then; its
    /// vCPU goes once it has.
    Parking(Instant),
    /// Parked; its holder is releasing its vCPU.
    Hibernating,
    /// Hibernated: no vCPU, its memory on its way to swap.
    Asleep,
    /// Its holder is starting it again on a new vCPU, since then.
    Waking(Instant),
}

impl MicroVm {
    /// Interrupts the guest, if it is awake.
    pub fn kick(&self) {
        if let Some(irq) = &self.irq {
            let _ = irq.write(1);
        }
    }

    /// Whether nothing of it is in use: no connection, none waiting or
    /// lingering.
    pub fn unused(&self) -> bool {
        self.slots.iter().all(Option::is_none) && self.waiting.is_empty() && self.lingering == 0
    }

    /// The guest's control page.
    pub fn ctrl(&self) -> abi::Ctrl {
        match &self.sys_packed {
            Some(pack) => pack.read(abi::CTRL_GPA),
            None => self.sys.read_volatile(abi::CTRL_GPA),
        }
    }

    /// Frees a sleeping VM's system pages, keeping its counters, ring
    /// indices and credits ([`abi::SYS_KEPT_ASLEEP`]) in a pack of a few
    /// hundred bytes: the pages cost 8 KiB a sleeping VM.
    pub fn pack_sys(&mut self) -> std::io::Result<()> {
        if self.sys_packed.is_none() {
            self.sys_packed = Some(self.sys.pack_and_discard(&abi::SYS_KEPT_ASLEEP)?);
        }
        Ok(())
    }

    /// Puts a sleeping VM's system pages back, before its rings take a
    /// connection or it runs again.
    pub fn unpack_sys(&mut self) {
        if let Some(pack) = self.sys_packed.take() {
            self.sys.unpack(&pack);
        }
    }

    /// Writes the host command word.
    pub fn command(&self, cmd: u32) {
        self.sys
            .atomic_u32(abi::CTRL_GPA + 4)
            .store(cmd, std::sync::atomic::Ordering::Release);
    }

    /// Why the VM stopped, once its vCPU has: the vCPU's reason, with the
    /// vector and address the guest reported if it panicked.
    pub fn stop_reason(&self) -> Option<String> {
        let base = self.vcpu.reason()?;
        let ctrl = self.ctrl();
        Some(if ctrl.state == abi::STATE_PANICKED {
            format!(
                "{base}: vector {} at rip {:#x}, error code {:#x}",
                ctrl.panic_vector, ctrl.panic_rip, ctrl.panic_error_code
            )
        } else {
            base
        })
    }
}

/// The front's side of VM `id`, which its holder built and started: its
/// interrupt and its memory as the front maps them.
pub fn adopt(
    ctx: &BuildContext,
    id: u32,
    vcpu: RemoteVcpu,
    irq: Option<EventFd>,
    stats_fd: Option<OwnedFd>,
) -> Result<MicroVm, AdoptError> {
    let slot = ctx.slot_of(id);
    let sys = ctx.sys.slot(slot).ok_or(AdoptError::NoSlot { vm: id })?;
    let ram = ctx.ram.slot(slot).ok_or(AdoptError::NoSlot { vm: id })?;
    let addr = ctx.addr_of(id);
    let kvm_stats = stats_fd
        .map(|fd| VcpuStats::from_descriptor(std::fs::File::from(fd)))
        .transpose()
        .map_err(|source| AdoptError::Stats { vm: id, source })?;
    Ok(MicroVm {
        vcpu,
        id,
        addr,
        irq,
        stream: StreamDevice::default(),
        slots: [None; abi::MAX_SLOTS],
        waiting: Vec::new(),
        accept_paused: false,
        lingering: 0,
        linger_resets: 0,
        doorbells_deferred: 0,
        ready: false,
        rx_bytes: 0,
        tx_responses: 0,
        tx_records: RecordBudget::new(Instant::now()),
        sys,
        sys_packed: None,
        ram,
        kvm_stats,
        sleep: Sleep::Awake,
        last_active: Instant::now(),
    })
}
