//! The parent process's event loop: the control API, the links to the
//! cells, signals, and the pager that all cells share.
//!
//! A control request is answered by asking the cells that hold the VMs it
//! names (all of them for `stats` and `list`) and merging their replies with
//! the pager's figures, so a client sees one monitor. A cell that dies takes
//! only its own VMs down: they are reported crashed with the reason, and
//! their budget and swap go back to the pager.
//!
//! A cell is untrusted: a message that does not parse, is too long, answers
//! no request in flight, or names counts or VMs that are not the cell's, a
//! `Failed` after its boot, a reply later than its deadline
//! ([`deadline`]), or a failure of its guest memory in the pager ends that
//! cell (killed, its VMs crashed with a one-line reason), never the parent.
//!
//! A control client gets work done only while it is there and reads: its
//! requests are handled one at a time, none once it has hung up, none
//! while its unread replies pass [`API_BACKPRESSURE`]; a turn of the loop
//! handles requests for at most [`TURN_BUDGET`], so signals stay prompt.

use crate::config::{self, CellSettings};
use crate::link::framing::{FrameError, LineStream, More};
use crate::link::idle_profile::global_cut;
use crate::link::protocol::{deadline, FromCell, ToCell};
use crate::link::wake_latency::WakeLatencies;
use crate::parent::api::{self, Request};
use crate::parent::cell_handle::{quote, Cell, PendingCell};
use crate::parent::heap_trim::HeapTrim;
use crate::parent::steering::Steering;
use mio::net::{UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token};
use paging_policy::trace::TraceWriter;
use paging_policy::{CloneTemplate, Pager};
use serde_json::{json, Map, Value};
use slab::Slab;
use std::collections::VecDeque;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const API: Token = Token(0);
const SIGNALS: Token = Token(1);
const KIND_SHIFT: usize = 28;
const KIND_API_CLIENT: usize = 1;
const KIND_CELL: usize = 2;
/// Longest control request accepted.
const MAX_API_LINE: usize = 64 << 10;
/// Control clients served at once; more are turned away with an error.
const MAX_API_CLIENTS: usize = 256;
/// Requests of one client handled per turn of it: a client that pipelines
/// requests faster than they are answered goes to the back of the queue, so
/// the other clients, the cells and the signals are served in between.
const API_REQUESTS_PER_TURN: usize = 32;
/// Longest one client's turn takes (a request in progress is finished).
const CLIENT_SLICE: Duration = Duration::from_millis(10);
/// Unread replies past which a client's requests are not read any more
/// until it reads (backpressure): at most one reply more is queued.
pub const API_BACKPRESSURE: usize = 1 << 20;
/// Longest a turn of the loop spends on control clients before it looks at
/// signals and the cells again (at least one client is served per turn).
const TURN_BUDGET: Duration = Duration::from_millis(50);
/// Lines of one cell handled per turn (a cell that floods its link waits
/// for the next turn).
const CELL_LINES_PER_TURN: usize = 1024;
/// Longest a cell whose link closed may take to exit before it is killed.
const CELL_EXIT_AFTER_CLOSE: Duration = Duration::from_secs(1);
/// Longest a cell may take to exit once asked to.
const CELL_EXIT_GRACE: Duration = Duration::from_secs(20);
/// Most requests of one VM recorded per report (a guest writes the counter).
const MAX_TRACED_PER_REPORT: u64 = 1 << 16;

fn token(kind: usize, index: usize) -> Token {
    Token((kind << KIND_SHIFT) | index)
}

/// Why the event loop ended.
#[derive(Debug)]
pub enum Exit {
    /// SIGINT or SIGTERM.
    Signal(i32),
}

/// Why the parent's run cannot go on, or a control request failed.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// The pager failed (its own one-line message).
    #[error("pager: {0}")]
    Pager(String),
    /// Polling failed.
    #[error("event loop: {0}")]
    Poll(io::Error),
    /// A cell failed its first boot, or answered a request with an error (its message).
    #[error("cell {index}: {error}")]
    Cell {
        /// The cell's index.
        index: usize,
        /// What it said.
        error: String,
    },
}

/// What a cell said or did that ends it, or the run.
enum CellFault {
    /// The cell is ended (killed): a hostile or broken message.
    Hostile(String),
    /// One of the first cells could not boot: the run cannot go on.
    BootFailed(String),
}

/// Why a cell is ended.
enum End {
    /// Its link closed or failed.
    Link(FrameError),
    /// It broke the protocol (what, one line).
    Hostile(String),
    /// It missed a deadline.
    Deadline(Duration),
    /// The pager failed on its guest memory.
    Memory(String),
    /// Every VM of it was destroyed and no `create` will grow it.
    Retired,
}

/// A control client.
struct ApiClient {
    lines: LineStream<UnixStream>,
    /// It closed its end: no more requests; kept until its replies are out.
    eof: bool,
    /// It is in [`Supervisor::clients_ready`].
    queued: bool,
}

/// Parameters of [`Supervisor::new`].
pub struct SupervisorSetup {
    /// What every cell runs with (new cells are started with it).
    pub settings: CellSettings,
    /// Most VMs a cell holds (`--cell-vms` resolved).
    pub cell_vms: u32,
    /// Most VMs the monitor holds at once ([`config::max_vms`]).
    pub max_vms: u32,
    /// The cells, handed over and booting.
    pub cells: Vec<Cell>,
    /// The pager every cell's memory is attached to.
    pub pager: Arc<Pager>,
    /// Where every VM address is steered to its cell's socket.
    pub steering: Steering,
    /// RAM of one VM.
    pub ram_bytes: usize,
    /// "pvm" or "kvm": what every cell's hello must say.
    pub platform: &'static str,
    /// Bound control socket.
    pub api: std::os::unix::net::UnixListener,
    /// Its path (removed at exit).
    pub api_path: PathBuf,
    /// When the boot started.
    pub boot_started: Instant,
    /// Fields of the ready line.
    pub ready_line: Value,
    /// The request trace being recorded, if any.
    pub trace: Option<TraceWriter>,
}

