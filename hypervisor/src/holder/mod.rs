//! A cell's holders: child processes that own its KVM VMs.
//!
//! Every KVM VM registers an MMU notifier on the address space of the
//! process that created it, and every kernel walk over a page mapped there
//! calls all of them: the pager's write-protects and hole punches, and the
//! host's DAMON sampling, which visits resident guest pages whether the
//! guests page or not. A cell's front (its event loop, listeners and
//! connections, `cell::event_loop`) therefore keeps no VM of its own. It maps the
//! memory of all its VMs, then forks one holder per
//! [`crate::config::holder_vms`] of them.
//! A holder unmaps the other holders' memory, registers its part of the
//! guest RAM with a userfaultfd of its own (handed to the pager through the
//! front), and creates its VMs and vCPU threads when the front asks. The
//! two share each VM's system pages (the rings), its irqfd and its doorbell,
//! all made before the fork.
//!
//! The link is a SOCK_SEQPACKET pair: one JSON object per record, with
//! descriptors attached to the record they belong to. This module holds
//! both ends: the front's handle on a holder ([`Holder`], [`RemoteVcpu`],
//! [`fork_all`]) and the holder's own loop; [`builder`] builds its VMs.

pub mod builder;

use crate::link::fds::recv_with_fds;
use crate::link::framing::nonblocking;
use crate::link::protocol::deadline;
use crate::vstate::vcpu::RunState;
use builder::{BuildContext, BuildError, EmptyVm, HeldVm, Prebuilt, Start};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Why a holder could not wake one of its VMs (its front gets the line).
#[derive(Debug, thiserror::Error)]
pub enum WakeError {
    /// The VM is not one of this holder's.
    #[error("VM {vm} is not this holder's")]
    NotOurs {
        /// VM index.
        vm: u32,
    },
    /// The VM already has a vCPU.
    #[error("VM {vm} is awake")]
    Awake {
        /// VM index.
        vm: u32,
    },
    /// The wake came without the VM's irq and doorbell eventfds.
    #[error("VM {vm}: woken without its eventfds")]
    NoEventfds {
        /// VM index.
        vm: u32,
    },
    /// A build step failed.
    #[error(transparent)]
    Build(#[from] BuildError),
}

/// Threads that destroy a holder's VMs at shutdown.
const TEARDOWN_THREADS: usize = 4;
/// How long after a wake its holder makes the pool's next KVM VM and vCPU
/// thread. Made at once, their creation (about 0.3 ms) ran on the woken
/// vCPU's core before the vCPU: wake-ups do not preempt there
/// (SCHED_BATCH), and a woken guest's first request is done within a few
/// milliseconds.
const POOL_REFILL_DELAY: Duration = Duration::from_millis(5);
/// Longest record on a holder link.
const MAX_RECORD: usize = 64 << 10;
/// Longest a holder goes on building the VMs of one request: it answers
/// with what it built by then, well before its cell stops waiting for it
/// ([`deadline::HOLDER_BUILD`]), which is itself within the parent's wait
/// for the cell ([`deadline::CELL_CREATE`]). The whole budget, holder <
/// cell < parent, is in `link::protocol::deadline`.
pub const BUILD_LIMIT: Duration = deadline::HOLDER_BUILD.saturating_sub(Duration::from_secs(10));

/// Why a holder could not be started or did not answer.
#[derive(Debug, thiserror::Error)]
pub enum HolderError {
    /// Holders are forked while the cell has one thread, and it had more.
    #[error("holders must be forked before the cell starts a thread")]
    Threaded,
    /// The link to a holder could not be made or set up.
    #[error("holder link: {0}")]
    Link(std::io::Error),
    /// The holder could not be forked.
    #[error("fork: {0}")]
    Fork(std::io::Error),
    /// Reading from the holder failed.
    #[error("holder {pid}: {source}")]
    Read {
        /// Its pid.
        pid: i32,
        /// The error.
        source: std::io::Error,
    },
    /// The holder sent something else than its ready record.
    #[error("holder {pid}: expected ready, got {got}")]
    Unexpected {
        /// Its pid.
        pid: i32,
        /// What it sent.
        got: String,
    },
    /// The holder ended while starting.
    #[error("holder {pid} {how} while starting")]
    Ended {
        /// Its pid.
        pid: i32,
        /// How it ended.
        how: String,
    },
    /// The holder did not report ready in time.
    #[error("holder {0} did not start")]
    DidNotStart(i32),
    /// The holder did not answer in time.
    #[error("holder {0} did not answer")]
    NoAnswer(i32),
    /// The holder closed its link.
    #[error("holder {0} went away")]
    Gone(i32),
}

/// A request from the front.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
enum ToHolder {
    /// Create and start VMs `first..first + count` (cell-wide ids).
    Build { first: u32, count: u32 },
    /// Stop a VM and destroy it.
    Stop { vm: u32 },
    /// Release a VM's vCPU, thread and KVM VM, keeping its memory.
    Hibernate { vm: u32 },
    /// Start a VM created asleep or hibernated on a new vCPU, as `start` says.
    Wake { vm: u32, start: Start },
    /// Stop every VM and exit.
    Shutdown,
}

/// A message from a holder.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum FromHolder {
    /// The holder's guest RAM is registered; its userfaultfd is attached.
    Ready,
    /// The answer to `Build`: the vCPU thread ids of the VMs built, in id
    /// order (with `--vcpu-stats`, each VM's stats descriptor attached in
    /// the same order), and why the next one could not be.
    Built {
        /// Thread id per VM built.
        tids: Vec<i32>,
        /// Why building stopped early.
        error: Option<String>,
    },
    /// A guest died.
    Exited {
        /// Its id.
        vm: u32,
        /// Why.
        reason: String,
    },
    /// The answer to `Stop`: the VM no longer runs.
    Stopped {
        /// Its id.
        vm: u32,
    },
    /// The answer to `Hibernate`: the VM's vCPU, thread and KVM VM are
    /// released, so its memory may go.
    Hibernated {
        /// Its id.
        vm: u32,
    },
    /// The answer to `Wake`: the new vCPU's thread id, or why there is none.
    Woken {
        /// Its id.
        vm: u32,
        /// The new vCPU thread.
        tid: Option<i32>,
        /// Why it could not be woken.
        error: Option<String>,
    },
}

