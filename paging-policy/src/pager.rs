//! The fault service: a pool of threads reading the userfaultfds of every
//! attached guest memory (one per densevm cell: see `guest_memory`), and the
//! eviction / fetch I/O around the ledger.
//!
//! Guest memory is a memfd mapped in the process that runs the guests. The
//! pager reaches it through that process's userfaultfd (install, protect,
//! wake) and through the memfd (read victims with `pread`, free them with
//! `fallocate(PUNCH_HOLE)`), so it maps no guest memory itself, and an
//! operation on one cell's memory visits only that cell's KVM MMU notifiers.
//! A cell that dies leaves its memory's operations failing with ESRCH: they
//! are skipped, not fatal, until the caller detaches it. Any other error on
//! one space fails that space alone ([`Pager::take_failures`]); only a swap
//! I/O error, a policy failure or a panic stops the whole pager.
//!
//! Locking: all bookkeeping (block states, budget, policy, stats) lives in
//! one mutex that is held only between I/O steps, never across a swap read
//! or write, a copy of guest memory, or a userfaultfd ioctl. Faults of many
//! VMs therefore proceed concurrently; blocks in motion are marked busy in
//! the ledger, and a fault that hits a busy block is deferred and woken when
//! the block settles.
//!
//! Dirty tracking uses userfaultfd write protection: a block installed from
//! swap (or as zeros) comes in write-protected (`UFFDIO_COPY_MODE_WP`); its
//! first write faults, marks it dirty and lifts the protection. Clean blocks
//! are dropped at eviction without being written again.
//!
//! Write protection says a block *may* have changed: KVM can map guest
//! memory writable (a write-intent fault) when the guest only reads it, as
//! PVM does. So a block's content hash is taken when it stops being clean
//! (installed writable, or at its first write-protect fault, before the
//! protection is lifted), and at eviction a block flagged dirty whose memory
//! still hashes to it keeps its swap copy instead of being written again. The hash is keyed with random
//! per-process keys, so a guest cannot construct a collision; an accidental
//! one has probability 2^-64.
//!
//! Eviction never loses a concurrent write: the victim is write-protected
//! before it is copied out, so a writer blocks on the protection; the block
//! is dropped (`MADV_DONTNEED`) only after its copy is on swap, and then the
//! blocked writer is woken, faults the block back in, and writes to the
//! restored data.
//!
//! Memory freed by PUNCH_HOLE is gone from every mapping of the memfd, so the
//! guest's next touch raises a missing fault again, as after MADV_DONTNEED on
//! private memory (which would not free shared memory at all).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::batching::{cluster_writes, lead_first, read_runs, runs, write_runs};
use crate::compact::{CompactScratch, CompactSwap, Get, Put};
use crate::config::{default_swap_path, PagerConfig};
use crate::error::PagerError;
use crate::guest_memory::{check_handoff, SpaceHandoff, SpaceId};
use crate::injected;
use crate::ledger::{Access, Admission, Classified, Ledger, PlanBlock, VmLedger, Wakes, NO_LOC};
use crate::policy::{build_policy, BlockId, SwapLayout, VmId};
use crate::space::{swap_bytes_per_ram_byte, SwapSpace};
use crate::stats::TotalLatency;
use crate::swap::{AlignedBuf, SwapDevice, RESERVE_STEP};
use crate::uffd::{space_gone, Fault, FaultKind, Uffd};

/// Fault-service threads. Faults mostly wait on I/O (or on the disk
/// model's sleep), so more threads than cores keep the swap queue busy.
pub const SERVICE_THREADS: usize = 8;

/// Most bytes a fault-service thread moves to or from swap in one piece: a
/// larger fault (a hibernated VM's working set read back at once) or
/// eviction is done in pieces of this size, so each thread's buffers stay
/// this size, not the size of the largest batch it has met.
const IO_CHUNK_BYTES: usize = 1 << 20;

/// A wake's prefetch is installed in parts of this size, the one with the
/// block the VM touches first ([`PagerConfig::wake_first`]) first, and the
/// VM runs on each part as it lands: its vCPU then works through the blocks
/// installed while the rest are copied, instead of after all of them.
/// Alternated with waking at the end (200 VMs, 1,600 sequential wakes
/// each way, two runs): p50 1.80 against 2.19 ms and 2.82 against 3.12;
/// the parts in address order (a woken guest's stack last) were slower
/// than waking at the end, and 64 KiB parts no faster.
const WAKE_PART_BYTES: usize = 128 << 10;

/// When the threads waiting on the blocks a fill brings in resume.
#[derive(Debug, Clone, Copy)]
enum Resume {
    /// Once the ledger and the stats account for the fill: a fault.
    Accounted,
    /// As each part lands ([`WAKE_PART_BYTES`]), the part holding this
    /// block first: a wake's prefetch, which the VM waits for whole.
    PartByPart(Option<BlockId>),
}

/// VM ids are below this: the ledger indexes VMs by id, so a cell's wild
/// id must be refused, not allocated for.
pub const MAX_VM_ID: u32 = 1 << 20;

/// Most blocks a hibernation evicts between two visits to the ledger: the
/// lock is taken once per part, and the write buffer holds one part (2 MiB
/// at 32 KiB blocks), however large the VM.
pub const HIBERNATE_CHUNK: usize = 64;

/// How long a fault waiting for room re-checks for a fatal error.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// Longest the clone template's hibernation goes back in its queue for a
/// fault of the template still in flight (its vCPU stopped just after it
/// faulted), [`TEMPLATE_RETRY`] apart: saved without that block the template
/// is refused. Past this it is saved as it is.
const TEMPLATE_SETTLE: Duration = Duration::from_secs(2);
/// Between two looks at the template's faults in flight.
const TEMPLATE_RETRY: Duration = Duration::from_millis(1);

/// Longest [`Pager::reattach_space`] waits for an operation in flight on
/// the old descriptor (an eviction of a part of a VM, a few milliseconds;
/// more behind a modeled disk).
pub const REATTACH_WAIT: Duration = Duration::from_secs(5);

/// epoll key of the stop eventfd (spaces use their id).
const STOP_KEY: u64 = u64::MAX;

/// An attached guest memory: a process's userfaultfd and the memfd behind
/// the registered mapping.
struct Space {
    id: SpaceId,
    /// `None` once its process left ([`Pager::release_process`]).
    uffd: Option<Uffd>,
    /// Shared with the other spaces cut from the same memfd.
    memfd: Arc<OwnedFd>,
    /// Offset in the memfd of the mapping's first byte.
    memfd_offset: usize,
    /// Address of the mapping in its process.
    base: usize,
    len: usize,
    /// Its process is gone, or it failed: operations on it are skipped.
    gone: AtomicBool,
    /// An operation on it failed (not ESRCH): it is no longer served and
    /// its owner has been told ([`Pager::take_failures`]).
    failed: AtomicBool,
    /// The space it replaced ([`Pager::replace_process`]), alive while an
    /// operation begun on it is in flight.
    previous: Weak<Space>,
}

impl Space {
    /// Its userfaultfd; once its process left, the error an ioctl on a
    /// descriptor whose process is gone gives (ESRCH), which
    /// [`Pager::tolerate`] skips.
    fn uffd(&self) -> Result<&Uffd, PagerError> {
        self.uffd.as_ref().ok_or_else(|| PagerError::Uffd {
            op: "userfaultfd",
            source: std::io::Error::from_raw_os_error(libc::ESRCH),
        })
    }

    /// Adds its userfaultfd to the pager's epoll set, or takes it out
    /// (`op`: EPOLL_CTL_ADD or EPOLL_CTL_DEL), if it has one.
    fn poll(&self, epoll: &OwnedFd, op: libc::c_int) -> Result<(), PagerError> {
        match &self.uffd {
            Some(uffd) => epoll_ctl(epoll, op, uffd.as_raw_fd(), self.id as u64),
            None => Ok(()),
        }
    }

    /// Whether an operation in flight may still use it or a space it
    /// replaced: the caller holds one reference.
    fn in_use(self: &Arc<Self>) -> bool {
        Arc::strong_count(self) > 1
            || std::iter::successors(self.previous.upgrade(), |s| s.previous.upgrade()).count() > 0
    }
}

/// A part of the run the pager stopped serving while every other went on
/// (see [`Pager::take_failures`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagerFailure {
    /// The space (a densevm holder's guest memory) it concerns.
    pub space: SpaceId,
    /// `Some(vm)`: only that VM failed (no swap room for its copies); its
    /// faults are no longer served. `None`: the whole space failed (an
    /// operation on its memfd or its userfaultfd failed other than with
    /// ESRCH): none of its VMs is served any more.
    pub vm: Option<u32>,
    /// Why, one line.
    pub reason: String,
}

