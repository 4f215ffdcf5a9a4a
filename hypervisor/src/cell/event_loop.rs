//! A cell's event loop (its front): its socket and its VMs' connections on
//! one side, their rings on the other, the links to its holders (which own
//! the KVM VMs, see `holder`) and the link to the parent process, which
//! holds the pager and the control API.
//!
//! One thread does all host-side I/O of the cell. Guests notify it through
//! doorbell eventfds, one per VM, so a ring names the VM to look at; it
//! notifies guests through their irqfds, only when a guest is idle.

use crate::cell::cpu_governor::CpuGovernor;
use crate::cell::hibernation::{self, Candidate, Cap, FirstStart, SleepQueue, SleepStats};
use crate::cell::listener::{self, ACCEPTS_PER_TURN};
use crate::cell::microvm::{self, AdoptError, MicroVm, Sleep};
use crate::cell::proxy::{self, Drained, Proxy, Readiness, MIN_REQUEST_BYTES};
use crate::cell::stats;
use crate::cell::vmtable::{DeadVm, VmEntry, VmState, VmTable};
use crate::config::Hibernation;
use crate::guest::abi;
use crate::holder::builder::{BuildContext, Start};
use crate::holder::{self, FromHolder, Holder, Presence};
use crate::link::framing::{FrameError, LineStream};
use crate::link::idle_profile::Now;
use crate::link::pager_link::PagerLink;
use crate::link::protocol::{FromCell, Request, ToCell, MAX_LINK_LINE};
use crate::scheduling::VcpuCpus;
use crate::vstate::vcpu::RunState;
use mio::net::UnixStream;
use mio::{Events, Interest, Poll, Token};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

const LINK: Token = Token(0);
const KIND_SHIFT: usize = 28;
const KIND_HOLDER: usize = 1;
const KIND_LISTENER: usize = 2;
const KIND_DOORBELL: usize = 3;
const KIND_CONN: usize = 4;
/// Longest a holder may take to stop its VMs and exit at shutdown.
const HOLDER_TEARDOWN: Duration = Duration::from_secs(30);
/// Longest a holder that left, its link closed, may take to exit.
const HOLDER_EXIT: Duration = Duration::from_secs(2);
/// Longest a served-request count waits before it is reported to the pager.
const ACCESS_REPORT_DELAY: Duration = Duration::from_millis(20);
/// Doorbells in a row that brought nothing (no record retired, no rx byte
/// consumed) before a VM's doorbell is put off: a guest ringing in a loop
/// would otherwise keep the cell's loop awake for nothing.
const STORM_RINGS: u32 = 32;
/// First put-off of a storming VM's doorbell; it doubles while the storm
/// lasts, up to [`DOORBELL_BACKOFF_MAX`], and is forgotten at the first
/// doorbell that brings progress.
const DOORBELL_BACKOFF_MIN: Duration = Duration::from_millis(1);
/// Longest a storming VM's doorbell is put off: its output waits at most
/// this long (a normal guest rings only with something to say).
const DOORBELL_BACKOFF_MAX: Duration = Duration::from_millis(64);
/// How long accepting waits after it failed (out of descriptors, say).
const ACCEPT_RETRY: Duration = Duration::from_millis(10);
/// How often connections pinned by their guest, and lingering ones past
/// their deadline, are looked for.
const PINNED_SWEEP: Duration = Duration::from_secs(1);

fn token(kind: usize, index: usize) -> Token {
    Token((kind << KIND_SHIFT) | index)
}

fn conn_token(key: usize) -> Token {
    token(KIND_CONN, key)
}

/// Why the event loop ended.
#[derive(Debug)]
pub enum Exit {
    /// The parent asked the cell to stop.
    Shutdown,
    /// The parent is gone (its end of the link closed).
    ParentGone,
}

/// Why the event loop could not go on.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    /// Polling or registering a source failed.
    #[error("event loop: {0}")]
    Poll(#[from] io::Error),
}

/// Why the front could not take a VM its holder built.
#[derive(Debug, thiserror::Error)]
enum AdoptFailure {
    /// The VM's slot has no irq eventfd left.
    #[error("VM {0}: no irq")]
    NoIrq(u32),
    /// Its memory or statistics.
    #[error(transparent)]
    Adopt(#[from] AdoptError),
    /// It could not be registered with the loop.
    #[error("VM {vm}: {source}")]
    Register {
        /// VM index.
        vm: u32,
        /// The registration error.
        source: io::Error,
    },
}

/// Parameters of [`CellLoop::new`].
pub struct CellLoopSetup {
    /// Shared build context.
    pub ctx: BuildContext,
    /// Each slot's doorbell eventfd, if made at the start.
    pub doorbells: Vec<Option<EventFd>>,
    /// Each slot's irq eventfd, until its VM takes it.
    pub irqs: Vec<Option<EventFd>>,
    /// The holders, one per `ctx.ram_slots_per_holder` slots.
    pub holders: Vec<Holder>,
    /// The cell's socket, which gets every connection to its VMs.
    pub listener: mio::net::TcpListener,
    /// The link to the parent.
    pub link: std::os::unix::net::UnixStream,
    /// When the boot started.
    pub boot_started: Instant,
    /// A VM not up by then is stopped as a boot failure.
    pub boot_timeout: Duration,
    /// Busy work per served request (`--inject-request-us`).
    pub inject_request: Duration,
    /// When idle VMs are hibernated, if they are.
    pub hibernation: Option<Hibernation>,
    /// Index of this cell.
    pub cell: u32,
    /// Where its vCPU threads run, serving and demoted.
    pub vcpu_cpus: VcpuCpus,
}

/// The pager's view from a cell: served requests and stopped VMs, reported
/// over the link to the parent. Counts are batched for a short while so a
/// busy cell sends one line per turn of its loop, not one per request.
struct ParentLink {
    link: LineStream<UnixStream>,
    counts: Vec<(u32, u64)>,
    since: Option<Instant>,
}

impl ParentLink {
    fn send(&mut self, message: &FromCell) {
        let line = serde_json::to_vec(message).expect("cell messages serialize");
        self.link.queue(&line);
        let _ = self.link.flush();
    }