/// A message with the descriptors that came with it.
pub type Record = (FromHolder, Vec<OwnedFd>);

/// What a holder built, in id order from the first VM asked for.
pub struct Built {
    /// The vCPU thread id of each VM built.
    pub tids: Vec<i32>,
    /// Their KVM statistics descriptors, with `--vcpu-stats`.
    pub stats: Vec<OwnedFd>,
    /// Why the next VM could not be built.
    pub error: Option<String>,
}

/// A vCPU in a holder, as the front sees it: its thread, and the state
/// and reason the holder reported.
#[derive(Debug)]
pub struct RemoteVcpu {
    pid: i32,
    tid: i32,
    state: RunState,
    reason: Option<String>,
}

impl RemoteVcpu {
    /// Current run state.
    pub fn state(&self) -> RunState {
        self.state
    }

    /// Why the vCPU stopped, if it did.
    pub fn reason(&self) -> Option<String> {
        self.reason.clone()
    }

    /// Records that the vCPU stopped.
    pub fn finish(&mut self, state: RunState, reason: String) {
        self.state = state;
        self.reason = Some(reason);
    }

    /// The vCPU is gone (hibernated): no thread to read or reschedule.
    pub fn release(&mut self) {
        self.tid = 0;
    }

    /// The VM runs again on thread `tid` of holder `pid` (woken).
    pub fn rebind(&mut self, pid: i32, tid: i32) {
        self.pid = pid;
        self.tid = tid;
    }

    fn schedstat(&self) -> Option<(u64, u64)> {
        if self.tid == 0 {
            return None;
        }
        let path = format!("/proc/{}/task/{}/schedstat", self.pid, self.tid);
        let text = std::fs::read_to_string(path).ok()?;
        let mut fields = text.split_ascii_whitespace().map(str::parse::<u64>);
        match (fields.next(), fields.next()) {
            (Some(Ok(on_cpu)), Some(Ok(waiting))) => Some((on_cpu, waiting)),
            _ => None,
        }
    }

    /// CPU time the thread has used so far and the time it has been
    /// runnable (on a CPU or waiting for one), if it still exists: the
    /// second shows what a thread starved of CPU wants.
    pub fn times(&self) -> Option<ThreadTimes> {
        self.schedstat().map(|(on_cpu, waiting)| ThreadTimes {
            on_cpu: Duration::from_nanos(on_cpu),
            runnable: Duration::from_nanos(on_cpu + waiting),
        })
    }

    /// Whether the thread is runnable now (state `R`): schedstat adds a
    /// wait for a CPU only once it ends, so a thread starved for a whole
    /// period shows neither run nor wait time.
    pub fn runnable_now(&self) -> bool {
        if self.tid == 0 {
            return false;
        }
        let path = format!("/proc/{}/task/{}/stat", self.pid, self.tid);
        std::fs::read_to_string(path).is_ok_and(|text| {
            text.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('R'))
        })
    }

    /// Lets the thread run on `cpus` only.
    pub fn set_cpus(&self, cpus: &[usize]) -> std::io::Result<()> {
        if self.tid == 0 {
            return Ok(());
        }
        crate::scheduling::set_thread_cpus(self.tid, cpus)
    }

    /// Runs the thread as SCHED_IDLE (`true`: only CPU time nobody else
    /// wants) or under the cell's own policy.
    pub fn set_background(&self, background: bool) -> std::io::Result<()> {
        let policy = if background {
            libc::SCHED_IDLE
        } else {
            crate::scheduling::CELL_POLICY
        };
        if self.tid == 0 {
            return Ok(());
        }
        crate::scheduling::set_thread_policy(self.tid, policy)
    }
}

/// What a thread's schedstat says, so far.
#[derive(Debug, Clone, Copy)]
pub struct ThreadTimes {
    /// Time it ran.
    pub on_cpu: Duration,
    /// Time it ran or waited for a CPU.
    pub runnable: Duration,
}

/// Whether a holder's process is there for its VMs. A holder whose VMs all
/// sleep leaves, so that sleeping VMs cost no process, thread or page
/// table; a wake of one of them starts it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Running: its VMs' vCPUs are its.
    Present,
    /// Asked to leave (every VM of it asleep): its exit is not a crash.
    Leaving,
    /// Gone on purpose, every VM of it asleep.
    Away,
    /// Started again; its VMs wait until the pager has its userfaultfd.
    Returning,
}

/// A holder as the front holds it.
pub struct Holder {
    /// Its pid.
    pub pid: i32,
    /// The front's end of the link (nonblocking once the holder is ready);
    /// `None` once it left ([`Holder::close_link`]).
    link: Option<UnixDatagram>,
    first_slot: u32,
    slots: u32,
    /// Why it is gone, once it crashed.
    pub dead: Option<String>,
    /// Whether its process is there.
    pub presence: Presence,
    /// Wakes waiting for it to be present: (VM index in the cell, how it starts).
    pub waiting: Vec<(usize, Start)>,
    /// Messages read while waiting for an answer, for the event loop.
    pub pending: Vec<Record>,
    /// The process's CPU time at the last [`Holder::busy`], and when.
    last_cpu: Option<(Duration, Instant)>,
}

impl Holder {
    /// Whether it runs and has not crashed: requests may be sent to it.
    pub fn present(&self) -> bool {
        self.dead.is_none() && self.presence == Presence::Present
    }