/// Where a VM's RAM lives.
#[derive(Clone)]
struct Place {
    space: Arc<Space>,
    /// Address of its first byte in the space's process.
    base: usize,
    /// Offset of its first byte in the memfd.
    offset: usize,
    len: usize,
}

impl Place {
    fn addr(&self, block: BlockId, bs: usize) -> usize {
        self.base + block as usize * bs
    }

    fn offset(&self, block: BlockId, bs: usize) -> usize {
        self.offset + block as usize * bs
    }
}

/// A block to wake: the space whose userfaultfd it waits on, and its address.
type WakeAddr = (Arc<Space>, usize);

/// Bookkeeping under the pager's mutex.
struct State {
    ledger: Ledger,
    /// VM regions by space and address: (VM, length).
    regions: BTreeMap<(SpaceId, usize), (VmId, usize)>,
    /// Where each VM's RAM lives.
    places: HashMap<VmId, Place>,
    spaces: HashMap<SpaceId, Arc<Space>>,
    next_space: SpaceId,
    latency: TotalLatency,
    clone_template: CloneTemplate,
    /// When the template's hibernation first went back in its queue for a
    /// fault in flight ([`TEMPLATE_SETTLE`]).
    template_deferred: Option<Instant>,
}

/// Where clone boot's template stands ([`PagerConfig::clone_template`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloneTemplate {
    /// Not asked for: VMs start from zeros.
    Off,
    /// Its VM has not been saved yet.
    Pending,
    /// Saved: every VM first touched from now on is a clone of it.
    Ready,
    /// It could not be saved, for this reason: VMs start from zeros.
    Failed(String),
}

impl State {
    fn lookup(&self, space: SpaceId, addr: usize) -> Option<(VmId, Place)> {
        let (&(_, base), &(vm, len)) =
            self.regions.range((space, 0)..=(space, addr)).next_back()?;
        (addr < base + len).then(|| (vm, self.places[&vm].clone()))
    }

    fn addrs(&self, wakes: &Wakes, block: usize, out: &mut Vec<WakeAddr>) {
        out.clear();
        out.extend(wakes.iter().filter_map(|(vm, b)| {
            self.places
                .get(vm)
                .map(|p| (Arc::clone(&p.space), p.addr(*b, block)))
        }));
    }
}

/// Per-thread buffers, reused across faults.
struct Scratch {
    read: AlignedBuf,
    write: AlignedBuf,
    plan: Vec<PlanBlock>,
    wakes: Wakes,
    addrs: Vec<WakeAddr>,
    order: Vec<usize>,
    runs: Vec<(usize, usize)>,
    compact: CompactScratch,
}

impl Scratch {
    fn new(block: usize) -> Scratch {
        Scratch {
            read: AlignedBuf::new(block),
            write: AlignedBuf::new(block),
            plan: Vec::new(),
            wakes: Vec::new(),
            addrs: Vec::new(),
            order: Vec::new(),
            runs: Vec::new(),
            compact: CompactScratch::new(block),
        }
    }
}

/// The pager of one densevm process.
pub struct Pager {
    cfg: PagerConfig,
    block: usize,
    vm_ram: u64,
    /// Every attached space's userfaultfd, and the stop eventfd.
    epoll: OwnedFd,
    swap: SwapDevice,
    /// What evicted blocks are stored as, with `PagerConfig::compact_swap`
    /// (else each block whole at its place).
    compact: Option<CompactSwap>,
    disk: Value,
    state: Mutex<State>,
    room: Condvar,
    fatal: Mutex<Option<String>>,
    failed: AtomicBool,
    /// Failures of single spaces or VMs not yet taken by the owner.
    failures: Mutex<Vec<PagerFailure>>,
    /// How many there were in all (the stats' `failures`).
    failure_count: AtomicU64,
    stop: AtomicBool,
    stop_fd: OwnedFd,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// VMs to hibernate, for the hibernation thread; `None` once shut down.
    hibernations: Mutex<Option<mpsc::Sender<VmId>>>,
    /// VMs waking, for the prefetch thread; `None` once shut down.
    prefetches: Mutex<Option<mpsc::Sender<VmId>>>,
    /// Key of the block-content hash (keyed BLAKE3, random per process): a
    /// guest cannot make a changed block hash like its swap copy, so no
    /// write is skipped that should not be.
    content_key: [u8; 32],
    /// Hash of a block of zeros: the content of a block without a swap copy.
    zero_sum: u64,
}