/// The parent: control API, cells, pager.
pub struct Supervisor {
    poll: Poll,
    settings: CellSettings,
    cell_vms: u32,
    max_vms: u32,
    cells: Vec<Cell>,
    /// Cells with lines left unread after their turn.
    cells_with_more: Vec<usize>,
    pager: Arc<Pager>,
    steering: Steering,
    ram_bytes: usize,
    platform: &'static str,
    api: UnixListener,
    api_path: PathBuf,
    clients: Slab<ApiClient>,
    /// Clients with an event or requests left, served in this order (round
    /// robin): an event only queues its client, so a client that floods
    /// requests cannot take the turn of one that came after it.
    clients_ready: VecDeque<usize>,
    signals: signal_hook_mio::v1_0::Signals,
    boot_started: Instant,
    ready_line: Option<Value>,
    trace: Option<TraceWriter>,
    heap_trim: HeapTrim,
    /// With clone boot, what the cells were told of the template
    /// ([`ToCell::Template`]): `None` until the pager saved it or gave up.
    template_told: Option<bool>,
}

/// Whether the peer of `fd` has closed its end entirely (it can read no
/// reply): POLLHUP, which a half-close (SHUT_WR) does not raise.
fn hung_up(fd: i32) -> bool {
    let mut fds = [libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    }];
    // SAFETY: one valid pollfd; a zero timeout never waits.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
    n == 1 && fds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0
}

impl Supervisor {
    /// Registers the control socket, the signals and every cell's link.
    pub fn new(setup: SupervisorSetup) -> io::Result<Self> {
        let poll = Poll::new()?;
        let mut api = UnixListener::from_std(setup.api);
        poll.registry()
            .register(&mut api, API, Interest::READABLE)?;
        let mut signals = signal_hook_mio::v1_0::Signals::new([libc::SIGINT, libc::SIGTERM])?;
        poll.registry()
            .register(&mut signals, SIGNALS, Interest::READABLE)?;
        let mut supervisor = Supervisor {
            poll,
            settings: setup.settings,
            cell_vms: setup.cell_vms,
            max_vms: setup.max_vms,
            cells: Vec::new(),
            cells_with_more: Vec::new(),
            pager: setup.pager,
            steering: setup.steering,
            ram_bytes: setup.ram_bytes,
            platform: setup.platform,
            api,
            api_path: setup.api_path,
            clients: Slab::new(),
            clients_ready: VecDeque::new(),
            signals,
            boot_started: setup.boot_started,
            ready_line: Some(setup.ready_line),
            trace: setup.trace,
            heap_trim: HeapTrim::new(),
            template_told: None,
        };
        if !supervisor
            .settings
            .hibernation
            .is_some_and(|h| h.clone_boot)
        {
            supervisor.template_told = Some(false);
        }
        for cell in setup.cells {
            supervisor.adopt(cell)?;
        }
        Ok(supervisor)
    }

    fn adopt(&mut self, mut cell: Cell) -> io::Result<()> {
        let index = self.cells.len();
        if let Some(link) = cell.link.as_mut() {
            self.poll.registry().register(
                &mut link.stream,
                token(KIND_CELL, index),
                Interest::READABLE,
            )?;
        }
        self.cells.push(cell);
        Ok(())
    }

    /// Runs until a signal; prints the ready line once every cell has booted.
    /// Err: the run cannot go on (the pager failed, a cell could not boot).
    pub fn run(&mut self) -> Result<Exit, SupervisorError> {
        let mut events = Events::with_capacity(256);
        loop {
            if let Some(error) = self.pager.fatal_error() {
                return Err(SupervisorError::Pager(error));
            }
            self.end_failures();
            self.check_template();
            self.check_boot();
            let trim_in = self.heap_trim.tick();
            let timeout = if !self.clients_ready.is_empty() || !self.cells_with_more.is_empty() {
                Duration::ZERO
            } else if self.ready_line.is_some() || self.template_told.is_none() {
                Duration::from_millis(20)
            } else {
                trim_in.map_or(Duration::from_millis(250), |t| {
                    t.min(Duration::from_millis(250))
                })
            };
            crate::link::framing::nonblocking(|| self.poll.poll(&mut events, Some(timeout)))
                .map_err(SupervisorError::Poll)?;
            let turn = Instant::now();
            for event in events.iter() {
                let Token(t) = event.token();
                match event.token() {
                    API => self.accept_clients(),
                    SIGNALS => {
                        if let Some(signal) = self.signals.pending().next() {
                            return Ok(Exit::Signal(signal));
                        }
                    }
                    _ => {
                        let index = t & ((1 << KIND_SHIFT) - 1);
                        match t >> KIND_SHIFT {
                            KIND_API_CLIENT => self.queue_client(index),
                            KIND_CELL => self.cell_ready(index)?,
                            _ => {}
                        }
                    }
                }
            }
            for index in std::mem::take(&mut self.cells_with_more) {
                self.cell_ready(index)?;
            }
            self.serve_clients(turn);
        }
    }

    /// Prints the ready line once every cell has booted and, with clone
    /// boot, the template is saved (or given up): VMs then start at once.
    fn check_boot(&mut self) {
        if self.ready_line.is_none()
            || self.template_told.is_none()
            || self
                .cells
                .iter()
                .any(|c| c.booted.is_none() && c.dead.is_none())
        {
            return;
        }
        let mut line = self.ready_line.take().expect("checked above");
        let (mut ready, mut failed) = (0u32, 0u32);
        for cell in &self.cells {
            match (cell.booted, &cell.dead) {
                (Some((r, f)), None) => {
                    (ready, failed) = (ready.saturating_add(r), failed.saturating_add(f))
                }
                _ => failed = failed.saturating_add(cell.count),
            }
        }
        line["event"] = json!("ready");
        line["vms"] = json!(ready);
        line["failed"] = json!(failed);
        line["boot_seconds"] = json!(self.boot_started.elapsed().as_secs_f64());
        emit(&line);
    }