    /// The front's end of its link; an error once it left.
    pub fn link(&self) -> std::io::Result<&UnixDatagram> {
        self.link
            .as_ref()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotConnected))
    }

    /// Closes the link of a holder that left, its process reaped: a holder
    /// away holds no descriptor in the front.
    pub fn close_link(&mut self) {
        self.link = None;
    }

    /// The cell's slots it owns.
    pub fn slots(&self) -> std::ops::Range<usize> {
        self.first_slot as usize..(self.first_slot + self.slots) as usize
    }

    fn send(&self, request: &ToHolder) -> std::io::Result<()> {
        let record = serde_json::to_vec(request).expect("holder requests serialize");
        loop {
            match self.link()?.send(&record) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    wait_fd(
                        self.link()?.as_raw_fd(),
                        libc::POLLOUT,
                        Duration::from_secs(1),
                    );
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Asks the holder to stop VM `vm` (answered by [`FromHolder::Stopped`]).
    pub fn stop(&self, vm: u32) -> std::io::Result<()> {
        self.send(&ToHolder::Stop { vm })
    }

    /// Asks for VM `vm` to be hibernated; `Hibernated` answers.
    pub fn hibernate(&self, vm: u32) -> std::io::Result<()> {
        self.send(&ToHolder::Hibernate { vm })
    }

    /// Asks for VM `vm` to be started as `start` says, with its new irq and
    /// doorbell eventfds; `Woken` answers.
    pub fn wake(
        &self,
        vm: u32,
        start: Start,
        (irq, doorbell): (&EventFd, &EventFd),
    ) -> std::io::Result<()> {
        let record =
            serde_json::to_vec(&ToHolder::Wake { vm, start }).expect("holder requests serialize");
        loop {
            match self
                .link()?
                .send_with_fds(&[&record[..]], &[irq.as_raw_fd(), doorbell.as_raw_fd()])
            {
                Ok(_) => return Ok(()),
                Err(e) if e.errno() == libc::EINTR => continue,
                Err(e) if e.errno() == libc::EAGAIN => {
                    wait_fd(
                        self.link()?.as_raw_fd(),
                        libc::POLLOUT,
                        Duration::from_secs(1),
                    );
                }
                Err(e) => return Err(std::io::Error::from_raw_os_error(e.errno())),
            }
        }
    }

    /// Asks the holder to stop everything and exit.
    pub fn shutdown(&self) {
        let _ = self.send(&ToHolder::Shutdown);
    }

    /// Asks the holder, all of whose VMs sleep, to leave.
    pub fn leave(&mut self) {
        self.shutdown();
        self.presence = Presence::Leaving;
    }

    /// Reads every record waiting; `Ok(None)` once the holder closed its end.
    pub fn read(&self) -> std::io::Result<Option<Vec<Record>>> {
        let mut out = Vec::new();
        loop {
            match receive(self.link()?)? {
                Received::Record(message, fds) => out.push((message, fds)),
                Received::Nothing => return Ok(Some(out)),
                Received::Closed => return Ok(None),
            }
        }
    }

    /// Asks the holder to build VMs `first..first + count`; its answer
    /// comes with [`Self::wait_built`].
    pub fn request_build(&self, first: u32, count: u32) -> std::io::Result<()> {
        self.send(&ToHolder::Build { first, count })
    }

    /// Waits until `by` for the answer to [`Self::request_build`]: the
    /// thread ids of the VMs built, their stats descriptors, and why the
    /// rest were not.
    pub fn wait_built(&mut self, by: Instant) -> Result<Built, HolderError> {
        match self.wait_for(|m| matches!(m, FromHolder::Built { .. }), by)? {
            (FromHolder::Built { tids, error }, stats) => Ok(Built { tids, stats, error }),
            _ => unreachable!("wait_for returns what it was asked for"),
        }
    }

    /// Stops VM `vm` and waits until the holder has.
    pub fn stop_now(&mut self, vm: u32) {
        if self.stop(vm).is_ok() {
            let by = Instant::now() + deadline::HOLDER_REPLY;
            let _ = self.wait_for(
                |m| matches!(m, FromHolder::Stopped { vm: v } if *v == vm),
                by,
            );
        }
    }

    /// Reads until a message `wanted` picks comes; the others are kept in
    /// `pending` for the event loop.
    fn wait_for(
        &mut self,
        wanted: impl Fn(&FromHolder) -> bool,
        deadline: Instant,
    ) -> Result<Record, HolderError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(HolderError::NoAnswer(self.pid));
            }
            let link = self.link().map_err(|source| HolderError::Read {
                pid: self.pid,
                source,
            })?;
            wait_fd(link.as_raw_fd(), libc::POLLIN, left);
            let Some(records) = self.read().map_err(|source| HolderError::Read {
                pid: self.pid,
                source,
            })?
            else {
                return Err(HolderError::Gone(self.pid));
            };
            let mut answer = None;
            for (message, fds) in records {
                if answer.is_none() && wanted(&message) {
                    answer = Some((message, fds));
                } else {
                    self.pending.push((message, fds));
                }
            }
            if let Some(answer) = answer {
                return Ok(answer);
            }
        }
    }

    /// Whether the holder's threads together used more than `share` of a
    /// core since the last call (or cannot be read; `true` the first time).
    pub fn busy(&mut self, share: f64) -> bool {
        let now = Instant::now();
        let Some(cpu) = process_cpu_time(self.pid) else {
            return true;
        };
        match self.last_cpu.replace((cpu, now)) {
            Some((before, at)) => {
                let wall = now.duration_since(at).as_secs_f64();
                cpu.saturating_sub(before).as_secs_f64() > share * wall
            }
            None => true,
        }
    }

    /// The front's view of the vCPU whose thread is `tid`.
    pub fn vcpu(&self, tid: i32) -> RemoteVcpu {
        RemoteVcpu {
            pid: self.pid,
            tid,
            state: RunState::Running,
            reason: None,
        }
    }

    /// Waits up to `grace` for the holder to exit (killing it after), and
    /// says how it ended.
    pub fn reap(&mut self, grace: Duration) -> String {
        let deadline = Instant::now() + grace;
        loop {
            let mut status = 0;
            // SAFETY: waits for our own child.
            let rc = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
            if rc == self.pid {
                return describe_status(status);
            }
            if rc < 0 {
                return "ended".into();
            }
            if Instant::now() >= deadline {
                // SAFETY: our own child, not yet reaped.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
                // SAFETY: as above.
                unsafe { libc::waitpid(self.pid, &mut status, 0) };
                return describe_status(status);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// CPU time of every thread of process `pid` so far (its CPU-time clock,
/// which any process may read: one system call, no /proc file).
fn process_cpu_time(pid: i32) -> Option<Duration> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: plain calls writing only to the locals passed.
    unsafe {
        if libc::clock_getcpuclockid(pid, &mut clock) != 0 {
            return None;
        }
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if libc::clock_gettime(clock, &mut now) != 0 {
            return None;
        }
        Some(Duration::new(now.tv_sec as u64, now.tv_nsec as u32))
    }
}

fn describe_status(status: i32) -> String {
    if libc::WIFEXITED(status) {
        format!("exited with status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        "ended".into()
    }
}

/// Waits up to `timeout` for `events` on `fd`; whether any came (an error
/// counts as one, for the caller's next call to report).
fn wait_fd(fd: RawFd, events: libc::c_short, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut pfd, 1, ms) != 0 }
}

enum Received<T> {
    Record(T, Vec<OwnedFd>),
    Nothing,
    Closed,
}

fn receive<T: serde::de::DeserializeOwned>(link: &UnixDatagram) -> std::io::Result<Received<T>> {
    let mut buf = vec![0u8; MAX_RECORD];
    // Close-on-exec on receipt: no process the cell ever starts inherits them.
    let Some((bytes, owned)) = nonblocking(|| recv_with_fds(link, &mut buf))? else {
        return Ok(Received::Nothing);
    };
    if bytes == 0 {
        return Ok(Received::Closed);
    }
    let message = serde_json::from_slice(&buf[..bytes])
        .map_err(|e| std::io::Error::other(format!("bad record: {e}")))?;
    Ok(Received::Record(message, owned))
}

fn seqpacket_pair() -> std::io::Result<(UnixDatagram, UnixDatagram)> {
    let mut fds = [-1; 2];
    // SAFETY: plain syscall filling two descriptors we then own.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created for us.
    Ok(unsafe {
        (
            UnixDatagram::from_raw_fd(fds[0]),
            UnixDatagram::from_raw_fd(fds[1]),
        )
    })
}

/// What a cell hands its holders at the fork: the build context (whose
/// memory the front has mapped) and each slot's irqfd and doorbell.
pub struct HolderInputs<'a> {
    /// The cell's build context.
    pub ctx: &'a mut BuildContext,
    /// Its slots.
    pub capacity: u32,
    /// One irq eventfd per slot, or none (every VM created asleep).
    pub irqs: &'a [EventFd],
    /// One doorbell eventfd per slot, or none.
    pub doorbells: &'a [EventFd],
    /// Descriptor of the front's link to its parent, closed in holders.
    pub parent_link: RawFd,
}