impl Pager {
    /// Opens the swap device (O_DIRECT), loads the policy and starts the
    /// fault-service threads. Every configuration error surfaces here,
    /// before any VM exists.
    pub fn new(
        cfg: PagerConfig,
        max_vms: u32,
        vm_ram_bytes: u64,
    ) -> Result<Arc<Pager>, PagerError> {
        // The request footprint is the caller's (densevm checks it with
        // `PagerConfig::validate` before it boots anything); here only what
        // does not depend on it.
        cfg.validate_settings(vm_ram_bytes)?;
        let block = cfg.block_bytes;
        let budget_blocks = cfg.budget_bytes / block;
        let policy = build_policy(&cfg.policy, block, budget_blocks)?;
        let layout = policy.layout();
        let capacity = cfg.swap_bytes.unwrap_or_else(|| {
            max_vms.max(1) as u64 * vm_ram_bytes * swap_bytes_per_ram_byte(layout)
        });
        let model = cfg.disk.build(capacity);
        let disk = model.describe(&cfg.disk);
        let path: PathBuf = cfg.swap_path.clone().unwrap_or_else(default_swap_path);
        let swap = SwapDevice::open(&path, capacity, cfg.keep_swap, model)?;
        // SAFETY: plain syscalls; the descriptors are fresh and ours.
        let (epoll, stop_fd) = unsafe {
            let epoll = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            let efd = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
            if epoll < 0 || efd < 0 {
                return Err(PagerError::Mm {
                    op: "epoll/eventfd",
                    source: std::io::Error::last_os_error(),
                });
            }
            (OwnedFd::from_raw_fd(epoll), OwnedFd::from_raw_fd(efd))
        };
        epoll_ctl(&epoll, libc::EPOLL_CTL_ADD, stop_fd.as_raw_fd(), STOP_KEY)?;
        let space = SwapSpace::new(layout, capacity, block, vm_ram_bytes);
        let content_key: [u8; 32] = rand::random();
        let zero_sum = content_sum(&content_key, &vec![0; block as usize]);
        let (hibernations, requests) = mpsc::channel();
        let (prefetches, wakes) = mpsc::channel();
        let pager = Arc::new(Pager {
            block: block as usize,
            vm_ram: vm_ram_bytes,
            epoll,
            compact: cfg
                .compact_swap
                .then(|| CompactSwap::new(block as usize, swap.sector())),
            swap,
            disk,
            state: Mutex::new(State {
                ledger: {
                    let mut ledger = Ledger::new(policy, space, block, cfg.budget_bytes);
                    ledger.set_vm_quota(cfg.vm_resident_max);
                    ledger
                },
                regions: BTreeMap::new(),
                places: HashMap::new(),
                spaces: HashMap::new(),
                next_space: 0,
                latency: TotalLatency::default(),
                clone_template: match cfg.clone_template {
                    Some(_) => CloneTemplate::Pending,
                    None => CloneTemplate::Off,
                },
                template_deferred: None,
            }),
            room: Condvar::new(),
            fatal: Mutex::new(None),
            failed: AtomicBool::new(false),
            failures: Mutex::new(Vec::new()),
            failure_count: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            stop_fd,
            threads: Mutex::new(Vec::new()),
            hibernations: Mutex::new(Some(hibernations)),
            prefetches: Mutex::new(Some(prefetches)),
            content_key,
            zero_sum,
            cfg,
        });
        let spawn = |name: String, op: &'static str, run: Box<dyn FnOnce(Arc<Pager>) + Send>| {
            let p = Arc::clone(&pager);
            std::thread::Builder::new()
                .name(name)
                .spawn(move || run(p))
                .map_err(|source| PagerError::Mm { op, source })
        };
        let mut threads = Vec::with_capacity(SERVICE_THREADS + 2);
        for i in 0..SERVICE_THREADS {
            threads.push(spawn(
                format!("pager-{i}"),
                "spawning fault-service thread",
                Box::new(Pager::service_loop),
            )?);
        }
        threads.push(spawn(
            "pager-hibernate".into(),
            "spawning hibernation thread",
            Box::new(move |p| p.queue_loop(requests, "hibernation", Pager::hibernate_now)),
        )?);
        threads.push(spawn(
            "pager-prefetch".into(),
            "spawning prefetch thread",
            Box::new(move |p| p.queue_loop(wakes, "prefetch", Pager::prefetch_now)),
        )?);
        *pager.threads.lock().unwrap_or_else(|e| e.into_inner()) = threads;
        Ok(pager)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic under the lock is a bug; the state is still the best
        // information there is, so keep serving (the run is stopped below).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the first fatal error; faults stop being served and the
    /// threads they belong to stay blocked (their memory is never replaced
    /// by zeros).
    fn fail(&self, msg: String) {
        let mut f = self.fatal.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(msg);
        }
        self.failed.store(true, Ordering::SeqCst);
        self.room.notify_all();
    }

    /// The error that stopped the run (swap I/O error, policy failure, a
    /// bug). An error confined to one space or one VM does not stop the run:
    /// see [`Pager::take_failures`].
    pub fn fatal_error(&self) -> Option<String> {
        self.fatal.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Spaces and VMs that failed since the last call, each reported once;
    /// everything else is still served. The owner (densevm's parent, polling
    /// this in its loop) ends what failed: a space's cell is killed and the
    /// space detached ([`Pager::detach_space`]); a failed VM is destroyed
    /// and unregistered ([`Pager::unregister_vm`]). Until then a failed
    /// space's or VM's faults stay pending (its vCPUs blocked) and its
    /// resident blocks stay counted.
    pub fn take_failures(&self) -> Vec<PagerFailure> {
        std::mem::take(&mut *self.failures.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn report(&self, failure: PagerFailure) {
        self.failure_count.fetch_add(1, Ordering::SeqCst);
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(failure);
    }

    /// Stops serving `space` after an error on it (once): its operations are
    /// skipped from now on, its userfaultfd leaves the epoll set (its
    /// pending faults are never read), and the owner is told.
    fn fail_space(&self, space: &Space, reason: String) {
        space.gone.store(true, Ordering::SeqCst);
        if space.failed.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = space.poll(&self.epoll, libc::EPOLL_CTL_DEL);
        self.report(PagerFailure {
            space: space.id,
            vm: None,
            reason,
        });
        self.room.notify_all();
    }

    /// Reports the VMs the ledger failed (no swap room for their copies).
    fn report_failed_vms(&self, st: &mut State) {
        for (vm, reason) in st.ledger.take_failed_vms() {
            if let Some(place) = st.places.get(&vm) {
                self.report(PagerFailure {
                    space: place.space.id,
                    vm: Some(vm),
                    reason,
                });
            }
        }
    }

    /// An operation on one space: ESRCH (its process is gone) is skipped, any
    /// other error fails that space alone ([`Pager::fail_space`]); neither
    /// stops the pager.
    fn tolerate(&self, space: &Space, result: Result<(), PagerError>) -> Result<(), PagerError> {
        match result {
            Err(e) if space.gone.load(Ordering::SeqCst) || space_gone(&e) => {
                space.gone.store(true, Ordering::SeqCst);
                Ok(())
            }
            Err(e) => {
                self.fail_space(space, e.to_string());
                Ok(())
            }
            ok => ok,
        }
    }

    /// Attaches a guest memory (see [`crate::GuestMemory::handoff`]): its
    /// faults are served from now on; its VMs are registered one by one.
    ///
    /// What a cell hands over is checked first ([`check_handoff`]: whole
    /// pages, a userfaultfd, a memfd sealed against shrinking and as long as
    /// the mapping) and refused with [`PagerError::BadSpace`] otherwise. The
    /// descriptors the pager keeps are made close-on-exec (received over
    /// SCM_RIGHTS without MSG_CMSG_CLOEXEC they would pass to every process
    /// the pager's process spawns) and the userfaultfd non-blocking (a
    /// blocking one would hold a service thread in `read`).
    pub fn attach_space(&self, handoff: SpaceHandoff) -> Result<SpaceId, PagerError> {
        if let Some(e) = self.fatal_error() {
            return Err(PagerError::Stopped(e));
        }
        check_handoff(&handoff)?;
        keep_private(&handoff.uffd, true)?;
        keep_private(&handoff.memfd, false)?;
        let mut st = self.lock();
        let id = st.next_space;
        let space = Arc::new(Space {
            id,
            uffd: Some(Uffd::from_fd(handoff.uffd)),
            memfd: handoff.memfd,
            memfd_offset: handoff.memfd_offset,
            base: handoff.base,
            len: handoff.len,
            gone: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            previous: Weak::new(),
        });
        space.poll(&self.epoll, libc::EPOLL_CTL_ADD)?;
        st.next_space += 1;
        st.spaces.insert(id, space);
        Ok(id)
    }

    /// Registers a VM's RAM: bytes `[offset, offset + len)` of the space's
    /// mapping (and of its memfd from the space's own offset), not touched
    /// yet; `len` is a non-zero multiple of the block
    /// size, at most the `vm_ram_bytes` given to [`Pager::new`].
    pub fn register_vm(
        &self,
        vm: u32,
        space: SpaceId,
        offset: usize,
        len: usize,
    ) -> Result<(), PagerError> {
        let bad = |reason: String| PagerError::BadVm { vm, reason };
        if vm >= MAX_VM_ID {
            return Err(bad(format!("id past the largest, {}", MAX_VM_ID - 1)));
        }
        if !offset.is_multiple_of(4096)
            || len == 0
            || !len.is_multiple_of(self.block)
            || len as u64 > self.vm_ram
        {
            return Err(bad(format!(
                "region at offset {offset:#x}+{len:#x} must be page-aligned, a non-zero multiple of the block size and at most {} bytes",
                self.vm_ram
            )));
        }
        if let Some(e) = self.fatal_error() {
            return Err(PagerError::Stopped(e));
        }
        let mut st = self.lock();
        let Some(space) = st.spaces.get(&space).cloned() else {
            return Err(bad(format!("no attached space {space}")));
        };
        if offset.checked_add(len).is_none_or(|end| end > space.len) {
            return Err(bad(format!(
                "region {offset:#x}+{len:#x} ends past its space ({:#x} bytes)",
                space.len
            )));
        }
        let addr = space.base + offset;
        let overlaps = st
            .regions
            .range((space.id, 0)..(space.id, addr + len))
            .next_back()
            .is_some_and(|(&(_, b), &(_, l))| b + l > addr);
        if overlaps || st.places.contains_key(&vm) {
            return Err(bad("region overlaps a registered VM or id in use".into()));
        }
        st.ledger.register(vm, (len / self.block) as u32)?;
        // Swap for its whole RAM (twice, for the log's slack), allocated now
        // rather than found missing mid-run; or at its first fault.
        if !self.cfg.swap_on_first_fault {
            if let Err(e) = st.ledger.commit_swap(vm, |bytes| self.reserve_swap(bytes)) {
                let _ = st.ledger.begin_unregister(vm);
                let _ = st.ledger.unregister(vm);
                return Err(match e {
                    PagerError::SwapFull { .. } => {
                        bad(format!("refused, no room on swap for it: {e}"))
                    }
                    e => e,
                });
            }
        }
        st.regions.insert((space.id, addr), (vm, len));
        st.places.insert(
            vm,
            Place {
                base: addr,
                offset: space.memfd_offset + offset,
                space,
                len,
            },
        );
        Ok(())
    }

    /// Forgets a destroyed VM (its vCPU no longer runs): waits for its
    /// in-flight operations, drops its resident accounting, frees its memory
    /// and its swap space.
    pub fn unregister_vm(&self, vm: u32) {
        let mut st = self.lock();
        loop {
            match st.ledger.begin_unregister(vm) {
                Ok(None) => return,
                Ok(Some(0)) => break,
                Ok(Some(_)) if !self.failed.load(Ordering::SeqCst) => {
                    st = self
                        .room
                        .wait_timeout(st, WAIT_SLICE)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                Ok(Some(_)) => return,
                Err(e) => {
                    drop(st);
                    self.fail(e.to_string());
                    return;
                }
            }
        }
        let place = st.places.remove(&vm);
        if let Some(p) = &place {
            st.regions.remove(&(p.space.id, p.base));
        }
        if let Some(compact) = &self.compact {
            compact.forget(&st.ledger.swap_copies(vm));
        }
        let unregistered = st.ledger.unregister(vm);
        drop(st);
        if let Err(e) = unregistered {
            self.fail(e.to_string());
        }
        self.room.notify_all();
        if let Some(p) = place {
            let _ = self.tolerate(&p.space, punch_hole(&p.space, p.offset, p.len));
        }
    }

    /// Forgets a guest memory whose process died or left: every VM in it is
    /// unregistered (its budget and swap released); operations in flight on
    /// it complete without error; its descriptors are closed.
    pub fn detach_space(&self, space: SpaceId) {
        let (target, vms) = {
            let st = self.lock();
            let Some(target) = st.spaces.get(&space).cloned() else {
                return;
            };
            let vms: Vec<VmId> = st
                .places
                .iter()
                .filter(|(_, p)| p.space.id == space)
                .map(|(&vm, _)| vm)
                .collect();
            (target, vms)
        };
        target.gone.store(true, Ordering::SeqCst);
        for vm in vms {
            self.unregister_vm(vm);
        }
        let _ = target.poll(&self.epoll, libc::EPOLL_CTL_DEL);
        self.lock().spaces.remove(&space);
    }

    /// Gives `space` the userfaultfd of a new process that maps the same
    /// memfd at the same address: its holder was started again after the
    /// last one left with every VM of it asleep. Its VMs, their blocks and
    /// their swap stay as they are, except that their resident blocks are
    /// taken as dirty (see [`Ledger::assume_dirty`]).
    ///
    /// Returns once nothing in flight still uses the old descriptor, nor
    /// the one before a [`Pager::release_process`] (an eviction holds its
    /// space from write-protect to hole punch), so from
    /// then on every write-protect, copy and wake reaches the new process:
    /// the caller lets the space's VMs run only after this returns. Refused
    /// with [`PagerError::BadSpace`] if `uffd` is not a userfaultfd, the
    /// space is unknown or failed, or the old descriptor stays in use past
    /// [`REATTACH_WAIT`].
    pub fn reattach_space(&self, space: SpaceId, uffd: OwnedFd) -> Result<(), PagerError> {
        if !crate::guest_memory::is_userfaultfd(std::os::fd::AsFd::as_fd(&uffd)) {
            return Err(reattach_refused(
                space,
                "the descriptor is not a userfaultfd",
            ));
        }
        keep_private(&uffd, true)?;
        let old = self.replace_process(space, Some(Uffd::from_fd(uffd)))?;
        let started = Instant::now();
        // Nothing begun on the old space, nor on the departed process's it
        // replaced ([`Pager::release_process`]), may still write-protect,
        // copy or punch: it would miss the new process's writes.
        while old.in_use() {
            if started.elapsed() >= REATTACH_WAIT {
                return Err(reattach_refused(space, "the old descriptor stayed in use"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }

    /// The process that mapped `space` left (a densevm holder whose VMs all
    /// sleep): the pager drops its userfaultfd, closed as soon as nothing
    /// in flight uses it, so a space asleep holds no descriptor of its own
    /// but the memfd. Until a process attaches again
    /// ([`Pager::reattach_space`]) the space is served as one whose process
    /// is gone: blocks brought back (a late prefetch) go into the memfd.
    /// Refused like [`Pager::reattach_space`] for a space unknown or failed.
    pub fn release_process(&self, space: SpaceId) -> Result<(), PagerError> {
        self.replace_process(space, None).map(drop)
    }

    /// Puts a [`Space`] with `uffd` in place of `space`'s and returns the
    /// old one, which operations in flight may still hold. With a new
    /// process its VMs' resident blocks are taken as dirty: the old one's
    /// write protection did not pass to it.
    fn replace_process(
        &self,
        space: SpaceId,
        uffd: Option<Uffd>,
    ) -> Result<Arc<Space>, PagerError> {
        let mut st = self.lock();
        let old = match st.spaces.get(&space) {
            Some(old) if !old.failed.load(Ordering::SeqCst) => Arc::clone(old),
            Some(_) => return Err(reattach_refused(space, "it failed")),
            None => return Err(reattach_refused(space, "no such space")),
        };
        let attached = uffd.is_some();
        let new = Arc::new(Space {
            id: space,
            uffd,
            memfd: Arc::clone(&old.memfd),
            memfd_offset: old.memfd_offset,
            base: old.base,
            len: old.len,
            gone: AtomicBool::new(!attached),
            failed: AtomicBool::new(false),
            previous: Arc::downgrade(&old),
        });
        let vms: Vec<VmId> = st
            .regions
            .range((space, 0)..=(space, usize::MAX))
            .map(|(_, &(vm, _))| vm)
            .collect();
        for vm in vms {
            if let Some(place) = st.places.get_mut(&vm) {
                place.space = Arc::clone(&new);
            }
            if attached {
                st.ledger.assume_dirty(vm);
            }
        }
        // Faults on the new descriptor wait in it until it is read.
        old.poll(&self.epoll, libc::EPOLL_CTL_DEL)?;
        new.poll(&self.epoll, libc::EPOLL_CTL_ADD)?;
        st.spaces.insert(space, new);
        Ok(old)
    }

    /// Tells the policy that a VM served a request (the clock's reference
    /// bit). Cheap; densevm calls it once per request.
    pub fn note_access(&self, vm: u32) {
        let r = self.lock().ledger.note_access(vm);
        if let Err(e) = r {
            self.fail(e.to_string());
        }
    }

    /// The monitor hibernated `vm` (destroyed its vCPUs and KVM VM; its
    /// memory stays registered): every resident block of it leaves memory
    /// as a victim's would (dirty ones written to swap, clean ones dropped).
    /// Returns at once: the work is queued to the pager's hibernation
    /// thread, which evicts one VM at a time, [`HIBERNATE_CHUNK`] blocks
    /// per step. Blocks busy when it gets to the VM stay (a later call
    /// takes them). The VM's later touches fault its blocks back in as
    /// usual; tell the policy with [`Pager::note_woken`]. An unknown VM is
    /// ignored; one unregistered meanwhile gives up what is left.
    pub fn hibernate(&self, vm: u32) {
        if let Some(queue) = &*self.hibernations.lock().unwrap_or_else(|e| e.into_inner()) {
            // Fails only once the thread has ended: the pager is shut down.
            let _ = queue.send(vm);
        }
    }

    /// A hibernated VM wakes (its new KVM VM is being made on the same
    /// memory): the policy is told, and what it had resident when it was
    /// hibernated is read back in one batch, REAP-style, on the pager's
    /// prefetch thread while the VM starts (`Policy::on_woken` may change
    /// or drop the list). Returns at once; an unknown VM is ignored.
    pub fn note_woken(&self, vm: u32) {
        if let Some(queue) = &*self.prefetches.lock().unwrap_or_else(|e| e.into_inner()) {
            // Fails only once the thread has ended: the pager is shut down.
            let _ = queue.send(vm);
        }
    }

    /// Charges (true) or suspends (false) the disk model's service times;
    /// see [`SwapDevice::set_modeled`]. For set-up phases such as priming
    /// every VM's swap once, whose end state matters but not its duration.
    pub fn set_disk_modeled(&self, on: bool) {
        self.swap.set_modeled(on);
    }

    /// Stops the fault-service threads and the hibernation thread, and
    /// removes the swap file unless it is kept. Faults still pending stay
    /// unserved; a hibernation in progress finishes, queued ones are
    /// dropped.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: 8-byte write to our eventfd.
        unsafe { libc::write(self.stop_fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        self.room.notify_all();
        // Closing the queues ends their threads' waits.
        for queue in [&self.hibernations, &self.prefetches] {
            queue.lock().unwrap_or_else(|e| e.into_inner()).take();
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        self.swap.remove_if_owned();
    }

    /// Totals, per-VM stats and settings:
    /// `{"totals":{...},"vms":{"<id>":{...}},"config":{...}}`.
    ///
    /// The totals include `memfd_resident_bytes`, the kernel's count of the
    /// guest RAM pages present in the memfds, taken under the same lock as
    /// `resident_bytes`: evictions free their blocks before the ledger lets
    /// them go and installs are admitted before they copy, so this count is
    /// never above the budget, where a sum of each cell's `mincore` taken
    /// at slightly different moments can be.
    pub fn stats(&self) -> Value {
        let st = self.lock();
        let mut vms = Map::new();
        for vm in st.ledger.vm_ids() {
            vms.insert(vm.to_string(), self.vm_json(&st, vm));
        }
        let present: u64 = st
            .places
            .values()
            .filter(|p| !p.space.gone.load(Ordering::SeqCst))
            .map(|p| present_bytes(&p.space.memfd, p.offset, p.len))
            .sum();
        let mut reply = self.totals_json(&st);
        reply["totals"]["memfd_resident_bytes"] = json!(present);
        reply["vms"] = Value::Object(vms);
        reply
    }

    /// Totals and settings without the per-VM stats (cheap enough to sample
    /// often): `{"totals":{...},"config":{...}}`.
    pub fn totals(&self) -> Value {
        self.totals_json(&self.lock())
    }

    fn totals_json(&self, st: &State) -> Value {
        let l = &st.ledger;
        let mut totals = l.totals.to_json();
        let t = totals.as_object_mut().expect("object");
        t.insert(
            "resident_bytes".into(),
            json!(l.resident_blocks() * self.block as u64),
        );
        t.insert("budget_bytes".into(), json!(self.cfg.budget_bytes));
        t.insert("block_bytes".into(), json!(self.block));
        t.insert("fault_latency_us".into(), st.latency.to_json());
        t.insert("vms".into(), json!(l.vm_ids().count()));
        t.insert("policy".into(), json!(l.policy_name()));
        t.insert("disk".into(), self.disk.clone());
        t.insert("disk_modeled".into(), json!(self.swap.modeled()));
        t.insert("disk_usage".into(), self.swap.disk_usage().to_json());
        t.insert("swap_path".into(), json!(self.swap.path()));
        t.insert("swap_capacity_bytes".into(), json!(self.swap.capacity()));
        let swap_used = match &self.compact {
            Some(compact) => {
                t.insert("compact_swap".into(), compact.to_json());
                compact.stored_bytes()
            }
            None => l.swap_used_bytes(),
        };
        t.insert("swap_used_bytes".into(), json!(swap_used));
        t.insert(
            "clone_template".into(),
            match &st.clone_template {
                CloneTemplate::Off => json!("off"),
                CloneTemplate::Pending => json!("pending"),
                CloneTemplate::Ready => json!("ready"),
                CloneTemplate::Failed(why) => json!({ "failed": why }),
            },
        );
        t.insert("clones_started".into(), json!(l.clones_started()));
        t.insert("fatal_error".into(), json!(self.fatal_error()));
        t.insert(
            "failures".into(),
            json!(self.failure_count.load(Ordering::SeqCst)),
        );
        let config = json!({
            "budget_bytes": self.cfg.budget_bytes,
            "block_bytes": self.block,
            "policy": l.policy_name(),
            "policy_spec": self.cfg.policy.to_string(),
            "layout": match l.layout() { SwapLayout::PerVm => "per-vm", SwapLayout::Log => "log" },
            "swap_path": self.swap.path(),
            "swap_bytes": self.swap.capacity(),
            "keep_swap": self.cfg.keep_swap,
            "compact_swap": self.cfg.compact_swap,
            "clone_template": self.cfg.clone_template,
            "vm_resident_max_bytes": self.cfg.vm_resident_max,
            "disk": self.disk,
            "service_threads": SERVICE_THREADS,
        });
        json!({"totals": totals, "config": config})
    }

    fn vm_json(&self, st: &State, vm: VmId) -> Value {
        let Some(v) = st.ledger.vm(vm) else {
            return Value::Null;
        };
        let mut j = v.stats.to_json();
        let o = j.as_object_mut().expect("object");
        o.insert(
            "resident_bytes".into(),
            json!(v.resident_blocks() as u64 * self.block as u64),
        );
        o.insert("budget_bytes".into(), json!(self.cfg.budget_bytes));
        j
    }

    /// Stats of one VM (`null` if unknown).
    pub fn vm_stats(&self, vm: u32) -> Value {
        let st = self.lock();
        self.vm_json(&st, vm)
    }

    fn service_loop(self: Arc<Self>) {
        let mut scratch = Scratch::new(self.block);
        let mut ready = [libc::epoll_event { events: 0, u64: 0 }];
        while !self.stop.load(Ordering::SeqCst) {
            // SAFETY: one valid event slot.
            let r = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), ready.as_mut_ptr(), 1, -1) };
            if r <= 0 || self.stop.load(Ordering::SeqCst) || ready[0].u64 == STOP_KEY {
                continue;
            }
            if self.failed.load(Ordering::SeqCst) {
                // Stopped: leave faults pending (their threads stay blocked)
                // and wait for shutdown.
                std::thread::sleep(WAIT_SLICE);
                continue;
            }
            let Some(space) = self.lock().spaces.get(&(ready[0].u64 as SpaceId)).cloned() else {
                continue;
            };
            let Some(uffd) = &space.uffd else {
                continue;
            };
            match uffd.read_fault() {
                Ok(Some(f)) => {
                    // A panic would leave the fault's blocks busy forever:
                    // it stops the run instead, like any fatal error.
                    let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.handle(&space, f, &mut scratch)
                    }));
                    match handled {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => self.fail(e.to_string()),
                        Err(panic) => self.fail(format!(
                            "fault-service thread panicked: {}",
                            panic_message(panic.as_ref())
                        )),
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let _ = self.tolerate(&space, Err(e));
                }
            }
        }
    }

    /// A queue's thread (hibernations, wake prefetches): runs `job` on the
    /// queued VMs one at a time until shutdown.
    fn queue_loop(
        self: Arc<Self>,
        requests: mpsc::Receiver<VmId>,
        what: &str,
        job: fn(&Pager, VmId, &mut Scratch) -> Result<(), PagerError>,
    ) {
        let mut scratch = Scratch::new(self.block);
        while let Ok(vm) = requests.recv() {
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            if self.failed.load(Ordering::SeqCst) {
                continue;
            }
            // A panic would leave the VM's blocks busy forever: it stops the
            // run instead, like any fatal error.
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                job(&self, vm, &mut scratch)
            }));
            match done {
                Ok(Ok(())) => {}
                Ok(Err(e)) => self.fail(e.to_string()),
                Err(panic) => self.fail(format!(
                    "{what} thread panicked: {}",
                    panic_message(panic.as_ref())
                )),
            }
        }
    }

    /// Reads back what `vm` had resident when hibernated (see
    /// [`Pager::note_woken`]), as one fault of all those blocks.
    fn prefetch_now(&self, vm: VmId, s: &mut Scratch) -> Result<(), PagerError> {
        let t0 = Instant::now();
        let mut st = self.lock();
        let Some(place) = st.places.get(&vm).cloned() else {
            return Ok(());
        };
        if !self.commit_swap(&mut st, vm) {
            return Ok(());
        }
        let mut plan = std::mem::take(&mut s.plan);
        st.ledger.plan_wake(vm, &mut plan)?;
        if plan.is_empty() {
            s.plan = plan;
            return Ok(());
        }
        let first = self
            .cfg
            .wake_first
            .map(|at| (at / self.block as u64) as BlockId);
        self.bring_in(st, vm, &place, plan, t0, Resume::PartByPart(first), s)
    }

    /// Evicts every resident block of `vm` (see [`Pager::hibernate`]).
    /// The whole VM is planned at once, so the log layout gives its set one
    /// extent, and evicted [`HIBERNATE_CHUNK`] blocks at a time: faults
    /// waiting on its blocks, or for room, resume after each part.
    fn hibernate_now(&self, vm: VmId, s: &mut Scratch) -> Result<(), PagerError> {
        let mut st = self.lock();
        let Some(place) = st.places.get(&vm).cloned() else {
            return Ok(());
        };
        let template_pending =
            st.clone_template == CloneTemplate::Pending && self.cfg.clone_template == Some(vm);
        if template_pending && st.ledger.in_flight(vm) {
            let since = *st.template_deferred.get_or_insert_with(Instant::now);
            if since.elapsed() < TEMPLATE_SETTLE {
                // Behind the other hibernations, which this thread serves
                // meanwhile: waiting here for the fault, which may wait for
                // room they make, could never end.
                drop(st);
                std::thread::sleep(TEMPLATE_RETRY);
                self.hibernate(vm);
                return Ok(());
            }
        }
        // Clone boot's template is its VM's first hibernation, saved whole;
        // without one (or once it failed) the first VM hibernated is the
        // compact store's template, as a base for differences only.
        let (capture, template) = match &st.clone_template {
            CloneTemplate::Pending => (
                template_pending,
                template_pending.then(|| st.ledger.never_evicted(vm)),
            ),
            _ => (true, None),
        };
        let planned = st.ledger.plan_hibernation(vm);
        self.report_failed_vms(&mut st);
        let mut plan = planned?;
        drop(st);
        let places = vec![place; plan.len().min(HIBERNATE_CHUNK)];
        let compact = self.compact.as_ref().filter(|_| capture);
        if let Some(compact) = compact {
            compact.begin_capture(vm, self.vm_ram as usize);
        }
        let evicted = self.evict_hibernating(vm, &mut plan, &places, s);
        if let Some(compact) = compact {
            compact.end_capture(vm);
        }
        if let Some(whole) = template {
            self.seal_clone_template(vm, whole);
        }
        evicted
    }

    /// The clone template's VM `vm` was hibernated (`whole`: with nothing
    /// of it on swap from before): it is the template if all of its memory
    /// was captured, unless the template was abandoned meanwhile.
    fn seal_clone_template(&self, vm: VmId, whole: bool) {
        let mut st = self.lock();
        if st.clone_template != CloneTemplate::Pending {
            return;
        }
        let captured = self.compact.as_ref().and_then(CompactSwap::template_vm) == Some(vm);
        st.clone_template = if !whole {
            CloneTemplate::Failed(format!("VM {vm} had memory on swap before it was saved"))
        } else if !captured {
            CloneTemplate::Failed(format!("VM {vm}'s memory was not captured"))
        } else if !st.ledger.set_clone_source(vm) {
            CloneTemplate::Failed(format!(
                "VM {vm} kept memory in use through its hibernation"
            ))
        } else {
            CloneTemplate::Ready
        };
    }

    /// Where clone boot's template stands: the owner starts VMs as clones
    /// only once it is [`CloneTemplate::Ready`].
    pub fn clone_template(&self) -> CloneTemplate {
        self.lock().clone_template.clone()
    }

    /// Gives up waiting for the clone template (`why`): VMs start from
    /// zeros, as without clone boot, even if it is saved later.
    pub fn abandon_clone_template(&self, why: &str) {
        let mut st = self.lock();
        if st.clone_template == CloneTemplate::Pending {
            st.clone_template = CloneTemplate::Failed(why.to_string());
        }
    }

    /// Evicts a hibernating VM's plan [`HIBERNATE_CHUNK`] blocks at a time.
    fn evict_hibernating(
        &self,
        vm: VmId,
        plan: &mut [PlanBlock],
        places: &[Place],
        s: &mut Scratch,
    ) -> Result<(), PagerError> {
        let mut start = 0;
        while start < plan.len() && !self.failed.load(Ordering::SeqCst) {
            let end = (start + HIBERNATE_CHUNK).min(plan.len());
            let io = self.evict(&mut plan[start..end], &places[..end - start], s)?;
            let mut st = self.lock();
            s.wakes.clear();
            st.ledger
                .finish_hibernation(&plan[start..end], io, &mut s.wakes);
            start = end;
            if start < plan.len() && st.ledger.vm(vm).is_none_or(VmLedger::is_dying) {
                // Being unregistered (or failed): its memory is about to be
                // freed, and its owner waits for these blocks.
                st.ledger.abandon_eviction(&plan[start..], &mut s.wakes);
                start = plan.len();
            }
            st.addrs(&s.wakes, self.block, &mut s.addrs);
            drop(st);
            self.room.notify_all();
            self.wake(&mut s.addrs);
        }
        Ok(())
    }

    /// Wakes the faults waiting on `addrs`, and forgets them: no space is
    /// kept alive past its use (see [`Pager::reattach_space`]).
    fn wake(&self, addrs: &mut Vec<WakeAddr>) {
        for (space, a) in addrs.drain(..) {
            // A failed wake means the range is gone (VM destroyed).
            let _ = space.uffd().and_then(|uffd| uffd.wake(a, self.block));
        }
    }

    fn handle(&self, space: &Arc<Space>, f: Fault, s: &mut Scratch) -> Result<(), PagerError> {
        if space.failed.load(Ordering::SeqCst) {
            // Read before its descriptor left the epoll set: never served.
            return Ok(());
        }
        let t0 = Instant::now();
        let mut st = self.lock();
        let Some((vm, place)) = st.lookup(space.id, f.addr) else {
            return Ok(());
        };
        if !self.commit_swap(&mut st, vm) {
            return Ok(());
        }
        let block = ((f.addr - place.base) / self.block) as BlockId;
        let baddr = place.addr(block, self.block);
        let access = match f.kind {
            FaultKind::Missing { write: false } => Access::Read,
            FaultKind::Missing { write: true } => Access::Write,
            FaultKind::WriteProtect => Access::WriteProtect,
        };
        match st.ledger.classify(vm, block, access) {
            Classified::Gone | Classified::Defer => Ok(()),
            Classified::Stale => {
                drop(st);
                self.wake(&mut vec![(Arc::clone(space), baddr)]);
                Ok(())
            }
            Classified::Unprotect => {
                drop(st);
                let unprotected = space
                    .uffd()
                    .and_then(|uffd| uffd.write_protect(baddr, self.block, false));
                self.tolerate(space, unprotected)?;
                let mut st = self.lock();
                s.wakes.clear();
                st.ledger.end_unprotect(vm, block, &mut s.wakes);
                st.addrs(&s.wakes, self.block, &mut s.addrs);
                drop(st);
                self.room.notify_all();
                self.wake(&mut s.addrs);
                Ok(())
            }
            Classified::FaultIn => {
                self.fault_in(st, vm, place, block, access == Access::Write, t0, s)?;
                injected::spend(self.cfg.inject_fault, injected::Work::Kernel);
                Ok(())
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn fault_in<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        vm: VmId,
        place: Place,
        block: BlockId,
        write: bool,
        t0: Instant,
        s: &mut Scratch,
    ) -> Result<(), PagerError> {
        let mut plan = std::mem::take(&mut s.plan);
        st.ledger.plan_fault(vm, block, write, &mut plan)?;
        self.bring_in(st, vm, &place, plan, t0, Resume::Accounted, s)
    }

    /// Commits swap to `vm` before any block of it comes in, if that was
    /// not done at its registration (see [`Ledger::commit_swap`] and
    /// `PagerConfig::swap_on_first_fault`): a VM registered asleep and
    /// never woken costs the disk nothing. The device is allocated under
    /// the lock, as nothing may be placed where it is not (an fallocate of
    /// [`crate::swap::RESERVE_STEP`] took under 1 ms here, once per 64 VMs
    /// of 4 MiB). A VM the disk has no room for fails alone, at its first
    /// fault. Returns whether the fault may go on.
    fn commit_swap(&self, st: &mut State, vm: VmId) -> bool {
        match st.ledger.commit_swap(vm, |bytes| self.reserve_swap(bytes)) {
            Ok(()) => true,
            Err(e) => {
                st.ledger
                    .fail_vm(vm, format!("no swap for its memory: {e}"));
                self.report_failed_vms(st);
                false
            }
        }
    }

    /// Allocates the swap file's first `bytes` for committed VMs' copies;
    /// nothing with compact swap, whose records allocate as they are
    /// written.
    fn reserve_swap(&self, bytes: u64) -> Result<(), PagerError> {
        match self.compact {
            Some(_) => Ok(()),
            None => self.swap.reserve(bytes, RESERVE_STEP),
        }
    }

    /// Brings a planned fault-in (or wake prefetch) in: room first (waiting
    /// or evicting as the ledger says), then one read and the installs;
    /// `resume` says when the threads waiting on the blocks run.
    #[allow(clippy::too_many_arguments)]
    fn bring_in<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        vm: VmId,
        place: &Place,
        plan: Vec<PlanBlock>,
        t0: Instant,
        resume: Resume,
        s: &mut Scratch,
    ) -> Result<(), PagerError> {
        let n = plan.len() as u64;
        loop {
            if self.failed.load(Ordering::SeqCst) {
                return Ok(());
            }
            let admission = st.ledger.admit(n, vm);
            self.report_failed_vms(&mut st);
            match admission? {
                Admission::Go => break,
                Admission::Abandon => {
                    // The VM began dying (or failed) after this fault was
                    // classified: it evicts nobody and installs nothing.
                    s.wakes.clear();
                    st.ledger.abandon_fault(&plan, &mut s.wakes);
                    st.addrs(&s.wakes, self.block, &mut s.addrs);
                    drop(st);
                    self.room.notify_all();
                    self.wake(&mut s.addrs);
                    s.plan = plan;
                    return Ok(());
                }
                Admission::Wait => {
                    st = self
                        .room
                        .wait_timeout(st, WAIT_SLICE)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                Admission::Evict(mut victims) => {
                    let places: Vec<Place> =
                        victims.iter().map(|p| st.places[&p.vm].clone()).collect();
                    drop(st);
                    let io = self.evict(&mut victims, &places, s)?;
                    st = self.lock();
                    s.wakes.clear();
                    st.ledger.finish_eviction(&victims, io, &mut s.wakes);
                    st.addrs(&s.wakes, self.block, &mut s.addrs);
                    drop(st);
                    self.room.notify_all();
                    self.wake(&mut s.addrs);
                    st = self.lock();
                }
            }
        }
        drop(st);
        let mut io = 0.0;
        // A wake reads the piece holding its first block first, too.
        let lead = match resume {
            Resume::PartByPart(Some(first)) => plan.iter().position(|p| p.block == first),
            _ => None,
        };
        for r in lead_first(plan.len(), self.io_chunk_blocks(), lead) {
            let piece = &plan[r.clone()];
            io += self.read_plan(piece, s)?;
            match resume {
                Resume::Accounted => {
                    self.unpack_plan(piece, 0..piece.len(), s)?;
                    self.install(piece, 0, place, s)?
                }
                Resume::PartByPart(_) => {
                    let lead = lead.filter(|i| r.contains(i)).map(|i| i - r.start);
                    self.install_waking(piece, lead, place, s)?
                }
            }
        }
        let latency = t0.elapsed().as_micros() as u64;
        let mut st = self.lock();
        s.wakes.clear();
        st.ledger.finish_install(&plan, io, latency, &mut s.wakes);
        st.latency.record(latency);
        let r = st.ledger.check_policy();
        drop(st);
        self.room.notify_all();
        // A fault's blocks were installed without waking: the faulting
        // thread and any other waiting on them (deferred ones included)
        // resume only now that the ledger and the stats account for them.
        if let Resume::Accounted = resume {
            self.wake_installed(&plan, place);
        }
        s.plan = plan;
        r
    }

    /// Installs a wake prefetch's piece (read by [`Self::read_plan`]) a part
    /// at a time, the part holding `piece[lead]` first, and wakes each
    /// part's blocks as it lands. Each part is decoded just before it is
    /// installed: the first lands without waiting for the others' decoding
    /// (about 4 us a block here).
    fn install_waking(
        &self,
        piece: &[PlanBlock],
        lead: Option<usize>,
        place: &Place,
        s: &mut Scratch,
    ) -> Result<(), PagerError> {
        let part = (WAKE_PART_BYTES / self.block).max(1);
        for r in lead_first(piece.len(), part, lead) {
            self.unpack_plan(piece, r.clone(), s)?;
            self.install(&piece[r.clone()], r.start, place, s)?;
            self.wake_installed(&piece[r], place);
        }
        Ok(())
    }

    /// Wakes the threads waiting on the installed blocks of `plan`, one
    /// wake per run of adjacent blocks.
    fn wake_installed(&self, plan: &[PlanBlock], place: &Place) {
        let bs = self.block;
        for run in runs(plan, |a, b| b.block == a.block + 1) {
            let at = place.addr(plan[run.start].block, bs);
            // A failed wake means the range is gone (VM destroyed).
            let _ = place
                .space
                .uffd()
                .and_then(|uffd| uffd.wake(at, run.len() * bs));
        }
    }

    /// Reads the plan's blocks with one request per run contiguous on
    /// swap: into `s.read` (slot i = plan[i]), zero-filling blocks without a
    /// swap copy; from the compact store, as stored, for
    /// [`Self::unpack_plan`] to decode into those slots.
    fn read_plan(&self, plan: &[PlanBlock], s: &mut Scratch) -> Result<f64, PagerError> {
        let bs = self.block;
        s.read.reserve(plan.len() * bs);
        if let Some(compact) = &self.compact {
            let locs = plan.iter().map(|p| (p.loc != NO_LOC).then_some(p.loc));
            return compact.fetch(&self.swap, locs, &mut s.compact);
        }
        read_runs(plan, bs as u64, &mut s.order, &mut s.runs);
        let mut slots: Vec<&mut [u8]> = s.read.as_mut_slice()[..plan.len() * bs]
            .chunks_mut(bs)
            .collect();
        for (i, p) in plan.iter().enumerate() {
            if p.loc == NO_LOC {
                slots[i].fill(0);
            }
        }
        let mut io = 0.0;
        for &(a, b) in &s.runs {
            let first = plan[s.order[a]].loc;
            // Take the run's slots out in swap order (each slot once).
            let mut bufs: Vec<&mut [u8]> = Vec::with_capacity(b - a);
            for &i in &s.order[a..b] {
                bufs.push(std::mem::take(&mut slots[i]));
            }
            io += self.swap.read_scattered(first, &mut bufs)?;
        }
        Ok(io)
    }

    /// Decodes blocks `range` of the plan [`Self::read_plan`] read into
    /// their slots of `s.read` (the compact store's; the plain store's are
    /// there already). A block without a stored copy is the template's or
    /// zeros.
    fn unpack_plan(
        &self,
        plan: &[PlanBlock],
        range: std::ops::Range<usize>,
        s: &mut Scratch,
    ) -> Result<(), PagerError> {
        let Some(compact) = &self.compact else {
            return Ok(());
        };
        let bs = self.block;
        let slots = s.read.as_mut_slice()[range.start * bs..range.end * bs].chunks_mut(bs);
        for (i, data) in range.zip(slots) {
            let p = &plan[i];
            if p.loc != NO_LOC {
                let mut get = Get {
                    block: p.block,
                    loc: p.loc,
                    data,
                };
                compact.decode_fetched(i, &s.compact, &mut get)?;
                continue;
            }
            match compact.template_block(p.block).filter(|_| p.from_template) {
                Some(template) => data.copy_from_slice(template),
                None => data.fill(0),
            }
        }
        Ok(())
    }

    /// Installs the plan's blocks from `s.read`, whose slot `slot + i` holds
    /// `plan[i]`, with one UFFDIO_COPY per run of adjacent blocks; clean
    /// blocks come in write-protected.
    fn install(
        &self,
        plan: &[PlanBlock],
        slot: usize,
        place: &Place,
        s: &Scratch,
    ) -> Result<(), PagerError> {
        let bs = self.block;
        let buf = &s.read.as_slice()[slot * bs..];
        for std::ops::Range { start: i, end: j } in
            runs(plan, |a, b| b.block == a.block + 1 && b.dirty == a.dirty)
        {
            let dst = place.addr(plan[i].block, bs);
            // SAFETY: source is our buffer of (j-i) blocks; the destination
            // blocks are registered and absent (busy in the ledger).
            let copied = place.space.uffd().and_then(|uffd| unsafe {
                uffd.copy(dst, buf[i * bs..].as_ptr(), (j - i) * bs, !plan[i].dirty)
            });
            match copied {
                // Its process is gone (a holder that left with its VMs
                // asleep, a prefetch that came after): the blocks go to the
                // memfd itself, so the memory holds what the ledger says.
                Err(e) if place.space.gone.load(Ordering::SeqCst) || space_gone(&e) => {
                    place.space.gone.store(true, Ordering::SeqCst);
                    let at = place.offset(plan[i].block, bs);
                    let written = pwrite_all(&place.space.memfd, &buf[i * bs..j * bs], at);
                    self.tolerate(&place.space, written)?;
                }
                other => self.tolerate(&place.space, other)?,
            }
        }
        Ok(())
    }

    /// Blocks in one piece of I/O ([`IO_CHUNK_BYTES`], at least one block).
    fn io_chunk_blocks(&self) -> usize {
        (IO_CHUNK_BYTES / self.block).max(1)
    }

    /// Evicts the victims, a piece at a time ([`IO_CHUNK_BYTES`]).
    /// `places[i]` is where `victims[i]`'s VM lives.
    fn evict(
        &self,
        victims: &mut [PlanBlock],
        places: &[Place],
        s: &mut Scratch,
    ) -> Result<f64, PagerError> {
        let n = self.io_chunk_blocks();
        let mut io = 0.0;
        for (victims, places) in victims.chunks_mut(n).zip(places.chunks(n)) {
            io += self.evict_piece(victims, places, s)?;
        }
        Ok(io)
    }

    /// Evicts one piece of victims: write-protect, write dirty ones to
    /// swap, drop.
    fn evict_piece(
        &self,
        victims: &mut [PlanBlock],
        places: &[Place],
        s: &mut Scratch,
    ) -> Result<f64, PagerError> {
        let bs = self.block;
        let addrs: Vec<usize> = victims
            .iter()
            .zip(places)
            .map(|(v, p)| p.addr(v.block, bs))
            .collect();
        let offsets: Vec<usize> = victims
            .iter()
            .zip(places)
            .map(|(v, p)| p.offset(v.block, bs))
            .collect();
        let addr = |i: usize| addrs[i];
        let offset = |i: usize| offsets[i];
        // Runs of blocks adjacent in one VM's memory.
        let adjacent_runs: Vec<_> =
            runs(victims, |a, b| b.vm == a.vm && b.block == a.block + 1).collect();
        // 1. Stop writers: from here on a write blocks on the protection.
        for run in &adjacent_runs {
            let space = &places[run.start].space;
            let protected = space
                .uffd()
                .and_then(|uffd| uffd.write_protect(addr(run.start), run.len() * bs, true));
            self.tolerate(space, protected)?;
        }
        // 2. A block flagged dirty whose memory still hashes like its swap
        //    copy (zeros without one) needs no write: the copy stays. One to
        //    be written takes the hash of what is written. The ledger says
        //    which blocks to hash (`PlanBlock::hash`); the others are written
        //    unhashed. Victim i is read into slot i of the write buffer,
        //    once: the blocks are write-protected, nobody changes them until
        //    they are dropped.
        s.write.reserve(victims.len() * bs);
        let buf = s.write.as_mut_slice();
        let mut in_buf = vec![false; victims.len()];
        for (i, v) in victims.iter_mut().enumerate().filter(|(_, v)| v.dirty) {
            if !v.hash {
                v.sum = 0;
                continue;
            }
            let slot = &mut buf[i * bs..(i + 1) * bs];
            self.tolerate(
                &places[i].space,
                pread_exact(&places[i].space.memfd, slot, offset(i)),
            )?;
            in_buf[i] = true;
            let sum = content_sum(&self.content_key, slot);
            let copy = if v.old_loc == NO_LOC {
                self.zero_sum
            } else {
                v.sum
            };
            if sum == copy {
                v.dirty = false;
            } else {
                v.sum = sum;
            }
        }
        // 3. Copy dirty blocks out, one write per run contiguous on swap,
        //    runs joined across short gaps of unchanged blocks; or, compact,
        //    as records packed into one write.
        let mut io = 0.0;
        let mut read_in = |k: usize, buf: &mut [u8]| -> Result<(), PagerError> {
            if !in_buf[k] {
                let read = pread_exact(
                    &places[k].space.memfd,
                    &mut buf[k * bs..(k + 1) * bs],
                    offset(k),
                );
                self.tolerate(&places[k].space, read)?;
                in_buf[k] = true;
            }
            Ok(())
        };
        if let Some(compact) = &self.compact {
            let stored = |v: &PlanBlock| v.dirty && v.loc != NO_LOC;
            for k in (0..victims.len()).filter(|&k| stored(&victims[k])) {
                read_in(k, buf)?;
            }
            let puts: Vec<Put<'_>> = victims
                .iter()
                .enumerate()
                .filter(|(_, v)| stored(v))
                .map(|(k, v)| Put {
                    vm: v.vm,
                    block: v.block,
                    loc: v.loc,
                    data: &buf[k * bs..(k + 1) * bs],
                })
                .collect();
            io += compact.write(&self.swap, &puts, &mut s.compact)?;
            // The log layout moved these copies: their old records go.
            let moved: Vec<u64> = victims
                .iter()
                .filter(|v| v.dirty && v.old_loc != NO_LOC && v.old_loc != v.loc)
                .map(|v| v.old_loc)
                .collect();
            compact.forget(&moved);
        } else {
            cluster_writes(victims, bs as u64);
            for std::ops::Range { start: i, end: j } in write_runs(victims, bs as u64) {
                for k in i..j {
                    read_in(k, buf)?;
                }
                io += self.swap.write(victims[i].loc, &buf[i * bs..j * bs])?;
            }
        }
        // 4. Free the blocks; their next touch faults them back in.
        for run in adjacent_runs {
            let space = &places[run.start].space;
            self.tolerate(space, punch_hole(space, offset(run.start), run.len() * bs))?;
        }
        Ok(io)
    }
}

/// Keyed hash of a block's content; never 0 (0 means unknown). BLAKE3
/// hashes a block's 1 KiB chunks in parallel SIMD lanes: a 32k block costs a
/// few microseconds, where SipHash took a quarter of the pager's CPU.
fn content_sum(key: &[u8; 32], data: &[u8]) -> u64 {
    let hash = blake3::keyed_hash(key, data);
    let head: [u8; 8] = hash.as_bytes()[..8].try_into().expect("32-byte hash");
    u64::from_le_bytes(head).max(1)
}

fn epoll_ctl(epoll: &OwnedFd, op: libc::c_int, fd: RawFd, key: u64) -> Result<(), PagerError> {
    let mut event = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: key,
    };
    // SAFETY: valid descriptors and event.
    if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, fd, &mut event) } != 0 {
        return Err(PagerError::Mm {
            op: "epoll_ctl",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Sets close-on-exec on a descriptor the pager keeps (and O_NONBLOCK too
/// when `nonblocking`).
fn keep_private(fd: &OwnedFd, nonblocking: bool) -> Result<(), PagerError> {
    let fd = fd.as_raw_fd();
    let err = |op| PagerError::Mm {
        op,
        source: std::io::Error::last_os_error(),
    };
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return Err(err("fcntl(F_SETFD, FD_CLOEXEC)"));
    }
    if nonblocking {
        // SAFETY: as above.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } != 0 {
            return Err(err("fcntl(F_SETFL, O_NONBLOCK)"));
        }
    }
    Ok(())
}

/// Why [`Pager::reattach_space`] or [`Pager::release_process`] refused.
fn reattach_refused(space: SpaceId, why: &str) -> PagerError {
    PagerError::BadSpace {
        reason: format!("reattach space {space}: {why}"),
    }
}

/// Writes all of `buf` into the memfd at `offset`.
fn pwrite_all(memfd: &OwnedFd, buf: &[u8], offset: usize) -> Result<(), PagerError> {
    use std::os::unix::fs::FileExt;
    // SAFETY: a borrowed view of the memfd, never closed through it.
    let file =
        std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(memfd.as_raw_fd()) });
    file.write_all_at(buf, offset as u64)
        .map_err(|source| PagerError::Mm {
            op: "pwrite(guest memory)",
            source,
        })
}

/// Reads guest memory at `offset` of a space's memfd.
fn pread_exact(memfd: &OwnedFd, buf: &mut [u8], offset: usize) -> Result<(), PagerError> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the destination is our buffer, `len - done` bytes long.
        let n = unsafe {
            libc::pread(
                memfd.as_raw_fd(),
                buf[done..].as_mut_ptr().cast(),
                buf.len() - done,
                (offset + done) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(PagerError::Mm {
                    op: "pread(guest memory)",
                    source: std::io::ErrorKind::UnexpectedEof.into(),
                })
            }
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(PagerError::Mm {
                        op: "pread(guest memory)",
                        source: e,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Frees `len` bytes of a space's memory at `offset`: gone from every
/// mapping of the memfd, so the next touch is a missing fault.
fn punch_hole(space: &Space, offset: usize, len: usize) -> Result<(), PagerError> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on a memfd we hold.
    if unsafe {
        libc::fallocate(
            space.memfd.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    } != 0
    {
        return Err(PagerError::Mm {
            op: "fallocate(PUNCH_HOLE)",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Bytes of `[offset, offset + len)` of a memfd that hold pages, found with
/// `SEEK_DATA`/`SEEK_HOLE` (shmem answers them from its page cache), so the
/// pager counts them without mapping guest memory. The pager does only
/// positioned I/O on the memfd, so moving its file offset disturbs nothing.
/// An error (the memfd is gone) counts as nothing present.
fn present_bytes(memfd: &OwnedFd, offset: usize, len: usize) -> u64 {
    let fd = memfd.as_raw_fd();
    let end = (offset + len) as libc::off_t;
    let mut at = offset as libc::off_t;
    let mut present = 0;
    while at < end {
        // SAFETY: lseek on a memfd we hold.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 || data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let hole = if hole < 0 { end } else { hole.min(end) };
        present += (hole - data) as u64;
        at = hole;
    }
    present
}

/// The text of a caught panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    fn memfd(len: usize) -> OwnedFd {
        // SAFETY: a fresh memfd, owned by the returned OwnedFd.
        let fd = unsafe { libc::memfd_create(c"present-bytes".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: as above.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on the memfd just made.
        assert_eq!(
            unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) },
            0
        );
        fd
    }

    fn touch(fd: &OwnedFd, page: usize) {
        let byte = [1u8];
        // SAFETY: pwrite of one byte from a live buffer.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                byte.as_ptr().cast(),
                1,
                (page * PAGE) as libc::off_t,
            )
        };
        assert_eq!(n, 1);
    }

    #[test]
    fn present_bytes_counts_the_pages_of_a_range_and_not_its_holes() {
        let fd = memfd(64 * PAGE);
        for page in [0, 1, 2, 10, 31, 32, 63] {
            touch(&fd, page);
        }
        assert_eq!(present_bytes(&fd, 0, 64 * PAGE), 7 * PAGE as u64);
        // A range cuts the runs at its ends: pages 1-2 and 10 of 1..11.
        assert_eq!(present_bytes(&fd, PAGE, 10 * PAGE), 3 * PAGE as u64);
        assert_eq!(present_bytes(&fd, 32 * PAGE, 31 * PAGE), PAGE as u64);
        assert_eq!(present_bytes(&fd, 40 * PAGE, 10 * PAGE), 0);
        let fake = Space {
            id: 0,
            uffd: None,
            memfd: Arc::new(fd),
            memfd_offset: 0,
            base: 0,
            len: 64 * PAGE,
            gone: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            previous: Weak::new(),
        };
        punch_hole(&fake, 0, 2 * PAGE).expect("punch");
        assert_eq!(present_bytes(&fake.memfd, 0, 64 * PAGE), 5 * PAGE as u64);
    }
}