    /// Sends `message` with descriptor `fd` attached to its first byte,
    /// after everything queued before it (waiting up to `within` for the
    /// socket to take that).
    fn send_with_fd(
        &mut self,
        message: &FromCell,
        fd: &OwnedFd,
        within: Duration,
    ) -> io::Result<()> {
        let deadline = Instant::now() + within;
        while !self.link.flush()? {
            if Instant::now() >= deadline {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "parent link full"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let mut line = serde_json::to_vec(message).expect("cell messages serialize");
        line.push(b'\n');
        let raw = self.link.stream.as_raw_fd();
        // SAFETY: a borrowed view of our own socket, never closed through it.
        let socket = std::mem::ManuallyDrop::new(unsafe {
            <std::os::unix::net::UnixStream as std::os::fd::FromRawFd>::from_raw_fd(raw)
        });
        let sent = vmm_sys_util::sock_ctrl_msg::ScmSocket::send_with_fds(
            &*socket,
            &[&line[..]],
            &[fd.as_raw_fd()],
        )
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        if sent != line.len() {
            // A line cut after its descriptor went would be misread.
            return Err(io::Error::other("parent link took part of a line"));
        }
        Ok(())
    }

    /// Sends the batched counts if they have waited long enough (or `now`).
    fn report_access(&mut self, force: bool) {
        let Some(since) = self.since else { return };
        if force || since.elapsed() >= ACCESS_REPORT_DELAY {
            let counts = std::mem::take(&mut self.counts);
            self.since = None;
            self.send(&FromCell::Access { counts });
        }
    }
}

impl PagerLink for ParentLink {
    fn requests_served(&mut self, vm: u32, requests: u64) {
        self.counts.push((vm, requests));
        self.since.get_or_insert_with(Instant::now);
    }

    fn vm_stopped(&mut self, vm: u32) {
        self.report_access(true);
        self.send(&FromCell::Stopped { vm });
    }
}

/// A cell's event loop: its VMs, their connections, the link to the parent.
pub struct CellLoop {
    poll: Poll,
    ctx: BuildContext,
    /// Each slot's doorbell while its VM is awake (or booting).
    doorbells: Vec<Option<EventFd>>,
    irqs: Vec<Option<EventFd>>,
    holders: Vec<Holder>,
    listener: mio::net::TcpListener,
    /// Accept again then, without a new event: a turn's worth was taken
    /// (now), or accepting failed (a little later).
    accept_due: Option<Instant>,
    /// VMs asked to stop whose holder has not confirmed yet: their memory
    /// stays until it has.
    stopping: HashMap<u32, Box<MicroVm>>,
    vms: VmTable,
    proxy: Proxy,
    parent: ParentLink,
    boot_started: Instant,
    boot_reported: bool,
    boot_timeout: Duration,
    inject_request: Duration,
    /// Per VM: the guest's request counter and the rx bytes at the last look.
    seen: Vec<Seen>,
    /// VMs whose tx ring still held records when their budget ran out.
    backlog: VecDeque<usize>,
    /// VMs that spent their record rate, with when to look at them again.
    throttled: Vec<(Instant, usize)>,
    /// Per VM: in `backlog` or `throttled` (serviced from there, once).
    in_backlog: Vec<bool>,
    last_sweep: Instant,
    governor: CpuGovernor,
    /// Per VM: its doorbell's storm state.
    bells: Vec<Bell>,
    /// When idle VMs are hibernated, if they are.
    hibernation: Option<Hibernation>,
    /// Index of this cell (its share of `--max-live`).
    cell: u32,
    /// With `--max-live`, the parent's latest cut over every cell
    /// (`hibernation::Cap::Global`).
    cut: Option<u64>,
    /// Hibernations and wakes so far.
    sleep_stats: SleepStats,
    /// The last look for VMs to hibernate.
    last_sleep_sweep: Instant,
    /// The VMs it chose, going to sleep one at a time.
    sleep_queue: SleepQueue,
    /// How VMs created asleep start at their first wake.
    first_start: FirstStart,
    /// The image's template while it boots here, to be hibernated once
    /// ready (clone boot).
    template: Option<usize>,
}

/// A VM's doorbell, as far as storms go.
#[derive(Debug, Default, Clone, Copy)]
struct Bell {
    /// Rings in a row that brought nothing.
    idle_rings: u32,
    /// The last put-off.
    backoff: Duration,
    /// Put off (not registered with the loop) until then.
    deferred_until: Option<Instant>,
}

/// What the loop last took from a VM's request counter.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    /// The guest's raw counter (its word, never believed as such).
    requests: u64,
    rx_bytes: u64,
    /// Requests believed so far: bounded by the bytes it was sent.
    accepted: u64,
}

impl Seen {
    /// Requests the host can vouch for: believed from the counter, and no
    /// more than the response records the proxy took for its connections.
    /// A guest that counts without answering serves nothing here.
    fn vouched(&self, vm: &MicroVm) -> u64 {
        self.accepted.min(vm.tx_responses)
    }
}

impl CellLoop {
    /// Registers the links and doorbells; the VMs come with [`Self::create`].
    pub fn new(setup: CellLoopSetup) -> Result<Self, LoopError> {
        let poll = Poll::new()?;
        setup.link.set_nonblocking(true)?;
        let mut link = UnixStream::from_std(setup.link);
        poll.registry()
            .register(&mut link, LINK, Interest::READABLE)?;
        for (index, evt) in setup.doorbells.iter().enumerate() {
            if let Some(evt) = evt {
                register_doorbell(&poll, evt, index)?;
            }
        }
        for (index, holder) in setup.holders.iter().enumerate() {
            poll.registry().register(
                &mut mio::unix::SourceFd(&holder.link()?.as_raw_fd()),
                token(KIND_HOLDER, index),
                Interest::READABLE,
            )?;
        }
        let mut listener = setup.listener;
        poll.registry()
            .register(&mut listener, token(KIND_LISTENER, 0), Interest::READABLE)?;
        Ok(CellLoop {
            poll,
            vms: VmTable::new(setup.ctx.first_id),
            ctx: setup.ctx,
            doorbells: setup.doorbells,
            irqs: setup.irqs,
            holders: setup.holders,
            listener,
            accept_due: None,
            stopping: HashMap::new(),
            proxy: Proxy::new(conn_token),
            parent: ParentLink {
                link: LineStream::new(link, MAX_LINK_LINE),
                counts: Vec::new(),
                since: None,
            },
            boot_started: setup.boot_started,
            boot_reported: false,
            boot_timeout: setup.boot_timeout,
            inject_request: setup.inject_request,
            seen: Vec::new(),
            backlog: VecDeque::new(),
            throttled: Vec::new(),
            in_backlog: Vec::new(),
            last_sweep: Instant::now(),
            governor: CpuGovernor::new(setup.vcpu_cpus),
            bells: Vec::new(),
            hibernation: setup.hibernation,
            cell: setup.cell,
            cut: None,
            sleep_stats: SleepStats::default(),
            last_sleep_sweep: Instant::now(),
            sleep_queue: SleepQueue::default(),
            first_start: FirstStart::at_start(setup.hibernation.as_ref()),
            template: None,
        })
    }

    /// With clone boot, boots the image's template if this cell holds it:
    /// it is hibernated once ready, and the pager saves its memory for the
    /// clones ([`ToCell::Template`] says when).
    pub fn start_template(&mut self) {
        let id = crate::config::TEMPLATE_VM;
        if self.first_start != FirstStart::AwaitTemplate {
            return;
        }
        if let Some(index) = self
            .vms
            .index_of(id)
            .filter(|&i| self.vms.live(i).is_some())
        {
            self.template = Some(index);
            self.wake_as(index, Start::Template);
        }
    }