/// A holder's slots' irq and doorbell eventfds at its first fork, in slot
/// order from its first slot. A holder started again inherits none: every
/// VM of it sleeps, and each wake brings the VM's new ones.
#[derive(Clone, Copy)]
struct Inherited<'a> {
    irqs: &'a [EventFd],
    doorbells: &'a [EventFd],
}

/// Each slot's irq and doorbell eventfds while its VM is awake (or booting).
type Eventfds = Vec<Option<(EventFd, EventFd)>>;

/// Forks the cell's holders, one per part of `ctx.ram`, and waits until
/// each has registered its guest RAM. Returns the holders and, per holder,
/// its userfaultfd for the pager. Call while the process has one thread.
pub fn fork_all(inputs: HolderInputs) -> Result<(Vec<Holder>, Vec<OwnedFd>), HolderError> {
    if !single_threaded() {
        return Err(HolderError::Threaded);
    }
    let per_holder = inputs.ctx.ram_slots_per_holder as u32;
    let parts = inputs.ctx.ram.parts();
    let mut holders: Vec<Holder> = Vec::with_capacity(parts);
    for index in 0..parts {
        let first_slot = index as u32 * per_holder;
        let slots = per_holder.min(inputs.capacity - first_slot);
        let own = first_slot as usize..(first_slot + slots) as usize;
        let inherited = Inherited {
            irqs: inputs.irqs.get(own.clone()).unwrap_or_default(),
            doorbells: inputs.doorbells.get(own).unwrap_or_default(),
        };
        let holder = spawn(
            inputs.ctx,
            (index, first_slot, slots),
            Some(inherited).filter(|i| !i.irqs.is_empty()),
            inputs.parent_link,
            &mut holders,
        )?;
        holders.push(holder);
    }
    let mut uffds = Vec::with_capacity(parts);
    for holder in &mut holders {
        uffds.push(holder.wait_ready()?);
    }
    Ok((holders, uffds))
}