    /// With clone boot, tells every cell once whether VMs created asleep
    /// start as clones: when the pager has saved the template, or has given
    /// up on it (its cell ended, or it was not saved within the boot
    /// timeout; then every VM boots from the image, as without `--clone-boot`).
    fn check_template(&mut self) {
        if self.template_told.is_some() {
            return;
        }
        let ready = match self.pager.clone_template() {
            CloneTemplate::Pending => {
                let why = if self.live_cell_of(config::TEMPLATE_VM).is_none() {
                    "its cell ended"
                } else if self.boot_started.elapsed() > self.settings.boot_timeout {
                    "it was not saved within the boot timeout"
                } else {
                    return;
                };
                self.pager.abandon_clone_template(why);
                return;
            }
            CloneTemplate::Ready => true,
            CloneTemplate::Off => false,
            CloneTemplate::Failed(why) => {
                crate::log!(
                    "densevm: clone boot: the template could not be saved ({why}); every VM boots from the image"
                );
                false
            }
        };
        self.template_told = Some(ready);
        for index in self.live_cells() {
            self.tell_template(index, ready);
        }
    }

    /// Sends cell `index` the template's [`ToCell::Template`] notice.
    fn tell_template(&mut self, index: usize, ready: bool) {
        if let Err(e) = self.cells[index].notify(&ToCell::Template { ready }) {
            crate::log!("densevm: cell {index}: tell it of the template: {e}");
        }
    }

    /// Forgets a VM in the pager and in the steering; the memory this frees
    /// is trimmed soon after.
    fn unregister_vm(&mut self, vm: u32) {
        self.pager.unregister_vm(vm);
        self.steering.unroute(*self.settings.addr_of(vm).ip());
        self.heap_trim.freed();
    }

    /// Ends what the pager reports failed: the cell of a failed space, a
    /// failed VM.
    fn end_failures(&mut self) {
        for failure in self.pager.take_failures() {
            match failure.vm {
                None => {
                    let holder = self
                        .cells
                        .iter()
                        .position(|c| c.dead.is_none() && c.spaces.contains(&failure.space));
                    match holder {
                        Some(index) => self.end_cell(index, End::Memory(failure.reason)),
                        None => self.pager.detach_space(failure.space),
                    }
                }
                Some(vm) => {
                    crate::log!(
                        "densevm: VM {vm}: the pager failed on its memory ({}); it is stopped",
                        quote(&failure.reason)
                    );
                    if let Some(index) = self.live_cell_of(vm) {
                        // Its vCPU may wait in a fault until it is unregistered:
                        // the destroy is not waited for.
                        let fail = ToCell::Fail {
                            vm,
                            reason: format!("the pager failed on its memory: {}", failure.reason),
                        };
                        if let Ok(id) = self.cells[index].send(&fail) {
                            let _ = self
                                .collect(vec![(index, id)], Instant::now() + deadline::CELL_REPLY);
                        }
                    }
                    self.unregister_vm(vm);
                }
            }
        }
    }

    // ---- cells ----

    fn cell_ready(&mut self, index: usize) -> Result<(), SupervisorError> {
        let Some(link) = self.cells[index].link.as_mut() else {
            return Ok(());
        };
        let mut lines = Vec::new();
        let result = link.read_lines_upto(&mut lines, CELL_LINES_PER_TURN);
        for line in lines {
            match self.cell_message(index, &line) {
                Ok(None) => {}
                Ok(Some((id, _))) => {
                    self.end_cell(index, End::Hostile(format!("a reply ({id}) to no request")));
                    return Ok(());
                }
                Err(CellFault::Hostile(why)) => {
                    self.end_cell(index, End::Hostile(why));
                    return Ok(());
                }
                Err(CellFault::BootFailed(error)) => {
                    return Err(SupervisorError::Cell { index, error })
                }
            }
        }
        match result {
            Ok(More::No) => {}
            Ok(More::Lines) => self.cells_with_more.push(index),
            Err(e) => self.end_cell(index, End::Link(e)),
        }
        Ok(())
    }

    /// Handles a line from a cell: an event, or a reply (returned with its
    /// id for the caller to match).
    fn cell_message(
        &mut self,
        index: usize,
        line: &[u8],
    ) -> Result<Option<(u64, Value)>, CellFault> {
        let message = serde_json::from_slice::<FromCell>(line)
            .map_err(|e| CellFault::Hostile(format!("bad message ({e})")))?;
        let cell = &mut self.cells[index];
        match message {
            FromCell::Booted { .. } if cell.booted.is_some() => {
                return Err(CellFault::Hostile("booted twice".into()))
            }
            FromCell::Booted { ready, failed } => {
                if ready as u64 + failed as u64 > cell.count as u64 {
                    return Err(CellFault::Hostile(format!(
                        "booted {ready} + {failed} of its {} VMs",
                        cell.count
                    )));
                }
                cell.booted = Some((ready, failed));
            }
            FromCell::Access { counts } => {
                if let Some(&(vm, _)) = counts.iter().find(|(vm, _)| !cell.holds(*vm)) {
                    return Err(CellFault::Hostile(format!(
                        "reported requests of VM {vm}, which it does not hold"
                    )));
                }
                self.note_access(&counts);
            }
            FromCell::Stopped { vm } if cell.holds(vm) => {
                let spent = cell.note_stopped(vm);
                self.unregister_vm(vm);
                if let Some(space) = spent {
                    // A lying count detaches only this cell's own memory.
                    self.pager.detach_space(space);
                }
            }
            FromCell::Stopped { vm } => {
                return Err(CellFault::Hostile(format!(
                    "reported VM {vm} stopped, which it does not hold"
                )))
            }
            FromCell::Hibernated { vm } if cell.holds(vm) => self.pager.hibernate(vm),
            FromCell::Waking { vm } if cell.holds(vm) => self.pager.note_woken(vm),
            FromCell::Hibernated { vm } | FromCell::Waking { vm } => {
                return Err(CellFault::Hostile(format!(
                    "reported VM {vm} hibernated or woken, which it does not hold"
                )))
            }
            FromCell::Idle { profile } => {
                let max_live = self.settings.hibernation.and_then(|h| h.max_live);
                let Some(max_live) = max_live else {
                    return Err(CellFault::Hostile(
                        "an idle profile without --max-live".into(),
                    ));
                };
                profile.check(cell.capacity).map_err(CellFault::Hostile)?;
                cell.idle = Some(profile);
                let live = self.cells.iter().filter(|c| c.dead.is_none());
                let ms = global_cut(live.filter_map(|c| c.idle.as_ref()), max_live);
                if let Err(e) = self.cells[index].notify(&ToCell::SleepBefore { ms }) {
                    self.end_cell(index, End::Link(e));
                }
            }
            FromCell::HolderLeft { holder } => {
                let Some(&space) = cell.spaces.get(holder as usize) else {
                    return Err(CellFault::Hostile(format!(
                        "reported holder {holder} left, which it does not have"
                    )));
                };
                // Refused only for a space that failed (its VMs were told)
                // or is gone: nothing is left to release.
                let _ = self.pager.release_process(space);
            }
            FromCell::HolderStarted { holder } => {
                let space = cell.spaces.get(holder as usize).copied();
                let uffd = cell.link.as_mut().and_then(|link| link.stream.take_fd());
                let (Some(space), Some(uffd)) = (space, uffd) else {
                    return Err(CellFault::Hostile(format!(
                        "restarted holder {holder} without a space or its userfaultfd"
                    )));
                };
                let error = self
                    .pager
                    .reattach_space(space, uffd)
                    .err()
                    .map(|e| e.to_string());
                if let Err(e) = cell.notify(&ToCell::HolderAttached { holder, error }) {
                    self.end_cell(index, End::Link(e));
                }
            }
            FromCell::Reply { id, reply } => return Ok(Some((id, reply))),
            FromCell::Failed { error } if cell.booted.is_none() && self.ready_line.is_some() => {
                return Err(CellFault::BootFailed(quote(&error)))
            }
            FromCell::Failed { error } => {
                return Err(CellFault::Hostile(format!("failed: {}", quote(&error))))
            }
        }
        Ok(None)
    }