    /// The parent says whether the template was saved (`ready`): VMs
    /// created asleep start as its clones, or boot each; the connections
    /// held meanwhile go to their VMs.
    fn template_saved(&mut self, ready: bool) {
        if self.first_start != FirstStart::AwaitTemplate {
            return;
        }
        self.first_start = if ready {
            FirstStart::Clone
        } else {
            FirstStart::Boot
        };
        if self.template.take().is_some() && !ready {
            crate::log!(
                "densevm: cell {}: the template was not saved; it serves on as VM {}",
                self.cell,
                crate::config::TEMPLATE_VM
            );
        }
        if ready {
            // The template's own first start as a tenant is a clone's too.
            let template = self.vms.index_of(crate::config::TEMPLATE_VM);
            if let Some(vm) = template.and_then(|i| self.vms.live(i)) {
                if vm.sleep == Sleep::Asleep {
                    vm.sleep = Sleep::Unbooted;
                }
            }
        }
        for index in 0..self.vms.len() {
            if self.proxy.held.waits(index) {
                self.connected(index);
                self.proxy
                    .accept(&mut self.vms, index, self.poll.registry());
            }
        }
    }

    fn adopt(&mut self, vm: MicroVm) -> io::Result<()> {
        self.vms.push(vm);
        self.seen.push(Seen::default());
        self.bells.push(Bell::default());
        self.in_backlog.push(false);
        Ok(())
    }

    /// Runs until the parent says stop or goes away. Err: the event loop
    /// failed; the caller tells the parent.
    pub fn run(&mut self) -> Result<Exit, LoopError> {
        let mut events = Events::with_capacity(1024);
        for index in 0..self.vms.len() {
            self.service_vm(index);
        }
        loop {
            self.check_boot();
            let waiting = self.parent.since.is_some() || self.parent.link.unsent() > 0;
            let timeout = match (waiting, self.boot_reported) {
                _ if !self.backlog.is_empty() => Duration::ZERO,
                (true, _) => ACCESS_REPORT_DELAY,
                (false, true) => Duration::from_millis(500),
                (false, false) => Duration::from_millis(50),
            };
            let timeout = self
                .throttled
                .iter()
                .map(|(at, _)| *at)
                .chain(self.bells.iter().filter_map(|b| b.deferred_until))
                .chain([self.governor.due()])
                .chain(self.accept_due)
                .chain(self.next_sleep_sweep())
                .chain(self.sleep_queue.next_due())
                .map(|at| at.saturating_duration_since(Instant::now()))
                .fold(timeout, Duration::min);
            crate::link::framing::nonblocking(|| self.poll.poll(&mut events, Some(timeout)))?;
            for event in events.iter() {
                let Token(t) = event.token();
                match event.token() {
                    LINK => {
                        if let Some(exit) = self.parent_ready() {
                            return Ok(exit);
                        }
                    }
                    _ => {
                        let index = t & ((1 << KIND_SHIFT) - 1);
                        match t >> KIND_SHIFT {
                            KIND_HOLDER => self.holder_ready(index),
                            KIND_LISTENER => self.accept_connections(),
                            KIND_DOORBELL => self.doorbell(index),
                            KIND_CONN => self.proxy.ready(
                                &mut self.vms,
                                index,
                                Readiness {
                                    readable: event.is_readable(),
                                    writable: event.is_writable(),
                                    read_closed: event.is_read_closed() || event.is_error(),
                                },
                            ),
                            _ => {}
                        }
                    }
                }
            }
            // One more budget for each VM left over from the last turn,
            // after every other source had its turn.
            for _ in 0..self.backlog.len() {
                let Some(index) = self.backlog.pop_front() else {
                    break;
                };
                self.in_backlog[index] = false;
                self.service_vm(index);
            }
            if self.accept_due.is_some_and(|at| at <= Instant::now()) {
                self.accept_connections();
            }
            self.service_throttled();
            self.ring_deferred();
            self.govern_cpu();
            if self.last_sweep.elapsed() >= PINNED_SWEEP {
                self.last_sweep = Instant::now();
                self.proxy.expire_pinned(self.last_sweep);
                self.proxy.expire_lingering(&mut self.vms, self.last_sweep);
            }
            if self
                .next_sleep_sweep()
                .is_some_and(|at| at <= Instant::now())
            {
                self.last_sleep_sweep = Instant::now();
                self.hibernate_idle(true);
            }
            self.hibernate_next();
            self.proxy
                .resume_accepts(&mut self.vms, self.poll.registry());
            self.parent.report_access(false);
            // What the socket did not take before (the parent was busy) goes now.
            let _ = self.parent.link.flush();
        }
    }

    /// Services the throttled VMs whose time has come.
    fn service_throttled(&mut self) {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.throttled)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.throttled = later;
        for (_, index) in due {
            self.in_backlog[index] = false;
            self.service_vm(index);
        }
    }

    /// Moves vCPUs that burn CPU without serving to the background, and back.
    fn govern_cpu(&mut self) {
        if Instant::now() < self.governor.due() {
            return;
        }
        let busy: Vec<bool> = self
            .holders
            .iter_mut()
            .map(|h| h.present() && h.busy(crate::cell::cpu_governor::LOOK_SHARE))
            .collect();
        let per_holder = self.ctx.ram_slots_per_holder;
        let (entries, seen) = (self.vms.entries(), &self.seen);
        self.governor
            .tick(entries.len(), |index| match &entries[index] {
                VmEntry::Live(vm) => {
                    Some((&**vm, seen[index].vouched(vm), busy[index / per_holder]))
                }
                VmEntry::Dead(_) | VmEntry::Forgotten => None,
            });
    }

    /// Reports the boot once every VM is up or down; at the timeout, the
    /// VMs still booting are stopped as boot failures, not the cell.
    fn check_boot(&mut self) {
        if self.boot_reported {
            return;
        }
        if self.boot_started.elapsed() > self.boot_timeout {
            let reason = format!(
                "did not boot within {:.0} s",
                self.boot_timeout.as_secs_f64()
            );
            for index in 0..self.vms.len() {
                if self.vms.entries()[index].state() == VmState::Booting {
                    self.kill_vm(index, VmState::Crashed, reason.clone());
                }
            }
        }
        let (mut ready, mut failed) = (0, 0);
        for entry in self.vms.entries() {
            match entry.state() {
                VmState::Running | VmState::Hibernated => ready += 1,
                VmState::Booting => {}
                _ => failed += 1,
            }
        }
        if ready + failed == self.vms.len() as u32 {
            self.boot_reported = true;
            self.parent.send(&FromCell::Booted { ready, failed });
        }
    }

    // ---- guests ----

    fn doorbell(&mut self, index: usize) {
        // The eventfd is not read: mio registers it edge-triggered, and
        // every signal raises a new edge whatever the counter holds, so the
        // read would be a system call per wake-up for nothing.
        if index >= self.doorbells.len() {
            return;
        }
        let before = self
            .vms
            .live(index)
            .map(|vm| vm.stream.progress_mark(&vm.sys));
        self.service_vm(index);
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        let Some(bell) = self.bells.get_mut(index) else {
            return;
        };
        if before != Some(vm.stream.progress_mark(&vm.sys)) {
            *bell = Bell::default();
            return;
        }
        bell.idle_rings += 1;
        if bell.idle_rings < STORM_RINGS || bell.deferred_until.is_some() {
            return;
        }
        // A storm: stop listening to this doorbell for a while.
        bell.idle_rings = 0;
        bell.backoff = (bell.backoff * 2).clamp(DOORBELL_BACKOFF_MIN, DOORBELL_BACKOFF_MAX);
        let Some(fd) = self.doorbells[index].as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        if self
            .poll
            .registry()
            .deregister(&mut mio::unix::SourceFd(&fd))
            .is_ok()
        {
            bell.deferred_until = Some(Instant::now() + bell.backoff);
            vm.doorbells_deferred += 1;
        }
    }