/// Starts holder `index` again (for `slots` slots), its predecessor having
/// left with every VM of it asleep, and waits until it has registered its
/// guest RAM. Returns it (`Returning`) and its userfaultfd for the pager.
/// Call while the process has one thread.
pub fn restart(
    ctx: &mut BuildContext,
    index: usize,
    slots: u32,
    parent_link: RawFd,
) -> Result<(Holder, OwnedFd), HolderError> {
    if !single_threaded() {
        return Err(HolderError::Threaded);
    }
    let first_slot = index as u32 * ctx.ram_slots_per_holder as u32;
    let at = (index, first_slot, slots);
    let mut holder = spawn(ctx, at, None, parent_link, &mut Vec::new())?;
    holder.presence = Presence::Returning;
    let uffd = holder.wait_ready();
    match uffd {
        Ok(uffd) => Ok((holder, uffd)),
        Err(e) => {
            // SAFETY: our own child, not yet reaped.
            unsafe { libc::kill(holder.pid, libc::SIGKILL) };
            holder.reap(Duration::from_secs(2));
            Err(e)
        }
    }
}

/// Forks holder `index` for `slots` slots from `first_slot`. `earlier` are
/// the front's handles on holders forked before it: the child drops them
/// (their links are not its).
fn spawn(
    ctx: &mut BuildContext,
    (index, first_slot, slots): (usize, u32, u32),
    inherited: Option<Inherited>,
    parent_link: RawFd,
    earlier: &mut Vec<Holder>,
) -> Result<Holder, HolderError> {
    let front = std::process::id() as i32;
    let (ours, theirs) = seqpacket_pair().map_err(HolderError::Link)?;
    // SAFETY: the caller checked that the process has a single thread, so
    // the child may run anything.
    match unsafe { libc::fork() } {
        -1 => Err(HolderError::Fork(std::io::Error::last_os_error())),
        0 => {
            drop(ours);
            earlier.clear();
            // SAFETY: the parent link is the front's, not ours.
            unsafe { libc::close(parent_link) };
            let code = run(ctx, (index, first_slot, slots), theirs, inherited, front);
            std::process::exit(code);
        }
        pid => Ok(Holder {
            pid,
            link: Some(ours),
            first_slot,
            slots,
            dead: None,
            presence: Presence::Present,
            waiting: Vec::new(),
            pending: Vec::new(),
            last_cpu: None,
        }),
    }
}

impl Holder {
    /// Waits until the holder reports its guest RAM registered; returns
    /// its userfaultfd.
    fn wait_ready(&mut self) -> Result<OwnedFd, HolderError> {
        let deadline = Instant::now() + deadline::HOLDER_START;
        loop {
            let link = self.link().map_err(HolderError::Link)?;
            wait_fd(
                link.as_raw_fd(),
                libc::POLLIN,
                deadline.saturating_duration_since(Instant::now()),
            );
            link.set_nonblocking(true).map_err(HolderError::Link)?;
            let received = receive::<FromHolder>(link).map_err(|source| HolderError::Read {
                pid: self.pid,
                source,
            })?;
            match received {
                Received::Record(FromHolder::Ready, mut fds) if fds.len() == 1 => {
                    return Ok(fds.pop().expect("one descriptor"));
                }
                Received::Record(other, _) => {
                    return Err(HolderError::Unexpected {
                        pid: self.pid,
                        got: format!("{other:?}"),
                    })
                }
                Received::Closed => {
                    let how = self.reap(Duration::from_secs(2));
                    return Err(HolderError::Ended { pid: self.pid, how });
                }
                Received::Nothing if Instant::now() >= deadline => {
                    return Err(HolderError::DidNotStart(self.pid))
                }
                Received::Nothing => {}
            }
        }
    }
}

/// Whether the calling process has one thread (the kernel's count).
fn single_threaded() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .any(|line| line.split_whitespace().eq(["Threads:", "1"]))
    })
}