    fn note_access(&mut self, counts: &[(u32, u64)]) {
        for &(vm, requests) in counts {
            self.pager.note_access(vm);
            if let Some(writer) = self.trace.as_mut() {
                let recorded =
                    (0..requests.min(MAX_TRACED_PER_REPORT)).try_for_each(|_| writer.record(vm));
                if let Err(e) = recorded {
                    crate::log!("densevm: error: trace: {e}; recording stops");
                    self.trace = None;
                }
            }
        }
    }

    /// Ends cell `index`: its link closes, the process is reaped (killed
    /// unless its link closed on its own), its VMs are down and its memory
    /// goes back to the pager.
    fn end_cell(&mut self, index: usize, end: End) {
        let cell = &mut self.cells[index];
        if cell.dead.is_some() {
            return;
        }
        if let Some(mut link) = cell.link.take() {
            let _ = self.poll.registry().deregister(&mut link.stream);
        }
        let (i, pid) = (cell.index, cell.pid);
        // A process that dies with bytes unread on its socket resets the link.
        let reason = match end {
            End::Link(FrameError::Closed) => {
                format!("cell {i} (pid {pid}) {}", cell.reap(CELL_EXIT_AFTER_CLOSE))
            }
            End::Link(FrameError::Io(e)) if e.kind() == io::ErrorKind::ConnectionReset => {
                format!("cell {i} (pid {pid}) {}", cell.reap(CELL_EXIT_AFTER_CLOSE))
            }
            End::Link(other) => {
                format!(
                    "cell {i} (pid {pid}): link failed ({other}); {}",
                    cell.kill()
                )
            }
            End::Hostile(why) => {
                format!("cell {i} (pid {pid}) was stopped: {why}; {}", cell.kill())
            }
            End::Deadline(within) => format!(
                "cell {i} (pid {pid}) was stopped: no answer within {} s; {}",
                within.as_secs(),
                cell.kill()
            ),
            End::Memory(why) => format!(
                "cell {i} (pid {pid}) was stopped: its guest memory failed ({}); {}",
                quote(&why),
                cell.kill()
            ),
            End::Retired => format!(
                "cell {i} (pid {pid}) retired: every VM of it was destroyed; {}",
                cell.reap(CELL_EXIT_AFTER_CLOSE)
            ),
        };
        crate::log!(
            "densevm: {reason}: its VMs {}..{} are down",
            cell.first_id,
            cell.first_id + cell.count.saturating_sub(1)
        );
        for space in std::mem::take(&mut cell.spaces) {
            self.pager.detach_space(space);
        }
        cell.dead = Some(reason);
        self.cells_with_more.retain(|&c| c != index);
        self.heap_trim.freed();
    }

    /// Ends cell `index`, whose every VM was destroyed and which no `create`
    /// will grow: it is told to stop (killed if it has not exited within a
    /// second), its memory goes back to the pager, and nothing of it is
    /// listed. A long run that replaces VMs keeps as many cells as it needs,
    /// not one for every VM it ever created.
    fn retire(&mut self, index: usize) {
        // One that cannot be told is killed by the reap.
        let _ = self.cells[index].send(&ToCell::Shutdown);
        self.end_cell(index, End::Retired);
        self.cells[index].forget_all();
    }

    /// Sends `request` to each cell in `targets`, then collects their
    /// replies until `by`, handling their events meanwhile. A cell that dies
    /// or breaks the protocol gets an error in its place; one that has not
    /// answered by then is killed.
    fn ask(&mut self, targets: &[usize], request: &ToCell, by: Instant) -> Vec<(usize, Value)> {
        let mut waiting = Vec::new();
        for &index in targets {
            if self.cells[index].dead.is_some() {
                continue;
            }
            match self.cells[index].send(request) {
                Ok(id) => waiting.push((index, id)),
                Err(e) => self.end_cell(index, End::Link(e)),
            }
        }
        self.collect(waiting, by)
    }