    /// Listens again to the doorbells put off whose time has come, and
    /// takes in what their VMs produced meanwhile.
    fn ring_deferred(&mut self) {
        let now = Instant::now();
        for index in 0..self.bells.len() {
            if self.bells[index].deferred_until.is_none_or(|at| at > now) {
                continue;
            }
            self.bells[index].deferred_until = None;
            let Some(doorbell) = &self.doorbells[index] else {
                continue;
            };
            if register_doorbell(&self.poll, doorbell, index).is_err() {
                self.kill_vm(
                    index,
                    VmState::Crashed,
                    "its doorbell could not be listened to again".into(),
                );
                continue;
            }
            self.service_vm(index);
        }
    }

    /// Takes in what the guest produced, feeds it what it can now accept,
    /// and kicks it if it is idle.
    fn service_vm(&mut self, index: usize) {
        // A sleeping VM's rings are in its pack: nothing runs to move them,
        // and a look would bring a page of them back.
        let Some(vm) = self.vms.live(index).filter(|vm| vm.sys_packed.is_none()) else {
            return;
        };
        let ctrl = vm.ctrl();
        if ctrl.state == abi::STATE_READY {
            vm.ready = true;
        }
        let save_template = self.template == Some(index) && vm.ready && vm.sleep == Sleep::Awake;
        let parked = ctrl.state == abi::STATE_PARKED && matches!(vm.sleep, Sleep::Parking(_));
        let id = vm.id;
        let seen = &mut self.seen[index];
        // The counter is the guest's word: believe no more requests than the
        // bytes it was sent could hold.
        let sent_room = (vm.rx_bytes - seen.rx_bytes) / MIN_REQUEST_BYTES;
        let new_requests = ctrl.requests.saturating_sub(seen.requests).min(sent_room);
        if new_requests > 0 {
            vm.last_active = Instant::now();
            seen.requests = ctrl.requests;
            seen.rx_bytes += new_requests * MIN_REQUEST_BYTES;
            seen.accepted = seen.accepted.saturating_add(new_requests);
            self.parent.requests_served(id, new_requests);
            self.spend_injected_work(new_requests);
        }
        match self.proxy.drain_tx(&mut self.vms, index) {
            Ok(Drained::All) => {}
            Ok(Drained::More) => {
                if !std::mem::replace(&mut self.in_backlog[index], true) {
                    self.backlog.push_back(index);
                }
            }
            Ok(Drained::Throttled(at)) => {
                if !std::mem::replace(&mut self.in_backlog[index], true) {
                    self.throttled.push((at, index));
                }
            }
            Err(violation) => {
                self.kill_vm(index, VmState::Crashed, violation.to_string());
                return;
            }
        }
        self.proxy
            .retry_waiting(&mut self.vms, index, self.poll.registry());
        proxy::kick(&mut self.vms, index);
        if parked {
            self.parked(index);
        }
        if save_template {
            self.hibernate(index);
        }
    }

    /// `--inject-request-us`: a known slowdown of the in-core path, for
    /// checking that regression detection sees it.
    fn spend_injected_work(&self, requests: u64) {
        // Bounded: a guest's counter must not hold the loop.
        let amount = self.inject_request * requests.min(64) as u32;
        paging_policy::injected::spend(amount, paging_policy::injected::Work::User);
    }

    /// Handles what holder `h` sent; a holder that is gone takes its VMs.
    fn holder_ready(&mut self, h: usize) {
        let Some(holder) = self.holders.get_mut(h) else {
            return;
        };
        if holder.dead.is_some() {
            return;
        }
        let mut records = std::mem::take(&mut holder.pending);
        let gone = match holder.read() {
            Ok(Some(more)) => {
                records.extend(more);
                false
            }
            Ok(None) => true,
            Err(e) => {
                crate::log!("densevm: holder {} link: {e}", holder.pid);
                true
            }
        };
        // Descriptors come only with `Built`, which is read where it is awaited.
        for (message, _) in records {
            self.holder_message(message);
        }
        if gone {
            self.holder_gone(h);
        }
    }

    fn holder_message(&mut self, message: FromHolder) {
        match message {
            FromHolder::Exited { vm, reason } => {
                let Some(index) = self.vms.index_of(vm) else {
                    return;
                };
                let Some(live) = self.vms.live(index) else {
                    return;
                };
                live.vcpu.finish(RunState::Crashed, reason);
                let reason = live.stop_reason().unwrap_or_default();
                self.kill_vm(index, VmState::Crashed, reason);
            }
            FromHolder::Stopped { vm } => {
                if self.stopping.remove(&vm).is_some() {
                    self.parent.vm_stopped(vm);
                }
            }
            FromHolder::Hibernated { vm } => self.hibernated(vm),
            FromHolder::Woken { vm, tid, error } => self.woken(vm, tid, error),
            FromHolder::Ready | FromHolder::Built { .. } => {}
        }
    }

    // ---- hibernation ----

    /// When to look for VMs to hibernate next; None with hibernation off.
    fn next_sleep_sweep(&self) -> Option<Instant> {
        let hibernation = self.hibernation.as_ref()?;
        Some(self.last_sleep_sweep + hibernation::sweep_interval(hibernation))
    }

    /// Hibernates the VMs idle too long, and past `--max-live` the least
    /// recently used of the host (the parent's cut); with `report`, tells
    /// the parent what is awake here for its next cut.
    fn hibernate_idle(&mut self, report: bool) {
        let Some(hibernation) = self.hibernation else {
            return;
        };
        let candidates: Vec<Candidate> = self
            .vms
            .entries()
            .iter()
            .enumerate()
            .filter_map(|(index, entry)| match entry {
                VmEntry::Live(vm) => Some(Candidate {
                    index,
                    awake: matches!(
                        vm.sleep,
                        Sleep::Awake | Sleep::Parking(_) | Sleep::Waking(_)
                    ),
                    unused: could_sleep(entry, vm),
                    last_active: vm.last_active,
                }),
                VmEntry::Dead(_) | VmEntry::Forgotten => None,
            })
            .collect();
        let share = hibernation.cell_max_live(self.cell);
        let floor = hibernation.cell_floor(self.cell);
        let cap = match (share, self.cut) {
            (None, _) => Cap::None,
            (Some(share), None) => Cap::Local { share },
            (Some(_), Some(cut)) => Cap::Global { cut, floor },
        };
        let now = Now::read();
        let choice = hibernation::choose(&candidates, hibernation.idle_after, cap, &now);
        for c in choice.at_once() {
            self.hibernate(c.index);
        }
        let interval = hibernation::sweep_interval(&hibernation);
        self.sleep_queue
            .refill(choice.spread(), interval, now.instant);
        if report && share.is_some() {
            let profile = hibernation::profile(&candidates, &choice.indices(), floor, &now);
            self.parent.send(&FromCell::Idle { profile });
        }
        // Holders of VMs created asleep, which never woke, leave too.
        for h in 0..self.holders.len() {
            self.retire_if_all_asleep(h);
        }
    }