/// The holder process: returns its exit code.
fn run(
    ctx: &mut BuildContext,
    (index, first_slot, slots): (usize, u32, u32),
    link: UnixDatagram,
    inherited: Option<Inherited>,
    front: i32,
) -> i32 {
    // SAFETY: plain prctl/getppid on our own process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != front {
            return 1;
        }
    }
    if let Err(e) = ctx
        .ram
        .keep_only(index)
        .and_then(|()| ctx.sys.keep_only(index))
    {
        crate::log!("densevm: error: holder {index}: keep its part of the memory: {e}");
        return 1;
    }
    // Every descriptor but those this holder needs: no other holder's
    // interrupts or doorbells, nor anything else the front had open (the
    // cell's memfds, through which other holders' memory could be mapped).
    let own = first_slot as usize..(first_slot + slots) as usize;
    let mut keep = vec![
        libc::STDOUT_FILENO,
        libc::STDERR_FILENO,
        link.as_raw_fd(),
        ctx.kvm.as_raw_fd(),
        ctx.image.memfd.as_raw_fd(),
    ];
    let mut eventfds: Eventfds = match inherited {
        Some(inherited) => inherited
            .irqs
            .iter()
            .zip(inherited.doorbells)
            .map(|(irq, doorbell)| {
                keep.extend([irq.as_raw_fd(), doorbell.as_raw_fd()]);
                // SAFETY: the front's objects for these descriptors are never
                // dropped here (the holder ends with process::exit): these
                // are their only owners in this process.
                Some(unsafe {
                    (
                        EventFd::from_raw_fd(irq.as_raw_fd()),
                        EventFd::from_raw_fd(doorbell.as_raw_fd()),
                    )
                })
            })
            .collect(),
        None => (0..slots).map(|_| None).collect(),
    };
    if let Err(e) = close_all_but(&mut keep) {
        crate::log!("densevm: error: holder {index}: close inherited descriptors: {e}");
        return 1;
    }
    let memory = ctx.ram.memory();
    let uffd = match memory.register().and_then(|()| memory.take_uffd()) {
        Ok(uffd) => uffd,
        Err(e) => {
            crate::log!("densevm: error: holder {index}: register guest RAM: {e}");
            return 1;
        }
    };
    let ready = serde_json::to_vec(&FromHolder::Ready).expect("serializes");
    if link
        .send_with_fds(&[&ready[..]], &[uffd.as_raw_fd()])
        .is_err()
    {
        return 1;
    }
    // The pager's copy of the userfaultfd must be the only one.
    drop(uffd);
    let link = std::sync::Arc::new(link);
    let exits = std::sync::Arc::clone(&link);
    ctx.on_exit = std::sync::Arc::new(move |vm: u32, reason: &str| {
        let record = serde_json::to_vec(&FromHolder::Exited {
            vm,
            reason: reason.to_string(),
        })
        .expect("serializes");
        let _ = exits.send(&record);
    });
    let mut held: HashMap<u32, HeldVm> = HashMap::new();
    // Slots (of `own`) whose unused system pages this process has made
    // inaccessible: the protection stays across the VM's sleeps.
    let mut sys_protected = vec![false; own.len()];
    // A KVM VM and a parked vCPU thread made ahead while this holder has a
    // VM awake, so that creating them (about a millisecond, and 50-80 us
    // for the thread) is not on the wake path.
    let mut pool: Option<Prebuilt> = None;
    // KVM VMs of hibernated VMs are destroyed off the loop, each on a
    // thread of its own that ends with it: a destruction waits for a grace
    // period (about 22 ms here), and wakes queued behind a few of them took
    // hundreds of milliseconds. A VM woken before its old KVM VM is gone
    // waits for it: until then its eventfds are that VM's. (Under
    // SCHED_IDLE they would starve on a saturated host, a hundred a second
    // needing a tenth of a core, and such a wake with them.)
    let mut reaping: HashMap<u32, std::thread::JoinHandle<()>> = HashMap::new();
    let mut reaped_pools: Vec<std::thread::JoinHandle<()>> = Vec::new();
    // The VM whose wake emptied the pool, and when to fill it again.
    let mut refill: Option<(u32, Instant)> = None;
    loop {
        if let Some((vm, at)) = refill {
            let left = at.saturating_duration_since(Instant::now());
            if !wait_fd(link.as_raw_fd(), libc::POLLIN, left) {
                fill_pool(ctx, &mut pool, vm, (&held, &own));
                refill = None;
                continue;
            }
        }
        let (request, fds) = match receive::<ToHolder>(&link) {
            Ok(Received::Record(request, fds)) => (request, fds),
            Ok(Received::Nothing) => continue,
            Ok(Received::Closed) | Err(_) => break,
        };
        match request {
            ToHolder::Build { first, count } => {
                let used = stacks_in_use(&held, pool.as_ref());
                let (built, error) = build_all(ctx, first, count, &eventfds, (&own, used));
                let tids = built.iter().map(|vm| vm.vcpu.tid()).collect();
                let stats: Vec<RawFd> = built
                    .iter()
                    .filter_map(|vm| vm.stats_fd.as_ref().map(AsRawFd::as_raw_fd))
                    .collect();
                let record =
                    serde_json::to_vec(&FromHolder::Built { tids, error }).expect("serializes");
                let _ = link.send_with_fds(&[&record[..]], &stats);
                for mut vm in built {
                    vm.stats_fd.take();
                    if let Some(at) = slot_in(ctx, &own, vm.id) {
                        sys_protected[at] = true;
                    }
                    held.insert(vm.id, vm);
                }
            }
            ToHolder::Stop { vm } => {
                if let Some(mut stopped) = held.remove(&vm) {
                    stopped.release();
                }
                forget_eventfds(ctx, &mut eventfds, &own, vm);
                let record = serde_json::to_vec(&FromHolder::Stopped { vm }).expect("serializes");
                let _ = link.send(&record);
            }
            ToHolder::Hibernate { vm } => {
                reaping.retain(|_, t| !t.is_finished());
                if let Some(kvm) = held.remove(&vm).and_then(HeldVm::stop_for_good) {
                    reaping.insert(vm, std::thread::spawn(move || drop(kvm)));
                }
                // Its KVM VM keeps what it registered; its next wake brings new ones.
                forget_eventfds(ctx, &mut eventfds, &own, vm);
                let record =
                    serde_json::to_vec(&FromHolder::Hibernated { vm }).expect("serializes");
                let _ = link.send(&record);
                // A holder whose VMs all sleep holds no KVM object: its next
                // wake makes its KVM VM (about a millisecond) and the pool.
                refill = None;
                match held.is_empty() {
                    true => {
                        reaped_pools.retain(|t| !t.is_finished());
                        if let Some(Prebuilt { mut vcpu, kvm, .. }) = pool.take() {
                            // Its stack is free once its thread is joined.
                            vcpu.stop();
                            reaped_pools.push(std::thread::spawn(move || drop(kvm)));
                        }
                    }
                    false => fill_pool(ctx, &mut pool, vm, (&held, &own)),
                }
            }
            ToHolder::Wake { vm, start } => {
                if let Some(old) = reaping.remove(&vm) {
                    let _ = old.join();
                }
                if let (Ok([irq, doorbell]), Some(at)) =
                    (<[OwnedFd; 2]>::try_from(fds), slot_in(ctx, &own, vm))
                {
                    // SAFETY: descriptors just received, owned by nothing else.
                    eventfds[at] = Some(unsafe {
                        (
                            EventFd::from_raw_fd(irq.into_raw_fd()),
                            EventFd::from_raw_fd(doorbell.into_raw_fd()),
                        )
                    });
                }
                let at = slot_in(ctx, &own, vm);
                let protect_sys = at.is_none_or(|at| !sys_protected[at]);
                let woken = wake(
                    ctx,
                    vm,
                    start,
                    pool.take(),
                    (&eventfds, &own),
                    &held,
                    protect_sys,
                );
                let (tid, error) = match woken {
                    Ok(vcpu) => {
                        let tid = vcpu.vcpu.tid();
                        if let Some(at) = at {
                            sys_protected[at] = true;
                        }
                        held.insert(vm, vcpu);
                        (Some(tid), None)
                    }
                    Err(e) => (None, Some(e.to_string())),
                };
                let record =
                    serde_json::to_vec(&FromHolder::Woken { vm, tid, error }).expect("serializes");
                let _ = link.send(&record);
                refill = Some((vm, Instant::now() + POOL_REFILL_DELAY));
            }
            ToHolder::Shutdown => break,
        }
    }
    teardown(held.into_values().collect());
    drop(pool);
    for reaper in reaping.into_values().chain(reaped_pools) {
        let _ = reaper.join();
    }
    0
}