    /// Collects the replies of `waiting` (cell, request id) until `by`.
    fn collect(&mut self, mut waiting: Vec<(usize, u64)>, by: Instant) -> Vec<(usize, Value)> {
        let started = Instant::now();
        let mut replies = Vec::with_capacity(waiting.len());
        let gone = |index: usize| json!({ "error": format!("cell {index} is gone") });
        while !waiting.is_empty() {
            let mut again = false;
            let mut i = 0;
            while i < waiting.len() {
                let (index, id) = waiting[i];
                match self.try_reply(index, id) {
                    Some(Some(reply)) => {
                        replies.push((index, reply));
                        waiting.swap_remove(i);
                    }
                    Some(None) => {
                        replies.push((index, gone(index)));
                        waiting.swap_remove(i);
                    }
                    None => {
                        again |= self.cells_with_more.contains(&index);
                        i += 1;
                    }
                }
            }
            if waiting.is_empty() {
                break;
            }
            let left = by.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let within = by.saturating_duration_since(started);
                for (index, _) in waiting.drain(..) {
                    self.end_cell(index, End::Deadline(within.max(Duration::from_secs(1))));
                    replies.push((
                        index,
                        json!({ "error": format!("cell {index} did not answer within {} s; it was stopped", within.as_secs().max(1)) }),
                    ));
                }
                break;
            }
            if again {
                continue;
            }
            let mut fds: Vec<libc::pollfd> = waiting
                .iter()
                .filter_map(|&(index, _)| self.cells[index].link.as_ref())
                .map(|link| libc::pollfd {
                    fd: link.stream.as_raw_fd(),
                    events: if link.unsent() > 0 {
                        libc::POLLIN | libc::POLLOUT
                    } else {
                        libc::POLLIN
                    },
                    revents: 0,
                })
                .collect();
            // SAFETY: valid pollfds, as many as given.
            unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    left.as_millis().clamp(1, 1000) as i32,
                )
            };
        }
        replies
    }

    /// Reads what cell `index` sent: `Some(Some(reply))` once the reply to
    /// request `id` came, `Some(None)` if the cell is gone (or was ended),
    /// `None` while it is still awaited.
    fn try_reply(&mut self, index: usize, id: u64) -> Option<Option<Value>> {
        self.cells_with_more.retain(|&c| c != index);
        let link = self.cells[index].link.as_mut()?;
        let flushed = link.flush();
        let mut lines = Vec::new();
        let read = link
            .read_lines_upto(&mut lines, CELL_LINES_PER_TURN)
            .and_then(|more| flushed.map(|_| more).map_err(FrameError::from));
        let mut answer = None;
        for line in lines {
            let fault = match self.cell_message(index, &line) {
                Ok(None) => continue,
                Ok(Some((rid, reply))) if rid == id && answer.is_none() => {
                    answer = Some(reply);
                    continue;
                }
                Ok(Some((rid, _))) => format!("a reply ({rid}) to no request in flight ({id})"),
                Err(CellFault::Hostile(why)) => why,
                // Not at boot: a cell is asked only after the ready line.
                Err(CellFault::BootFailed(why)) => format!("failed: {why}"),
            };
            self.end_cell(index, End::Hostile(fault));
            return Some(None);
        }
        match read {
            Ok(More::No) => {}
            Ok(More::Lines) => self.cells_with_more.push(index),
            Err(e) => {
                self.end_cell(index, End::Link(e));
                return Some(answer);
            }
        }
        answer.map(Some)
    }

    // ---- control API ----

    fn accept_clients(&mut self) {
        loop {
            match crate::link::framing::nonblocking(|| self.api.accept()) {
                Ok(Some((mut stream, _))) => {
                    if self.clients.len() >= MAX_API_CLIENTS {
                        // Clients that have gone make room first.
                        let gone: Vec<usize> = self
                            .clients
                            .iter()
                            .filter(|(_, c)| hung_up(c.lines.stream.as_raw_fd()))
                            .map(|(key, _)| key)
                            .collect();
                        gone.into_iter().for_each(|key| self.drop_client(key));
                    }
                    if self.clients.len() >= MAX_API_CLIENTS {
                        let refusal = format!("{{\"error\":\"more than {MAX_API_CLIENTS} control clients at once\"}}\n");
                        let _ = std::io::Write::write(&mut stream, refusal.as_bytes());
                        continue;
                    }
                    let entry = self.clients.vacant_entry();
                    if self
                        .poll
                        .registry()
                        .register(
                            &mut stream,
                            token(KIND_API_CLIENT, entry.key()),
                            Interest::READABLE | Interest::WRITABLE,
                        )
                        .is_ok()
                    {
                        entry.insert(ApiClient {
                            lines: LineStream::new(stream, MAX_API_LINE),
                            eof: false,
                            queued: false,
                        });
                    }
                }
                Ok(None) | Err(_) => return,
            }
        }
    }

    fn drop_client(&mut self, key: usize) {
        if let Some(mut client) = self.clients.try_remove(key) {
            let _ = self.poll.registry().deregister(&mut client.lines.stream);
            self.heap_trim.freed();
        }
        self.clients_ready.retain(|&k| k != key);
    }

    fn queue_client(&mut self, key: usize) {
        if let Some(client) = self.clients.get_mut(key) {
            if !client.queued {
                client.queued = true;
                self.clients_ready.push_back(key);
            }
        }
    }

    /// Gives the queued clients their turns, in order, while this turn's
    /// budget lasts (at least one); the rest wait for the next turn.
    fn serve_clients(&mut self, turn: Instant) {
        for served in 0..self.clients_ready.len() {
            if served > 0 && turn.elapsed() >= TURN_BUDGET {
                break;
            }
            let Some(key) = self.clients_ready.pop_front() else {
                break;
            };
            if let Some(client) = self.clients.get_mut(key) {
                client.queued = false;
                self.client_ready(key);
            }
        }
    }

    /// Serves client `key`: flushes its replies, then handles its requests
    /// one at a time while it is there, reads its replies, and its turn has
    /// budget left; one with requests left is queued again.
    fn client_ready(&mut self, key: usize) {
        let started = Instant::now();
        let mut handled = 0;
        loop {
            let Some(client) = self.clients.get_mut(key) else {
                return;
            };
            if client.lines.flush().is_err() {
                return self.drop_client(key);
            }
            if client.eof {
                if client.lines.unsent() == 0 {
                    self.drop_client(key);
                }
                return;
            }
            // Backpressure: not read from until it reads (a WRITABLE event
            // brings it back here).
            if client.lines.unsent() > API_BACKPRESSURE {
                return;
            }
            // A client that has gone gets no more work done for it.
            if hung_up(client.lines.stream.as_raw_fd()) {
                return self.drop_client(key);
            }
            if handled >= API_REQUESTS_PER_TURN || started.elapsed() >= CLIENT_SLICE {
                return self.queue_client(key);
            }
            let mut lines = Vec::with_capacity(1);
            let line = match client.lines.read_lines_upto(&mut lines, 1) {
                Ok(_) => match lines.pop() {
                    Some(line) => line,
                    // Nothing more now: its next input brings it back.
                    None => return,
                },
                Err(FrameError::TooLong(limit)) => {
                    let refusal = json!({ "error": format!("request longer than {limit} bytes") });
                    client.lines.queue(refusal.to_string().as_bytes());
                    let _ = client.lines.flush();
                    return self.drop_client(key);
                }
                Err(_) => {
                    client.eof = true;
                    continue;
                }
            };
            let reply = match api::parse(&line) {
                Ok(request) => self.handle(request),
                Err(error) => json!({ "error": error.to_string() }),
            };
            handled += 1;
            if let Some(client) = self.clients.get_mut(key) {
                client.lines.queue(reply.to_string().as_bytes());
            }
        }
    }

    fn live_cells(&self) -> Vec<usize> {
        (0..self.cells.len())
            .filter(|&i| self.cells[i].dead.is_none())
            .collect()
    }

    fn cell_of(&self, vm: u32) -> Option<usize> {
        self.cells.iter().position(|c| c.holds(vm))
    }

    fn live_cell_of(&self, vm: u32) -> Option<usize> {
        self.cell_of(vm).filter(|&i| self.cells[i].dead.is_none())
    }

    fn handle(&mut self, request: Request) -> Value {
        let result = match request {
            Request::Stats { per_vm } => self.stats(per_vm),
            Request::List => Ok(self.list()),
            Request::Create { count } => Ok(self.create(count)),
            Request::Destroy { vm } => Ok(self.destroy(vm)),
            Request::Crash { vm, triple } => Ok(self.forward(vm, ToCell::Crash { vm, triple })),
            Request::Pager => Ok(
                json!({ "ok": true, "pager": self.pager.totals().get("config").cloned().unwrap_or(Value::Null) }),
            ),
            Request::Disk { modeled } => {
                self.pager.set_disk_modeled(modeled);
                Ok(json!({ "ok": true, "modeled": modeled }))
            }
        };
        result.unwrap_or_else(|error| json!({ "error": error.to_string() }))
    }

    fn forward(&mut self, vm: u32, request: ToCell) -> Value {
        let Some(index) = self.live_cell_of(vm) else {
            return json!({ "error": format!("no running VM {vm}") });
        };
        let by = Instant::now() + deadline::CELL_REPLY;
        self.ask(&[index], &request, by).pop().map_or_else(
            || json!({ "error": format!("no running VM {vm}") }),
            |(_, r)| r,
        )
    }

    /// Stops a VM; one of a cell that is gone (crashed) is forgotten: no
    /// longer listed, so nothing of it is kept. A cell left with no VM that
    /// was not destroyed is retired.
    fn destroy(&mut self, vm: u32) -> Value {
        let Some(index) = self.cell_of(vm) else {
            return json!({ "error": format!("no running VM {vm}") });
        };
        if self.cells[index].dead.is_some() {
            return match self.cells[index].forget(vm) {
                true => json!({ "ok": true, "vm": vm }),
                false => json!({ "error": format!("no running VM {vm}") }),
            };
        }
        let mut reply = self.forward(vm, ToCell::Destroy { vm });
        // What the cell says of itself only decides its own end.
        let left = reply.as_object_mut().and_then(|r| r.remove("left"));
        if left.and_then(|n| n.as_u64()) == Some(0)
            && self.cells[index].dead.is_none()
            && self.growable_cell() != Some(index)
        {
            self.retire(index);
        }
        reply
    }

    /// The last cell, when it is alive and has room: the one `create` grows.
    fn growable_cell(&self) -> Option<usize> {
        let index = self.cells.len().checked_sub(1)?;
        let cell = &self.cells[index];
        (cell.dead.is_none() && cell.count < cell.capacity).then_some(index)
    }

    fn list(&mut self) -> Value {
        let by = Instant::now() + deadline::CELL_REPLY;
        let replies = self.ask(&self.live_cells(), &ToCell::List, by);
        let mut vms = Vec::new();
        for (index, reply) in &replies {
            // A cell ended while asked is listed with the dead ones below.
            if self.cells[*index].dead.is_some() {
                continue;
            }
            if let Some(list) = reply["vms"].as_array() {
                vms.extend(list.iter().cloned());
            }
        }
        vms.extend(self.dead_cells_vms(false));
        sort_by_id(&mut vms);
        json!({ "ok": true, "vms": vms })
    }

    /// The VMs of cells that died (not forgotten), as crashed entries.
    fn dead_cells_vms(&self, counters: bool) -> Vec<Value> {
        let mut vms = Vec::new();
        for cell in self.cells.iter().filter(|c| c.dead.is_some()) {
            for id in cell.remembered() {
                let mut vm = json!({
                    "id": id,
                    "addr": self.settings.addr_of(id).to_string(),
                    "state": "crashed",
                    "reason": cell.dead,
                });
                if counters {
                    for key in [
                        "requests",
                        "errors_4xx",
                        "tx_bytes",
                        "wakeups",
                        "selfcheck_errors",
                    ] {
                        vm[key] = json!(0);
                    }
                }
                vms.push(vm);
            }
        }
        vms
    }

    fn stats(&mut self, per_vm: bool) -> Result<Value, SupervisorError> {
        let by = Instant::now() + deadline::CELL_REPLY;
        let replies = self.ask(&self.live_cells(), &ToCell::Stats { per_vm }, by);
        let mut totals = Map::new();
        let mut wakes = WakeLatencies::new();
        let mut vms = Vec::new();
        for (index, reply) in replies {
            // A cell ended while asked is counted with the dead ones below.
            if self.cells[index].dead.is_some() {
                continue;
            }
            if let Some(error) = reply.get("error") {
                return Err(SupervisorError::Cell {
                    index,
                    error: quote(error.as_str().unwrap_or("failed")),
                });
            }
            if let Some(theirs) = reply["totals"].as_object() {
                add_totals(&mut totals, theirs);
                if let Some(Err(e)) = theirs.get(WAKE_US).map(|h| wakes.add_json(h)) {
                    crate::log!("densevm: cell {index}: stats: {e}; its wakes left out");
                }
            }
            if let Some(list) = reply["vms"].as_array() {
                vms.extend(list.iter().cloned());
            }
        }
        let dead: u64 = self
            .cells
            .iter()
            .filter(|c| c.dead.is_some())
            .map(|c| c.remembered().count() as u64)
            .sum();
        for key in ["vms", "crashed"] {
            let value = totals
                .get(key)
                .and_then(Value::as_u64)
                .unwrap_or(0)
                .saturating_add(dead);
            totals.insert(key.into(), json!(value));
        }
        totals.insert("cells".into(), json!(self.live_cells().len()));
        add_wake_latencies(&mut totals, &wakes);
        let mut reply = json!({ "ok": true, "totals": totals });
        if per_vm {
            vms.extend(self.dead_cells_vms(true));
            sort_by_id(&mut vms);
            reply["vms"] = Value::Array(vms);
        }
        merge_pager(
            &mut reply,
            &if per_vm {
                self.pager.stats()
            } else {
                self.pager.totals()
            },
        );
        Ok(reply)
    }

    /// VMs the live cells hold (slots taken, dead VMs of live cells included).
    fn held_vms(&self) -> u64 {
        self.cells
            .iter()
            .filter(|c| c.dead.is_none())
            .map(|c| c.count as u64)
            .sum()
    }

    /// Boots `count` more VMs: into the last cell while it has room, then
    /// into new cells. The whole create has one deadline.
    fn create(&mut self, count: u32) -> Value {
        let next_id = self.cells.last().map_or(0, |c| c.first_id + c.count);
        if self.held_vms() + count as u64 > self.max_vms as u64 {
            return json!({ "error": format!(
                "create: {} VMs would pass the maximum of {} on this host (see densevm describe)",
                self.held_vms() + count as u64, self.max_vms
            ) });
        }
        let last_addr =
            u32::from(self.settings.addr_base).checked_add(next_id.saturating_add(count - 1));
        if next_id
            .checked_add(count)
            .is_none_or(|end| end > config::MAX_VM_ID)
            || !last_addr.is_some_and(|a| std::net::Ipv4Addr::from(a).is_loopback())
        {
            return json!({ "error": format!("create: VM ids {next_id}.. would leave 127.0.0.0/8 or pass {}", config::MAX_VM_ID) });
        }
        let by = Instant::now() + deadline::CELL_CREATE;
        let mut created: Vec<u32> = Vec::new();
        let mut left = count;
        while left > 0 {
            let next_id = self.cells.last().map_or(0, |c| c.first_id + c.count);
            let (n, result) = match self.growable_cell() {
                Some(index) => {
                    let n = left.min(self.cells[index].capacity - self.cells[index].count);
                    (n, self.grow_cell(index, next_id, n, by))
                }
                None => {
                    let n = left.min(self.cell_vms);
                    (n, self.new_cell(next_id, n, by))
                }
            };
            match result {
                Ok(()) => {
                    created.extend(next_id..next_id + n);
                    left -= n;
                }
                Err((made, error)) => {
                    created.extend(next_id..next_id + made);
                    return json!({ "error": error, "created": created });
                }
            }
        }
        json!({ "ok": true, "created": created })
    }

    /// Boots VMs `first..first + count` in live cell `index`. Err: how many
    /// it made (the first ones) and why not the rest.
    fn grow_cell(
        &mut self,
        index: usize,
        first: u32,
        count: u32,
        by: Instant,
    ) -> Result<(), (u32, String)> {
        for i in 0..count {
            let (space, offset) = self.cells[index].space_of(first + i, self.ram_bytes);
            let registered = match space {
                Some(space) => self
                    .pager
                    .register_vm(first + i, space, offset, self.ram_bytes)
                    .map_err(|e| e.to_string()),
                None => Err("no RAM slot left in this cell".to_string()),
            }
            .and_then(|()| {
                let addr = *self.settings.addr_of(first + i).ip();
                self.steering.route(addr, index as u32).map_err(|e| {
                    self.pager.unregister_vm(first + i);
                    e.to_string()
                })
            });
            if let Err(e) = registered {
                for j in 0..i {
                    self.unregister_vm(first + j);
                }
                return Err((0, format!("create VM {}: {e}", first + i)));
            }
        }
        self.cells[index].count += count;
        let reply = self
            .ask(&[index], &ToCell::Create { first, count }, by)
            .pop()
            .map(|(_, r)| r)
            .unwrap_or_else(|| json!({ "error": format!("cell {index} is gone") }));
        if self.cells[index].dead.is_some() {
            // Its ids stay taken (its VMs are listed crashed) and its
            // memory went back to the pager with the cell.
            let error = reply["error"].as_str().unwrap_or("the cell is gone");
            return Err((0, format!("create: {}", quote(error))));
        }
        // The cell must say exactly which of the VMs asked for it built:
        // the first `made` of them, in order.
        let made = match reply["created"].as_array() {
            Some(ids)
                if ids.len() <= count as usize
                    && ids
                        .iter()
                        .zip(first..)
                        .all(|(id, want)| id.as_u64() == Some(want as u64)) =>
            {
                ids.len() as u32
            }
            _ => {
                self.end_cell(
                    index,
                    End::Hostile("a create reply that is not what was asked".into()),
                );
                return Err((
                    0,
                    format!("create: cell {index} answered wrongly; it was stopped"),
                ));
            }
        };
        // VMs the cell could not build are not its: release them.
        for id in first + made..first + count {
            self.unregister_vm(id);
        }
        self.cells[index].count -= count - made;
        if made < count {
            // It takes no more: its next slots may be a dead holder's, and
            // every later create would meet it again (the next one starts
            // a cell).
            self.cells[index].capacity = self.cells[index].count;
            let error = reply["error"]
                .as_str()
                .map(quote)
                .unwrap_or_else(|| format!("create: cell {index} built {made} of {count} VMs"));
            return Err((made, error));
        }
        Ok(())
    }

    /// Starts a cell for VMs `first..first + count`.
    fn new_cell(&mut self, first: u32, count: u32, by: Instant) -> Result<(), (u32, String)> {
        let index = self.cells.len() as u32;
        let cell = PendingCell::spawn(&self.settings, index, first, count, self.cell_vms).and_then(
            |pending| {
                pending.handshake(
                    &self.pager,
                    &mut self.steering,
                    self.ram_bytes,
                    self.platform,
                    Some(by),
                )
            },
        );
        match cell {
            Ok(cell) => {
                if let Err(e) = self.adopt(cell) {
                    // Not adopted: its VMs are taken down with it.
                    let index = self.cells.len() - 1;
                    self.end_cell(index, End::Hostile(format!("cannot watch its link: {e}")));
                    return Err((0, format!("create: {e}")));
                }
                // A cell answers once its event loop runs: its VMs are built and
                // listening, as those a running cell creates are when it replies.
                let index = self.cells.len() - 1;
                if let (Some(ready), Some(true)) = (
                    self.template_told,
                    self.settings.hibernation.map(|h| h.clone_boot),
                ) {
                    self.tell_template(index, ready);
                }
                match self.ask(&[index], &ToCell::List, by).pop() {
                    Some((_, reply)) if reply.get("ok").is_some() => Ok(()),
                    _ => Err((0, format!("create: cell {index} did not start"))),
                }
            }
            Err(e) => Err((0, format!("create: {e}"))),
        }
    }

    /// Asks every cell to stop its VMs and exit, waits for them, and removes
    /// the control socket.
    pub fn shutdown(&mut self) {
        let _ = std::fs::remove_file(&self.api_path);
        for cell in self.cells.iter_mut().filter(|c| c.dead.is_none()) {
            let _ = cell.send(&ToCell::Shutdown);
        }
        for cell in self.cells.iter_mut().filter(|c| c.dead.is_none()) {
            let how = cell.reap(CELL_EXIT_GRACE);
            cell.dead = Some(format!("stopped at shutdown ({how})"));
        }
    }

    /// Kills every cell at once (the run failed).
    pub fn kill_cells(&mut self) {
        for cell in self.cells.iter_mut().filter(|c| c.dead.is_none()) {
            cell.kill();
        }
    }
}