    /// Parks the next VM of the sleep queue whose turn has come, unless it
    /// was in use since it was chosen.
    fn hibernate_next(&mut self) {
        let Some((index, chosen_idle_since)) = self.sleep_queue.pop_due(Instant::now()) else {
            return;
        };
        let still_idle = self
            .vms
            .entries()
            .get(index)
            .is_some_and(|entry| match entry {
                VmEntry::Live(vm) => could_sleep(entry, vm) && vm.last_active == chosen_idle_since,
                VmEntry::Dead(_) | VmEntry::Forgotten => false,
            });
        if still_idle {
            self.hibernate(index);
        }
    }

    /// Asks VM `index`'s guest to park at a safe point; [`Self::parked`]
    /// releases its vCPU once it has. A guest that never parks stays awake.
    fn hibernate(&mut self, index: usize) {
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        vm.command(abi::CMD_PARK);
        vm.kick();
        vm.sleep = Sleep::Parking(Instant::now());
    }

    /// VM `index`'s guest parked: its holder releases its vCPU.
    fn parked(&mut self, index: usize) {
        let Some(id) = self.vms.live(index).map(|vm| vm.id) else {
            return;
        };
        match self.holder_of(index).map(|h| h.hibernate(id)) {
            Some(Ok(())) => {
                if let Some(vm) = self.vms.live(index) {
                    vm.sleep = Sleep::Hibernating;
                }
            }
            Some(Err(e)) => {
                self.kill_vm(index, VmState::Crashed, format!("hibernate: {e}"));
            }
            None => {}
        }
    }

    /// VM `id`'s vCPU is gone: its memory may go to swap. A connection that
    /// came meanwhile wakes it at once.
    fn hibernated(&mut self, id: u32) {
        let Some(index) = self.vms.index_of(id) else {
            return;
        };
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        if vm.sleep != Sleep::Hibernating {
            return;
        }
        vm.sleep = Sleep::Asleep;
        vm.vcpu.release();
        vm.irq = None;
        if self.template == Some(index) {
            self.template = None;
        }
        self.governor.new_thread(index);
        self.drop_doorbell(index);
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        let in_use = !vm.unused() || !vm.stream.drained(&vm.sys);
        // Requests that came meanwhile wait in the rings: those stay.
        if !in_use {
            if let Err(e) = vm.pack_sys() {
                crate::log!("densevm: VM {id}: free its system pages: {e}");
            }
        }
        self.sleep_stats.hibernations += 1;
        self.parent.report_access(true);
        self.parent.send(&FromCell::Hibernated { vm: id });
        if in_use {
            self.wake(index);
        } else {
            self.retire_if_all_asleep(index / self.ctx.ram_slots_per_holder);
        }
    }

    /// Makes VM `index`'s irq and doorbell eventfds for a wake and listens
    /// to the doorbell. The irq starts raised: the guest, resumed, looks at
    /// its rings at once.
    fn new_eventfds(&mut self, index: usize) -> io::Result<()> {
        self.drop_doorbell(index);
        let irq = EventFd::new(libc::EFD_NONBLOCK)?;
        irq.write(1)?;
        let doorbell = EventFd::new(libc::EFD_NONBLOCK)?;
        register_doorbell(&self.poll, &doorbell, index)?;
        self.doorbells[index] = Some(doorbell);
        let Some(vm) = self.vms.live(index) else {
            return Err(io::Error::other("VM gone"));
        };
        vm.irq = Some(irq);
        Ok(())
    }

    /// Stops listening to VM `index`'s doorbell and closes it.
    fn drop_doorbell(&mut self, index: usize) {
        if let Some(doorbell) = self.doorbells.get_mut(index).and_then(Option::take) {
            let _ = self
                .poll
                .registry()
                .deregister(&mut mio::unix::SourceFd(&doorbell.as_raw_fd()));
        }
        if let Some(bell) = self.bells.get_mut(index) {
            *bell = Bell::default();
        }
    }

    /// Lets holder `h` leave if every VM of it sleeps (or is gone) and none
    /// is being stopped: a sleeping VM then costs no process.
    fn retire_if_all_asleep(&mut self, h: usize) {
        let Some(holder) = self.holders.get(h).filter(|h| h.present()) else {
            return;
        };
        let slots = holder.slots();
        let asleep = slots
            .clone()
            .all(|index| match self.vms.entries().get(index) {
                Some(VmEntry::Live(vm)) => matches!(vm.sleep, Sleep::Asleep | Sleep::Unbooted),
                _ => true,
            });
        let stopping = self
            .stopping
            .keys()
            .any(|&id| slots.contains(&self.ctx.slot_of(id)));
        if asleep && !stopping && holder.pending.is_empty() {
            self.holders[h].leave();
        }
    }

    /// Starts holder `h` again for the wakes waiting on it, and hands its
    /// userfaultfd to the parent's pager; the wakes go once the parent
    /// answers ([`Self::holder_attached`]).
    fn restart_holder(&mut self, h: usize) {
        let per_holder = self.ctx.ram_slots_per_holder;
        let slots = per_holder.min(self.doorbells.len() - h * per_holder) as u32;
        let parent_link = self.parent.link.stream.as_raw_fd();
        let started = holder::restart(&mut self.ctx, h, slots, parent_link);
        let (mut holder, uffd) = match started {
            Ok(started) => started,
            Err(e) => return self.fail_waiting(h, format!("restart holder {h}: {e}")),
        };
        holder.waiting = std::mem::take(&mut self.holders[h].waiting);
        let registered = holder.link().and_then(|link| {
            self.poll.registry().register(
                &mut mio::unix::SourceFd(&link.as_raw_fd()),
                token(KIND_HOLDER, h),
                Interest::READABLE,
            )
        });
        self.holders[h] = holder;
        let told = registered.and_then(|()| {
            self.parent.send_with_fd(
                &FromCell::HolderStarted { holder: h as u32 },
                &uffd,
                HOLDER_TEARDOWN,
            )
        });
        if let Err(e) = told {
            self.holders[h].leave();
            self.fail_waiting(h, format!("hand holder {h} to the pager: {e}"));
        }
    }

    /// The parent attached restarted holder `h` to the pager (or could
    /// not, `error`): its waiting wakes go (or fail).
    fn holder_attached(&mut self, h: usize, error: Option<String>) {
        let Some(holder) = self.holders.get_mut(h) else {
            return;
        };
        if holder.presence != Presence::Returning || holder.dead.is_some() {
            return;
        }
        if let Some(error) = error {
            holder.leave();
            return self.fail_waiting(h, format!("attach holder {h}: {error}"));
        }
        holder.presence = Presence::Present;
        for (index, start) in std::mem::take(&mut holder.waiting) {
            let Some(id) = self.vms.live(index).map(|vm| vm.id) else {
                continue;
            };
            self.start_wake(index, id, start);
        }
    }