/// VM `vm`'s index among the holder's slots `own`, if it is one of them.
fn slot_in(ctx: &BuildContext, own: &std::ops::Range<usize>, vm: u32) -> Option<usize> {
    (vm >= ctx.first_id)
        .then(|| ctx.slot_of(vm))
        .filter(|slot| own.contains(slot))
        .map(|slot| slot - own.start)
}

/// Closes VM `vm`'s eventfds (it sleeps, or is gone).
fn forget_eventfds(
    ctx: &BuildContext,
    eventfds: &mut Eventfds,
    own: &std::ops::Range<usize>,
    vm: u32,
) {
    if let Some(at) = slot_in(ctx, own, vm) {
        eventfds[at] = None;
    }
}

/// Makes the pool's KVM VM and vCPU thread if it has none (`vm` names it
/// in errors), beside the holder's `held` VMs.
fn fill_pool(
    ctx: &BuildContext,
    pool: &mut Option<Prebuilt>,
    vm: u32,
    (held, own): (&HashMap<u32, HeldVm>, &std::ops::Range<usize>),
) {
    if pool.is_some() {
        return;
    }
    let used = stacks_in_use(held, None);
    let Some(stack) = free_stack(own, &used, own.end) else {
        return;
    };
    // The thread first: spawned once the VM has its MMU notifier, it would
    // visit it (see `VcpuHandle`).
    *pool = builder::park_vcpu(ctx, vm, stack)
        .and_then(|vcpu| {
            let kvm = builder::prepare(ctx, vm)?;
            Ok(Prebuilt { vcpu, stack, kvm })
        })
        .ok();
}

/// The slots of the stack arena that the holder's threads run on: its VMs'
/// and the pooled one's.
fn stacks_in_use(held: &HashMap<u32, HeldVm>, pool: Option<&Prebuilt>) -> HashSet<usize> {
    held.values()
        .map(|vm| vm.stack)
        .chain(pool.map(|p| p.stack))
        .collect()
}

/// A stack slot not in `used`: `prefer` if it is free, else the first free
/// one of the holder's `own` slots and `own.end`. That one more lets the
/// pool's thread exist beside one for every VM; it is the next holder's
/// first slot, never used in this process, whose copy of the arena is its
/// own.
fn free_stack(own: &std::ops::Range<usize>, used: &HashSet<usize>, prefer: usize) -> Option<usize> {
    std::iter::once(prefer)
        .filter(|s| (own.start..=own.end).contains(s))
        .chain(own.start..=own.end)
        .find(|s| !used.contains(s))
}

/// Starts hibernated VM `vm` again (or boots it) on `pooled` (or a KVM VM
/// and vCPU thread made now); `protect_sys` as for [`builder::build`].
fn wake(
    ctx: &BuildContext,
    vm: u32,
    start: Start,
    pooled: Option<Prebuilt>,
    (eventfds, own): (&Eventfds, &std::ops::Range<usize>),
    held: &HashMap<u32, HeldVm>,
    protect_sys: bool,
) -> Result<HeldVm, WakeError> {
    if vm < ctx.first_id || !own.contains(&ctx.slot_of(vm)) {
        return Err(WakeError::NotOurs { vm });
    }
    let slot = ctx.slot_of(vm);
    if held.contains_key(&vm) {
        return Err(WakeError::Awake { vm });
    }
    let parts = match pooled {
        Some(parts) => parts,
        None => {
            let stack = free_stack(own, &stacks_in_use(held, None), slot)
                .ok_or(BuildError::NoStack { vm })?;
            let vcpu = builder::park_vcpu(ctx, vm, stack)?;
            let kvm = EmptyVm::Created(builder::create(ctx, vm)?);
            Prebuilt { vcpu, stack, kvm }
        }
    };
    let (irq, doorbell) = eventfds[slot - own.start]
        .as_ref()
        .ok_or(WakeError::NoEventfds { vm })?;
    Ok(builder::build(
        ctx,
        vm,
        parts,
        (irq, doorbell),
        start,
        protect_sys,
    )?)
}

/// Closes every descriptor of the process but those in `keep`
/// (close_range(2) over the gaps). Only for a freshly forked holder: a Rust
/// object still owning a descriptor closed here must never be dropped.
fn close_all_but(keep: &mut [RawFd]) -> std::io::Result<()> {
    keep.sort_unstable();
    let mut next: u32 = 0;
    for &fd in keep.iter() {
        let fd = fd as u32;
        if fd > next {
            close_range(next, fd - 1)?;
        }
        next = next.max(fd.saturating_add(1));
    }
    close_range(next, u32::MAX)
}