/// Writes one JSON line to stdout; a reader that went away is not an error
/// worth dying for.
pub fn emit(line: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

fn sort_by_id(vms: &mut [Value]) {
    vms.sort_by_key(|vm| vm["id"].as_u64().unwrap_or(u64::MAX));
}

/// The key of a cell's wake-latency histogram in its totals.
const WAKE_US: &str = "wake_us";

/// Adds a cell's totals to the sum: integers add up; anything else but its
/// wake-latency histogram (merged apart) is kept from the first cell that
/// has it.
fn add_totals(sum: &mut Map<String, Value>, theirs: &Map<String, Value>) {
    for (key, value) in theirs.iter().filter(|(key, _)| *key != WAKE_US) {
        match (sum.get(key).and_then(Value::as_u64), value.as_u64()) {
            (Some(a), Some(b)) => {
                sum.insert(key.clone(), json!(a.saturating_add(b)));
            }
            (None, _) if !sum.contains_key(key) => {
                sum.insert(key.clone(), value.clone());
            }
            _ => {}
        }
    }
}

/// The cells' merged wake-latency histogram and its median and 99th
/// percentile, in µs.
fn add_wake_latencies(totals: &mut Map<String, Value>, wakes: &WakeLatencies) {
    totals.insert(WAKE_US.into(), wakes.to_json());
    for (key, q) in [("wake_us_p50", 0.5), ("wake_us_p99", 0.99)] {
        totals.insert(key.into(), json!(wakes.quantile(q)));
    }
}

/// Adds the pager's figures to a stats reply: its totals (the monitor's
/// `vms`, dead VMs included, stays), each VM's counters, and its settings
/// under `pager`.
fn merge_pager(reply: &mut Value, paging: &Value) {
    if let (Some(totals), Some(ours)) = (
        paging.get("totals").and_then(|t| t.as_object()),
        reply["totals"].as_object_mut(),
    ) {
        for (key, value) in totals {
            ours.entry(key.clone()).or_insert_with(|| value.clone());
        }
    }
    if let (Some(per_vm), Some(vms)) = (
        paging.get("vms"),
        reply.get_mut("vms").and_then(|v| v.as_array_mut()),
    ) {
        for vm in vms {
            let id = vm["id"].to_string();
            if let Some(theirs) = per_vm.get(&id).and_then(|v| v.as_object()) {
                for (key, value) in theirs {
                    vm[key] = value.clone();
                }
            }
        }
    }
    reply["pager"] = paging
        .get("config")
        .cloned()
        .unwrap_or(paging["totals"].clone());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cell_totals_add_up_and_the_rest_is_kept_once() {
        let mut sum = Map::new();
        add_totals(
            &mut sum,
            json!({"requests": 5, "running": 2, "note": "a", "wake_us": [[1000, 1]]})
                .as_object()
                .unwrap(),
        );
        add_totals(
            &mut sum,
            json!({"requests": 7, "running": 1, "note": "b", "crashed": 1})
                .as_object()
                .unwrap(),
        );
        assert_eq!(
            Value::Object(sum.clone()),
            json!({"requests": 12, "running": 3, "note": "a", "crashed": 1})
        );
        let mut wakes = WakeLatencies::new();
        for us in [1_000, 1_000, 5_000] {
            wakes.record(std::time::Duration::from_micros(us));
        }
        add_wake_latencies(&mut sum, &wakes);
        assert_eq!(sum["wake_us"], wakes.to_json());
        assert_eq!(sum["wake_us_p50"], json!(wakes.quantile(0.5)));
        assert!((1_000..=1_010).contains(&sum["wake_us_p50"].as_u64().unwrap()));
        assert!((5_000..=5_050).contains(&sum["wake_us_p99"].as_u64().unwrap()));
    }

    #[test]
    fn pager_figures_join_the_reply_without_replacing_the_monitors() {
        let mut reply =
            json!({"ok": true, "totals": {"vms": 3, "requests": 9}, "vms": [{"id": 0}, {"id": 2}]});
        let paging = json!({
            "totals": {"vms": 2, "faults": 40},
            "vms": {"0": {"faults": 10}, "2": {"faults": 30}},
            "config": {"policy": "demand"},
        });
        merge_pager(&mut reply, &paging);
        assert_eq!(
            reply["totals"],
            json!({"vms": 3, "requests": 9, "faults": 40})
        );
        assert_eq!(
            reply["vms"],
            json!([{"id": 0, "faults": 10}, {"id": 2, "faults": 30}])
        );
        assert_eq!(reply["pager"], json!({"policy": "demand"}));
    }
}