    /// Asks VM `index`'s present holder to start it as `start`, then tells
    /// the parent, and only then makes room under `--max-live` for it: the
    /// look over every VM of the cell for whom to put to sleep (tens of
    /// microseconds at hundreds of VMs) is no longer between the wake and
    /// its prefetch. Without a cap a wake changes nobody's turn: the sweep
    /// alone puts VMs to sleep.
    fn start_wake(&mut self, index: usize, id: u32, start: Start) {
        if !self.send_wake(index, id, start) {
            return;
        }
        self.announce_wake(id);
        let capped = self
            .hibernation
            .is_some_and(|h| h.cell_max_live(self.cell).is_some());
        if capped {
            self.hibernate_idle(false);
        }
    }

    /// Tells the parent that VM `id` wakes, so that its memory comes back
    /// while its holder makes its vCPU. Sent once the holder is asked: a
    /// socket's wake-up brings the reader to the writer's CPU when nothing
    /// else waits to run there, and the parent (not SCHED_BATCH) then ran
    /// first, 0.1-0.2 ms on the cell's core before the holder got to the
    /// wake. With the holder waiting to run it goes to the other core.
    /// A wake that then fails stops the VM, which the parent hears of too.
    fn announce_wake(&mut self, id: u32) {
        self.parent.send(&FromCell::Waking { vm: id });
    }

    /// The wakes waiting for holder `h` fail with `why`.
    fn fail_waiting(&mut self, h: usize, why: String) {
        crate::log!("densevm: cell {}: {why}", self.cell);
        for (index, _) in std::mem::take(&mut self.holders[h].waiting) {
            self.wake_failed(index, why.clone());
        }
    }

    /// A connection came for VM `index`: it is in use, and woken if asleep.
    /// Takes up to a turn's worth of connections from the cell's socket
    /// into their VMs' queues, then lets each VM take what it can. A
    /// connection for no VM of this cell (or one that is gone) is reset.
    fn accept_connections(&mut self) {
        self.accept_due = None;
        let mut touched = Vec::new();
        let mut drained = false;
        for _ in 0..ACCEPTS_PER_TURN {
            let stream = match crate::link::framing::nonblocking(|| self.listener.accept()) {
                Ok(Some((stream, _))) => stream,
                Ok(None) => {
                    drained = true;
                    break;
                }
                Err(e) => {
                    // EMFILE and friends: try again once something may have closed.
                    crate::log!("densevm: cell {}: accept: {e}", self.cell);
                    self.accept_due = Some(Instant::now() + ACCEPT_RETRY);
                    drained = true;
                    break;
                }
            };
            let index = listener::vm_of(&stream, self.ctx.addr_base)
                .and_then(|id| self.vms.index_of(id))
                .filter(|&index| self.vms.live(index).is_some());
            match index {
                Some(index) => {
                    if self.proxy.held.hold(index, stream) && !touched.contains(&index) {
                        touched.push(index);
                    }
                }
                None => listener::refuse(stream),
            }
        }
        if !drained {
            // Edge-triggered: no new event comes for what is still queued.
            self.accept_due = Some(Instant::now());
        }
        if self.first_start == FirstStart::AwaitTemplate {
            // Held until the template is saved (`template_saved`).
            return;
        }
        // A sleeping VM's wake goes first: announced before its rings
        // take the connection, the prefetch starts without waiting for its
        // system pages to be unpacked (about 70 us).
        for index in touched {
            self.connected(index);
            self.proxy
                .accept(&mut self.vms, index, self.poll.registry());
        }
    }

    fn connected(&mut self, index: usize) {
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        vm.last_active = Instant::now();
        if matches!(vm.sleep, Sleep::Asleep | Sleep::Unbooted) {
            self.wake(index);
        }
    }

    /// Asks VM `index`'s holder to start it again; its connections wait in
    /// its rings meanwhile.
    fn wake(&mut self, index: usize) {
        let Some(sleep) = self.vms.live(index).map(|vm| vm.sleep) else {
            return;
        };
        let start = match sleep {
            Sleep::Unbooted => self.first_start.start(),
            _ => Some(Start::Resume),
        };
        // Before the template is saved its connections stay held.
        if let Some(start) = start {
            self.wake_as(index, start);
        }
    }

    /// [`Self::wake`], starting as `start`.
    fn wake_as(&mut self, index: usize, start: Start) {
        let Some(id) = self.vms.live(index).map(|vm| vm.id) else {
            return;
        };
        let h = index / self.ctx.ram_slots_per_holder;
        if let Some(vm) = self.vms.live(index) {
            vm.unpack_sys();
        }
        if let Some(holder) = self.holders.get_mut(h).filter(|h| h.dead.is_none()) {
            if holder.presence != Presence::Present {
                // Its holder left (or is leaving, or coming back): the wake
                // waits for it to be present.
                holder.waiting.push((index, start));
                if let Some(vm) = self.vms.live(index) {
                    vm.sleep = Sleep::Waking(Instant::now());
                }
                if holder.presence == Presence::Away {
                    self.restart_holder(h);
                }
                return;
            }
        }
        self.start_wake(index, id, start);
    }

    /// Asks VM `index`'s present holder to start it as `start`; true if
    /// asked.
    fn send_wake(&mut self, index: usize, id: u32, start: Start) -> bool {
        if self.holder_of(index).is_none() {
            return false;
        }
        if let Err(e) = self.new_eventfds(index) {
            self.wake_failed(index, format!("its eventfds: {e}"));
            return false;
        }
        let irq = match self.vms.entries().get(index) {
            Some(VmEntry::Live(vm)) => vm.irq.as_ref(),
            _ => None,
        };
        let holder = self.holders.get(index / self.ctx.ram_slots_per_holder);
        let sent = match (holder, irq, self.doorbells[index].as_ref()) {
            (Some(holder), Some(irq), Some(doorbell)) => {
                Some(holder.wake(id, start, (irq, doorbell)))
            }
            _ => None,
        };
        match sent {
            Some(Ok(())) => {
                if let Some(vm) = self.vms.live(index) {
                    vm.sleep = Sleep::Waking(Instant::now());
                }
                true
            }
            Some(Err(e)) => {
                self.wake_failed(index, format!("holder link: {e}"));
                false
            }
            None => false,
        }
    }

    /// VM `id` runs again on thread `tid`, or could not be woken (`error`).
    fn woken(&mut self, id: u32, tid: Option<i32>, error: Option<String>) {
        let Some(index) = self.vms.index_of(id) else {
            return;
        };
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        let Sleep::Waking(since) = vm.sleep else {
            return;
        };
        let Some(tid) = tid else {
            let why = error.unwrap_or_else(|| "no reason given".into());
            self.wake_failed(index, why);
            return;
        };
        let pid = self.holders[index / self.ctx.ram_slots_per_holder].pid;
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        vm.vcpu.rebind(pid, tid);
        vm.sleep = Sleep::Awake;
        self.governor.new_thread(index);
        vm.last_active = Instant::now();
        self.sleep_stats.record_wake(since.elapsed());
        self.service_vm(index);
    }

    /// VM `index` could not be woken: it stops as crashed, its connections
    /// closed; the cell's other VMs go on.
    fn wake_failed(&mut self, index: usize, why: String) {
        self.sleep_stats.wake_failures += 1;
        self.kill_vm(index, VmState::Crashed, format!("wake failed: {why}"));
    }