fn close_range(first: u32, last: u32) -> std::io::Result<()> {
    // SAFETY: closes descriptors only; the caller keeps what it still uses.
    match unsafe { libc::syscall(libc::SYS_close_range, first, last, 0u32) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Stops every vCPU, then destroys the VMs from several threads so their
/// SRCU grace periods overlap.
fn teardown(mut vms: Vec<HeldVm>) {
    for vm in &mut vms {
        vm.vcpu.request_stop();
    }
    let per_thread = vms.len().div_ceil(TEARDOWN_THREADS).max(1);
    std::thread::scope(|scope| {
        for chunk in vms.chunks_mut(per_thread) {
            scope.spawn(move || chunk.iter_mut().for_each(HeldVm::release));
        }
    });
}

/// Builds VMs `first..first + count` on `ctx.boot_threads` threads, in id
/// order; stops at the first failure.
fn build_all(
    ctx: &BuildContext,
    first: u32,
    count: u32,
    eventfds: &Eventfds,
    (own, mut stacks): (&std::ops::Range<usize>, HashSet<usize>),
) -> (Vec<HeldVm>, Option<String>) {
    let started = Instant::now();
    let late = |id: u32| {
        Some(format!(
            "VM {id}: not built within {} s",
            BUILD_LIMIT.as_secs()
        ))
    };
    let ids = first..first + count;
    if let Some(id) = ids.clone().find(|&id| !own.contains(&ctx.slot_of(id))) {
        return (Vec::new(), Some(format!("VM {id} is not this holder's")));
    }
    if let Some(id) = ids
        .clone()
        .find(|&id| eventfds[ctx.slot_of(id) - own.start].is_none())
    {
        return (
            Vec::new(),
            Some(format!("VM {id}: no eventfds to build it with")),
        );
    }
    // Every KVM VM is created before any vCPU maps its run page: creating
    // one visits every VMA, so this keeps the boot linear in the VM count.
    let mut parts = Vec::with_capacity(count as usize);
    for id in ids.clone() {
        if started.elapsed() > BUILD_LIMIT {
            return (Vec::new(), late(id));
        }
        let Some(stack) = free_stack(own, &stacks, ctx.slot_of(id)) else {
            return (Vec::new(), Some(BuildError::NoStack { vm: id }.to_string()));
        };
        stacks.insert(stack);
        match builder::create(ctx, id)
            .and_then(|kvm| Ok((kvm, builder::park_vcpu(ctx, id, stack)?)))
        {
            Ok((kvm, vcpu)) => parts.push(Mutex::new(Some(Prebuilt {
                vcpu,
                stack,
                kvm: EmptyVm::Created(kvm),
            }))),
            Err(e) => return (Vec::new(), Some(e.to_string())),
        }
    }
    let next = std::sync::atomic::AtomicU32::new(0);
    let built: Mutex<Vec<Option<Result<HeldVm, BuildError>>>> =
        Mutex::new((0..count).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..ctx.boot_threads.clamp(1, 16) {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if index >= count || started.elapsed() > BUILD_LIMIT {
                    return;
                }
                let prebuilt = parts[index as usize]
                    .lock()
                    .expect("prebuilt")
                    .take()
                    .expect("each VM built once");
                let id = first + index;
                let (irq, doorbell) = eventfds[ctx.slot_of(id) - own.start]
                    .as_ref()
                    .expect("checked before the threads started");
                let result = builder::build(ctx, id, prebuilt, (irq, doorbell), Start::Boot, true);
                built.lock().expect("built")[index as usize] = Some(result);
            });
        }
    });
    let mut vms = Vec::with_capacity(count as usize);
    let mut error = None;
    for (index, result) in built.into_inner().expect("built").into_iter().enumerate() {
        let Some(result) = result else {
            // Not started before the limit: neither are the rest.
            error.get_or_insert_with(|| late(first + index as u32).unwrap_or_default());
            continue;
        };
        match result {
            Ok(vm) if error.is_none() => vms.push(vm),
            // Past the first failure the ids would not be consecutive.
            Ok(mut vm) => vm.release(),
            Err(e) => {
                error.get_or_insert(e.to_string());
            }
        }
    }
    (vms, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_gives_up_building_before_its_cell_gives_up_on_it() {
        assert!(BUILD_LIMIT < deadline::HOLDER_BUILD);
        assert!(deadline::HOLDER_BUILD < deadline::CELL_CREATE);
    }

    #[test]
    fn a_thread_gets_a_stack_no_other_thread_of_its_holder_runs_on() {
        let own = 8..12;
        let used: HashSet<usize> = [9, 12].into();
        assert_eq!(free_stack(&own, &used, 10), Some(10), "its own slot, free");
        assert_eq!(free_stack(&own, &used, 9), Some(8), "its own slot, taken");
        assert_eq!(free_stack(&own, &used, 3), Some(8), "not the holder's");
        let spare_only: HashSet<usize> = (8..12).collect();
        assert_eq!(free_stack(&own, &spare_only, 9), Some(12), "the spare");
        let all: HashSet<usize> = (8..=12).collect();
        assert_eq!(free_stack(&own, &all, 9), None);
    }

    #[test]
    fn records_keep_their_boundaries_and_descriptors() {
        let (a, b) = seqpacket_pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let evt = EventFd::new(0).unwrap();
        let one = serde_json::to_vec(&FromHolder::Stopped { vm: 1 }).unwrap();
        let two = serde_json::to_vec(&FromHolder::Ready).unwrap();
        a.send_with_fds(&[&two[..]], &[evt.as_raw_fd()]).unwrap();
        a.send(&one).unwrap();
        match receive::<FromHolder>(&b).unwrap() {
            Received::Record(FromHolder::Ready, fds) => {
                assert_eq!(fds.len(), 1);
                // SAFETY: reads the flags of a descriptor we own.
                let flags = unsafe { libc::fcntl(fds[0].as_raw_fd(), libc::F_GETFD) };
                assert!(
                    flags & libc::FD_CLOEXEC != 0,
                    "received without close-on-exec"
                );
            }
            _ => panic!("expected ready with a descriptor"),
        }
        match receive::<FromHolder>(&b).unwrap() {
            Received::Record(FromHolder::Stopped { vm: 1 }, fds) => assert!(fds.is_empty()),
            _ => panic!("expected stopped"),
        }
        assert!(matches!(
            receive::<FromHolder>(&b).unwrap(),
            Received::Nothing
        ));
        drop(a);
        assert!(matches!(
            receive::<FromHolder>(&b).unwrap(),
            Received::Closed
        ));
    }
}