    /// Holder `h` is gone: left as asked, or crashed, its VMs with it.
    fn holder_gone(&mut self, h: usize) {
        let holder = &mut self.holders[h];
        if let Ok(link) = holder.link() {
            let _ = self
                .poll
                .registry()
                .deregister(&mut mio::unix::SourceFd(&link.as_raw_fd()));
        }
        if holder.presence == Presence::Leaving {
            // Its link closes as it exits: a moment, or it is killed.
            holder.reap(HOLDER_EXIT);
            holder.presence = Presence::Away;
            // Away, it keeps no descriptor here nor in the parent's pager.
            holder.close_link();
            self.parent.send(&FromCell::HolderLeft { holder: h as u32 });
            let holder = &self.holders[h];
            if !holder.waiting.is_empty() {
                self.restart_holder(h);
            }
            return;
        }
        let how = holder.reap(Duration::ZERO);
        let reason = format!("holder {h} (pid {}) {how}", holder.pid);
        holder.dead = Some(reason.clone());
        let slots = holder.slots();
        for index in slots.clone() {
            self.kill_vm(index, VmState::Crashed, reason.clone());
        }
        let orphans: Vec<u32> = self
            .stopping
            .keys()
            .copied()
            .filter(|&id| slots.contains(&self.ctx.slot_of(id)))
            .collect();
        for id in orphans {
            self.stopping.remove(&id);
            self.parent.vm_stopped(id);
        }
    }

    /// VM `index`'s holder, if its process is there to take requests.
    fn holder_of(&self, index: usize) -> Option<&Holder> {
        self.holders
            .get(index / self.ctx.ram_slots_per_holder)
            .filter(|h| h.present())
    }

    /// Stops a VM, closes its listener and connections, tells the pager, and
    /// keeps a record.
    fn kill_vm(&mut self, index: usize, state: VmState, reason: String) {
        let Some(vm) = self.vms.live(index) else {
            return;
        };
        let dead = DeadVm {
            id: vm.id,
            addr: vm.addr,
            state,
            reason,
            ctrl: vm.ctrl(),
        };
        let Some(vm) = self.vms.bury(index, dead.clone()) else {
            return;
        };
        self.proxy.close_vm(&mut self.vms, index);
        // The pager may free the VM's memory once its vCPU no longer runs:
        // when its holder says so, or at once if the holder is gone.
        match self.holder_of(index).map(|h| h.stop(dead.id)) {
            Some(Ok(())) => {
                self.stopping.insert(dead.id, vm);
            }
            _ => self.parent.vm_stopped(dead.id),
        }
        if state == VmState::Crashed {
            crate::log!(
                "densevm: VM {} ({}) stopped: {}",
                dead.id,
                dead.addr,
                dead.reason
            );
        }
    }

    // ---- the parent ----

    fn parent_ready(&mut self) -> Option<Exit> {
        let mut lines = Vec::new();
        let closed = match self.parent.link.read_lines(&mut lines) {
            Ok(()) => false,
            // A reset link is the parent going away; it says why itself.
            Err(FrameError::Closed) => true,
            Err(FrameError::Io(e)) if crate::link::framing::peer_gone(&e) => true,
            Err(e) => {
                crate::log!("densevm: cell link: {e}");
                true
            }
        };
        for line in lines {
            // Each reply echoes its request's id, so the parent never takes
            // it for the answer to another request.
            let (id, reply) = match serde_json::from_slice::<Request>(&line) {
                Ok(Request {
                    req: ToCell::Shutdown,
                    ..
                }) => return Some(Exit::Shutdown),
                Ok(Request {
                    req: ToCell::HolderAttached { holder, error },
                    ..
                }) => {
                    self.holder_attached(holder as usize, error);
                    continue;
                }
                Ok(Request {
                    req: ToCell::SleepBefore { ms },
                    ..
                }) => {
                    self.cut = Some(ms);
                    self.hibernate_idle(false);
                    continue;
                }
                Ok(Request {
                    req: ToCell::Template { ready },
                    ..
                }) => {
                    self.template_saved(ready);
                    continue;
                }
                Ok(Request { id, req }) => (id, self.handle(req)),
                Err(e) => {
                    crate::log!("densevm: cell link: bad request: {e}");
                    continue;
                }
            };
            self.parent.report_access(true);
            self.parent.send(&FromCell::Reply { id, reply });
        }
        closed.then_some(Exit::ParentGone)
    }

    fn handle(&mut self, request: ToCell) -> Value {
        match request {
            ToCell::Go
            | ToCell::Shutdown
            | ToCell::HolderAttached { .. }
            | ToCell::SleepBefore { .. }
            | ToCell::Template { .. } => {
                json!({ "error": "not expected now" })
            }
            ToCell::Stats { per_vm } => {
                let mut reply =
                    stats::collect(self.vms.entries(), self.proxy.len(), &self.governor, per_vm);
                if let (Some(totals), Some(sleep)) = (
                    reply["totals"].as_object_mut(),
                    self.sleep_stats.totals().as_object(),
                ) {
                    totals.extend(sleep.clone());
                }
                if let Some(totals) = reply["totals"].as_object_mut() {
                    totals.insert("held_connections".into(), json!(self.proxy.held.len()));
                }
                reply
            }
            ToCell::List => {
                json!({ "ok": true, "vms": self.vms.entries().iter().filter(|e| e.is_known()).map(stats::vm_summary).collect::<Vec<_>>() })
            }
            ToCell::Create { first, count } => self.create(first, count),
            ToCell::Destroy { vm } => {
                match self.vms.index_of(vm) {
                    Some(index) if self.vms.live(index).is_some() => {
                        self.kill_vm(
                            index,
                            VmState::Stopped,
                            "destroyed through the control API".into(),
                        );
                    }
                    // A VM that crashed is forgotten: nothing of it stays listed.
                    Some(index) if self.vms.forget(index) => {}
                    _ => return json!({ "error": format!("no running VM {vm}") }),
                }
                self.vms.count_destroyed();
                json!({ "ok": true, "vm": vm, "left": self.vms.not_destroyed() })
            }
            ToCell::Fail { vm, reason } => match self.vms.index_of(vm) {
                Some(index) if self.vms.live(index).is_some() => {
                    self.kill_vm(index, VmState::Crashed, reason);
                    json!({ "ok": true, "vm": vm })
                }
                _ => json!({ "error": format!("no running VM {vm}") }),
            },
            ToCell::Crash { vm, triple } => {
                match self.vms.index_of(vm).and_then(|i| self.vms.live(i)) {
                    Some(vm_ref) => {
                        // Asleep, it sees the command when it wakes.
                        vm_ref.unpack_sys();
                        vm_ref.command(if triple {
                            abi::CMD_TRIPLE
                        } else {
                            abi::CMD_CRASH
                        });
                        vm_ref.kick();
                        json!({ "ok": true, "vm": vm })
                    }
                    None => json!({ "error": format!("no running VM {vm}") }),
                }
            }
        }
    }

    /// Boots VMs `first..first + count`, which must continue the cell's ids:
    /// each holder concerned builds its share, then the front adopts them
    /// in id order. VMs past the first failure are stopped again.
    pub fn create(&mut self, first: u32, count: u32) -> Value {
        if first != self.ctx.first_id + self.vms.len() as u32 {
            return json!({ "error": format!("create: VM {first} does not follow this cell's last VM") });
        }
        if self.hibernation.is_some() {
            return self.create_asleep(first, count);
        }
        let per_holder = self.ctx.ram_slots_per_holder as u32;
        let mut asked = Vec::new();
        let mut error = None;
        let mut next = first;
        while next < first + count {
            let h = self.ctx.slot_of(next) / per_holder as usize;
            let end = (first + count).min(self.ctx.first_id + (h as u32 + 1) * per_holder);
            let sent = match self.holders.get(h) {
                None => Err(format!("VM {next}: no RAM slot left in this cell")),
                Some(holder) => match &holder.dead {
                    Some(reason) => Err(format!("VM {next}: {reason}")),
                    // Dead before the cell noticed: its link is closed.
                    None => holder
                        .request_build(next, end - next)
                        .map_err(|e| format!("VM {next}: holder {h} (pid {}): {e}", holder.pid)),
                },
            };
            if let Err(e) = sent {
                error = Some(format!("create: {e}"));
                break;
            }
            asked.push((h, next));
            next = end;
        }
        let error = self.finish_create(&asked, error);
        let reply = self.create_reply(first);
        match error {
            Some(error) => json!({ "error": error, "created": reply["created"] }),
            None => reply,
        }
    }

    /// With hibernation on, VMs are created asleep: their listener, rings
    /// and memory, and no vCPU, thread or KVM VM until their first
    /// connection boots them (creating N costs no boot of N).
    fn create_asleep(&mut self, first: u32, count: u32) -> Value {
        for id in first..first + count {
            let index = self.ctx.slot_of(id);
            // A holder that left (its VMs asleep) comes back for a wake.
            let h = index / self.ctx.ram_slots_per_holder;
            let Some(h) = self.holders.get(h).filter(|h| h.dead.is_none()).map(|_| h) else {
                let error = format!("create: VM {id}: no live holder for it");
                return json!({ "error": error, "created": self.create_reply(first)["created"] });
            };
            // It keeps no eventfd asleep: its first wake makes them.
            self.irqs[index] = None;
            self.drop_doorbell(index);
            let mut vcpu = self.holders[h].vcpu(0);
            vcpu.release();
            let adopted = microvm::adopt(&self.ctx, id, vcpu, None, None)
                .map_err(AdoptFailure::from)
                .and_then(|mut vm| {
                    vm.sleep = Sleep::Unbooted;
                    self.adopt(vm)
                        .map_err(|source| AdoptFailure::Register { vm: id, source })
                });
            if let Err(e) = adopted {
                let error = format!("create: {e}");
                return json!({ "error": error, "created": self.create_reply(first)["created"] });
            }
            // What its rings start with waits in a pack until it boots.
            if let Some(Err(e)) = self.vms.live(index).map(MicroVm::pack_sys) {
                crate::log!("densevm: VM {id}: free its system pages: {e}");
            }
        }
        self.create_reply(first)
    }

    fn create_reply(&self, first: u32) -> Value {
        let created: Vec<u32> = (first..self.ctx.first_id + self.vms.len() as u32).collect();
        json!({ "ok": true, "created": created })
    }

    /// Collects the holders' answers to `asked` in order and adopts the VMs
    /// up to the first failure; returns it.
    fn finish_create(
        &mut self,
        asked: &[(usize, u32)],
        mut error: Option<String>,
    ) -> Option<String> {
        // One budget for every holder of this create, within the parent's.
        let by = Instant::now() + crate::link::protocol::deadline::HOLDER_BUILD;
        for &(h, first) in asked {
            let built = match self.holders[h].wait_built(by) {
                Ok(built) => built,
                Err(e) => {
                    // A holder that missed it may still be building: it goes,
                    // with its VMs, so none runs on memory nobody tracks.
                    error.get_or_insert(e.to_string());
                    if self.holders[h].dead.is_none() {
                        self.holder_gone(h);
                    }
                    continue;
                }
            };
            let mut stats = built.stats.into_iter();
            for (i, tid) in built.tids.into_iter().enumerate() {
                let id = first + i as u32;
                let stats_fd = if self.ctx.vcpu_stats {
                    stats.next()
                } else {
                    None
                };
                if error.is_some() {
                    self.holders[h].stop_now(id);
                    continue;
                }
                if let Err(e) = self.adopt_built(h, id, tid, stats_fd) {
                    self.holders[h].stop_now(id);
                    error = Some(format!("create: {e}"));
                }
            }
            if let Some(failed) = built.error {
                error.get_or_insert(format!("create: {failed}"));
            }
        }
        for h in 0..self.holders.len() {
            if !self.holders[h].pending.is_empty() {
                self.holder_ready(h);
            }
        }
        error
    }

    /// Takes VM `id`, which holder `h` built and started, into the table.
    fn adopt_built(
        &mut self,
        h: usize,
        id: u32,
        tid: i32,
        stats_fd: Option<OwnedFd>,
    ) -> Result<(), AdoptFailure> {
        let slot = self.ctx.slot_of(id);
        let irq = self.irqs[slot].take().ok_or(AdoptFailure::NoIrq(id))?;
        let vcpu = self.holders[h].vcpu(tid);
        let vm = microvm::adopt(&self.ctx, id, vcpu, Some(irq), stats_fd)?;
        self.adopt(vm)
            .map_err(|source| AdoptFailure::Register { vm: id, source })
    }

    /// Stops every VM: each holder destroys its own and exits.
    pub fn shutdown(&mut self) {
        self.parent.report_access(true);
        let running = |h: &Holder| h.dead.is_none() && h.presence != Presence::Away;
        for holder in self.holders.iter().filter(|h| running(h)) {
            holder.shutdown();
        }
        for holder in self.holders.iter_mut().filter(|h| running(h)) {
            holder.reap(HOLDER_TEARDOWN);
        }
        self.vms.drain_live();
    }
}

fn register_doorbell(poll: &Poll, evt: &EventFd, index: usize) -> io::Result<()> {
    let fd = std::os::fd::AsRawFd::as_raw_fd(evt);
    poll.registry().register(
        &mut mio::unix::SourceFd(&fd),
        token(KIND_DOORBELL, index),
        Interest::READABLE,
    )
}

/// VM `vm` (its table `entry`) could be put to sleep now: awake, running,
/// nothing of it in use.
fn could_sleep(entry: &VmEntry, vm: &MicroVm) -> bool {
    vm.sleep == Sleep::Awake && entry.state() == VmState::Running && vm.unused()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`CellLoop::doorbell`] relies on: an edge-triggered eventfd
    /// reports every signal, read or not.
    #[test]
    fn an_unread_doorbell_still_reports_every_ring() {
        let mut poll = Poll::new().unwrap();
        let evt = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        register_doorbell(&poll, &evt, 0).unwrap();
        let mut events = Events::with_capacity(4);
        let mut rings = 0;
        for _ in 0..3 {
            evt.write(1).unwrap();
            poll.poll(&mut events, Some(Duration::from_secs(5)))
                .unwrap();
            rings += events.iter().count();
            // No new ring: no event, though the counter is not zero.
            poll.poll(&mut events, Some(Duration::ZERO)).unwrap();
            assert!(events.is_empty());
        }
        assert_eq!(rings, 3);
    }
}
