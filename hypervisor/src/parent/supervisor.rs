//! The parent process's event loop: the control API, the links to the
//! cells, signals, and the pager that all cells share.
//!
//! A control request is answered by asking the cells that hold the VMs it
//! names (all of them for `stats` and `list`) and merging their replies with
//! the pager's figures, so a client sees one monitor. A cell that dies takes
//! only its own VMs down: they are reported crashed with the reason, and
//! their budget and swap go back to the pager.

use crate::config::CellSettings;
use crate::link::framing::{FrameError, LineStream, More};
use crate::link::protocol::{FromCell, ToCell};
use crate::parent::api::{self, Request};
use crate::parent::cell_handle::{Cell, PendingCell};
use mio::net::{UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token};
use paging_policy::trace::TraceWriter;
use paging_policy::Pager;
use serde_json::{json, Map, Value};
use slab::Slab;
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
/// Requests of one client handled per turn of the event loop: a client that
/// pipelines requests faster than they are answered waits for the next turn,
/// so the other clients, the cells and the signals are served in between.
const API_REQUESTS_PER_TURN: usize = 32;
/// Replies a client may leave unread before it is disconnected (a full
/// stats reply of 10,000 VMs is ~3 MB).
const MAX_API_UNSENT: usize = 64 << 20;
/// Longest a cell may take to answer a request before it is reported as not
/// answering.
const CELL_REPLY_TIMEOUT: Duration = Duration::from_secs(30);
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
    /// A cell failed, or answered a request with an error (its message).
    #[error("cell {index}: {error}")]
    Cell {
        /// The cell's index.
        index: usize,
        /// What it said.
        error: String,
    },
    /// A new cell's link could not join the event loop.
    #[error("create: {0}")]
    Adopt(io::Error),
}

/// Parameters of [`Supervisor::new`].
pub struct SupervisorSetup {
    /// What every cell runs with (new cells are started with it).
    pub settings: CellSettings,
    /// Most VMs a cell holds (`--cell-vms` resolved).
    pub cell_vms: u32,
    /// The cells, handed over and booting.
    pub cells: Vec<Cell>,
    /// The pager every cell's memory is attached to.
    pub pager: Arc<Pager>,
    /// RAM of one VM.
    pub ram_bytes: usize,
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
    cells: Vec<Cell>,
    pager: Arc<Pager>,
    ram_bytes: usize,
    api: UnixListener,
    api_path: PathBuf,
    clients: Slab<LineStream<UnixStream>>,
    /// Clients that had more requests than one turn handles.
    clients_with_more: Vec<usize>,
    signals: signal_hook_mio::v1_0::Signals,
    boot_started: Instant,
    ready_line: Option<Value>,
    trace: Option<TraceWriter>,
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
            cells: Vec::new(),
            pager: setup.pager,
            ram_bytes: setup.ram_bytes,
            api,
            api_path: setup.api_path,
            clients: Slab::new(),
            clients_with_more: Vec::new(),
            signals,
            boot_started: setup.boot_started,
            ready_line: Some(setup.ready_line),
            trace: setup.trace,
        };
        for cell in setup.cells {
            supervisor.adopt(cell)?;
        }
        Ok(supervisor)
    }

    fn adopt(&mut self, mut cell: Cell) -> io::Result<()> {
        let index = self.cells.len();
        self.poll.registry().register(
            &mut cell.link.stream,
            token(KIND_CELL, index),
            Interest::READABLE,
        )?;
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
            self.check_boot();
            let timeout = if !self.clients_with_more.is_empty() {
                Duration::ZERO
            } else if self.ready_line.is_some() {
                Duration::from_millis(20)
            } else {
                Duration::from_millis(250)
            };
            crate::link::framing::nonblocking(|| self.poll.poll(&mut events, Some(timeout)))
                .map_err(SupervisorError::Poll)?;
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
                            KIND_API_CLIENT => self.client_ready(index),
                            KIND_CELL => self.cell_ready(index)?,
                            _ => {}
                        }
                    }
                }
            }
            for key in std::mem::take(&mut self.clients_with_more) {
                self.client_ready(key);
            }
        }
    }

    fn check_boot(&mut self) {
        if self.ready_line.is_none()
            || self
                .cells
                .iter()
                .any(|c| c.booted.is_none() && c.dead.is_none())
        {
            return;
        }
        let mut line = self.ready_line.take().expect("checked above");
        let (mut ready, mut failed) = (0, 0);
        for cell in &self.cells {
            match (cell.booted, &cell.dead) {
                (Some((r, f)), None) => (ready, failed) = (ready + r, failed + f),
                _ => failed += cell.count,
            }
        }
        line["event"] = json!("ready");
        line["vms"] = json!(ready);
        line["failed"] = json!(failed);
        line["boot_seconds"] = json!(self.boot_started.elapsed().as_secs_f64());
        emit(&line);
    }

    // ---- cells ----

    fn cell_ready(&mut self, index: usize) -> Result<(), SupervisorError> {
        let mut lines = Vec::new();
        let result = self.cells[index].link.read_lines(&mut lines);
        for line in lines {
            self.cell_message(index, &line)?;
        }
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                self.cell_died(index, &e);
                Ok(())
            }
        }
    }

    /// Handles an event from a cell; returns a reply if the line was one.
    fn cell_message(
        &mut self,
        index: usize,
        line: &[u8],
    ) -> Result<Option<Value>, SupervisorError> {
        let message = match serde_json::from_slice::<FromCell>(line) {
            Ok(message) => message,
            Err(e) => {
                eprintln!("densevm: cell {index}: bad message: {e}");
                return Ok(None);
            }
        };
        match message {
            FromCell::Booted { ready, failed } => self.cells[index].booted = Some((ready, failed)),
            FromCell::Access { counts } => self.note_access(index, &counts),
            FromCell::Stopped { vm } if self.cells[index].holds(vm) => self.pager.unregister_vm(vm),
            FromCell::Stopped { vm } => {
                eprintln!("densevm: cell {index}: reported VM {vm}, which it does not hold")
            }
            FromCell::Reply { reply } => return Ok(Some(reply)),
            FromCell::Failed { error } => return Err(SupervisorError::Cell { index, error }),
        }
        Ok(None)
    }

    fn note_access(&mut self, index: usize, counts: &[(u32, u64)]) {
        for &(vm, requests) in counts {
            if !self.cells[index].holds(vm) {
                continue;
            }
            self.pager.note_access(vm);
            if let Some(writer) = self.trace.as_mut() {
                let recorded =
                    (0..requests.min(MAX_TRACED_PER_REPORT)).try_for_each(|_| writer.record(vm));
                if let Err(e) = recorded {
                    eprintln!("densevm: error: trace: {e}; recording stops");
                    self.trace = None;
                }
            }
        }
    }

    /// A cell's link closed or broke: the cell is gone, and so are its VMs.
    fn cell_died(&mut self, index: usize, cause: &FrameError) {
        let cell = &mut self.cells[index];
        if cell.dead.is_some() {
            return;
        }
        let _ = self.poll.registry().deregister(&mut cell.link.stream);
        let how = cell.reap(Duration::from_secs(2));
        // A process that dies with bytes unread on its socket resets the link.
        let reason = match cause {
            FrameError::Closed => format!("cell {} (pid {}) {how}", cell.index, cell.pid),
            FrameError::Io(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                format!("cell {} (pid {}) {how}", cell.index, cell.pid)
            }
            other => format!(
                "cell {} (pid {}): link failed ({other}); {how}",
                cell.index, cell.pid
            ),
        };
        eprintln!(
            "densevm: {reason}: its VMs {}..{} are down",
            cell.first_id,
            cell.first_id + cell.count.saturating_sub(1)
        );
        for space in std::mem::take(&mut cell.spaces) {
            self.pager.detach_space(space);
        }
        cell.dead = Some(reason);
    }

    /// Sends `request` to each cell in `targets`, then collects their
    /// replies, handling their events meanwhile. A cell that dies or does
    /// not answer in time gets an error in its place.
    fn ask(
        &mut self,
        targets: &[usize],
        request: &ToCell,
    ) -> Result<Vec<(usize, Value)>, SupervisorError> {
        let mut sent = Vec::new();
        for &index in targets {
            if self.cells[index].dead.is_some() {
                continue;
            }
            match self.cells[index].send(request) {
                Ok(()) => sent.push(index),
                Err(e) => self.cell_died(index, &e),
            }
        }
        let mut replies = Vec::with_capacity(sent.len());
        for index in sent {
            let reply = self.await_reply(index)?;
            replies.push((index, reply));
        }
        Ok(replies)
    }

    fn await_reply(&mut self, index: usize) -> Result<Value, SupervisorError> {
        let deadline = Instant::now() + CELL_REPLY_TIMEOUT;
        let mut pending: Vec<Vec<u8>> = Vec::new();
        loop {
            while !pending.is_empty() {
                let line = pending.remove(0);
                if let Some(reply) = self.cell_message(index, &line)? {
                    // Events after the reply are handled now, in order.
                    for rest in pending.drain(..) {
                        self.cell_message(index, &rest)?;
                    }
                    return Ok(reply);
                }
            }
            let cell = &mut self.cells[index];
            let flushed = cell.link.flush();
            if let Err(e) = cell
                .link
                .read_lines(&mut pending)
                .and(flushed.map(drop).map_err(FrameError::from))
            {
                for line in std::mem::take(&mut pending) {
                    if let Some(reply) = self.cell_message(index, &line)? {
                        self.cell_died(index, &e);
                        return Ok(reply);
                    }
                }
                self.cell_died(index, &e);
                return Ok(json!({ "error": format!("cell {index} is gone") }));
            }
            if !pending.is_empty() {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(
                    json!({ "error": format!("cell {index} did not answer within {} s", CELL_REPLY_TIMEOUT.as_secs()) }),
                );
            }
            let events = if self.cells[index].link.unsent() > 0 {
                libc::POLLIN | libc::POLLOUT
            } else {
                libc::POLLIN
            };
            let mut fds = [libc::pollfd {
                fd: self.cells[index].link.stream.as_raw_fd(),
                events,
                revents: 0,
            }];
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(fds.as_mut_ptr(), 1, left.as_millis().min(1000) as i32) };
        }
    }

    // ---- control API ----

    fn accept_clients(&mut self) {
        loop {
            match crate::link::framing::nonblocking(|| self.api.accept()) {
                Ok(Some((mut stream, _))) => {
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
                        entry.insert(LineStream::new(stream, MAX_API_LINE));
                    }
                }
                Ok(None) | Err(_) => return,
            }
        }
    }

    fn client_ready(&mut self, key: usize) {
        let Some(client) = self.clients.get_mut(key) else {
            return;
        };
        let mut lines = Vec::new();
        let read = client.read_lines_upto(&mut lines, API_REQUESTS_PER_TURN);
        let mut replies = Vec::with_capacity(lines.len() + 1);
        for line in lines {
            let reply = match api::parse(&line) {
                Ok(request) => self.handle(request),
                Err(error) => json!({ "error": error.to_string() }),
            };
            replies.push(reply);
        }
        let closing = match read {
            Ok(More::No) => false,
            Ok(More::Lines) => {
                if !self.clients_with_more.contains(&key) {
                    self.clients_with_more.push(key);
                }
                false
            }
            Err(FrameError::TooLong(limit)) => {
                replies.push(json!({ "error": format!("request longer than {limit} bytes") }));
                true
            }
            Err(_) => true,
        };
        let Some(client) = self.clients.get_mut(key) else {
            return;
        };
        for reply in replies {
            client.queue(reply.to_string().as_bytes());
        }
        let flushed = client.flush();
        // A client that never reads its replies is not allowed to grow them without bound.
        if closing || flushed.is_err() || client.unsent() > MAX_API_UNSENT {
            let mut client = self.clients.remove(key);
            let _ = client.flush();
            let _ = self.poll.registry().deregister(&mut client.stream);
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

    fn handle(&mut self, request: Request) -> Value {
        let result = match request {
            Request::Stats { per_vm } => self.stats(per_vm),
            Request::List => self.list(),
            Request::Create { count } => self.create(count),
            Request::Destroy { vm } => self.forward(vm, ToCell::Destroy { vm }),
            Request::Crash { vm, triple } => self.forward(vm, ToCell::Crash { vm, triple }),
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

    fn forward(&mut self, vm: u32, request: ToCell) -> Result<Value, SupervisorError> {
        let Some(index) = self.cell_of(vm).filter(|&i| self.cells[i].dead.is_none()) else {
            return Ok(json!({ "error": format!("no running VM {vm}") }));
        };
        Ok(self.ask(&[index], &request)?.pop().map_or_else(
            || json!({ "error": format!("no running VM {vm}") }),
            |(_, r)| r,
        ))
    }

    fn list(&mut self) -> Result<Value, SupervisorError> {
        let replies = self.ask(&self.live_cells(), &ToCell::List)?;
        let mut vms = Vec::new();
        for (_, reply) in &replies {
            if let Some(list) = reply["vms"].as_array() {
                vms.extend(list.iter().cloned());
            }
        }
        vms.extend(self.dead_cells_vms(false));
        sort_by_id(&mut vms);
        Ok(json!({ "ok": true, "vms": vms }))
    }

    /// The VMs of cells that died, as crashed entries.
    fn dead_cells_vms(&self, counters: bool) -> Vec<Value> {
        let mut vms = Vec::new();
        for cell in self.cells.iter().filter(|c| c.dead.is_some()) {
            for id in cell.first_id..cell.first_id + cell.count {
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
        let replies = self.ask(&self.live_cells(), &ToCell::Stats { per_vm })?;
        let mut totals = Map::new();
        let mut vms = Vec::new();
        for (index, reply) in replies {
            if let Some(error) = reply.get("error") {
                return Err(SupervisorError::Cell {
                    index,
                    error: error.as_str().unwrap_or("failed").to_string(),
                });
            }
            if let Some(theirs) = reply["totals"].as_object() {
                add_totals(&mut totals, theirs);
            }
            if let Some(list) = reply["vms"].as_array() {
                vms.extend(list.iter().cloned());
            }
        }
        let dead: u64 = self
            .cells
            .iter()
            .filter(|c| c.dead.is_some())
            .map(|c| c.count as u64)
            .sum();
        for key in ["vms", "crashed"] {
            let value = totals.get(key).and_then(Value::as_u64).unwrap_or(0) + dead;
            totals.insert(key.into(), json!(value));
        }
        totals.insert("cells".into(), json!(self.live_cells().len()));
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

    /// Boots `count` more VMs: into the last cell while it has room, then
    /// into new cells.
    fn create(&mut self, count: u32) -> Result<Value, SupervisorError> {
        let mut created = Vec::new();
        let mut left = count;
        while left > 0 {
            let next_id = self.cells.last().map_or(0, |c| c.first_id + c.count);
            let last = self.cells.len().checked_sub(1).filter(|&i| {
                self.cells[i].dead.is_none() && self.cells[i].count < self.cells[i].capacity
            });
            let reply = match last {
                Some(index) => {
                    let n = left.min(self.cells[index].capacity - self.cells[index].count);
                    self.grow_cell(index, next_id, n)?
                }
                None => {
                    let n = left.min(self.cell_vms);
                    self.new_cell(next_id, n)?
                }
            };
            if let Some(ids) = reply["created"].as_array() {
                created.extend(ids.iter().cloned());
            }
            if reply.get("error").is_some() {
                let mut reply = reply;
                reply["created"] = json!(created);
                return Ok(reply);
            }
            left -= reply["created"]
                .as_array()
                .map_or(0, |ids| ids.len() as u32);
        }
        Ok(json!({ "ok": true, "created": created }))
    }

    fn grow_cell(
        &mut self,
        index: usize,
        first: u32,
        count: u32,
    ) -> Result<Value, SupervisorError> {
        for i in 0..count {
            let (space, offset) = self.cells[index].space_of(first + i, self.ram_bytes);
            let registered = match space {
                Some(space) => self
                    .pager
                    .register_vm(first + i, space, offset, self.ram_bytes)
                    .map_err(|e| e.to_string()),
                None => Err("no RAM slot left in this cell".to_string()),
            };
            if let Err(e) = registered {
                for j in 0..i {
                    self.pager.unregister_vm(first + j);
                }
                return Ok(json!({ "error": format!("create VM {}: {e}", first + i) }));
            }
        }
        self.cells[index].count += count;
        let reply = self
            .ask(&[index], &ToCell::Create { first, count })?
            .pop()
            .map(|(_, r)| r);
        let reply = reply.unwrap_or_else(|| json!({ "error": format!("cell {index} is gone") }));
        let made = reply["created"]
            .as_array()
            .map_or(0, |ids| ids.len() as u32);
        // VMs the cell could not build are not its: release them.
        for id in first + made..first + count {
            self.pager.unregister_vm(id);
        }
        self.cells[index].count -= count - made;
        Ok(reply)
    }

    fn new_cell(&mut self, first: u32, count: u32) -> Result<Value, SupervisorError> {
        let index = self.cells.len() as u32;
        let cell = PendingCell::spawn(&self.settings, index, first, count, self.cell_vms)
            .and_then(|pending| pending.handshake(&self.pager, self.ram_bytes));
        match cell {
            Ok(cell) => {
                self.adopt(cell).map_err(SupervisorError::Adopt)?;
                // A cell answers once its event loop runs: its VMs are built and
                // listening, as those a running cell creates are when it replies.
                let index = self.cells.len() - 1;
                match self.ask(&[index], &ToCell::List)?.pop() {
                    Some((_, reply)) if reply.get("ok").is_some() => Ok(
                        json!({ "ok": true, "created": (first..first + count).collect::<Vec<_>>() }),
                    ),
                    _ => Ok(json!({ "error": format!("create: cell {index} did not start") })),
                }
            }
            Err(e) => Ok(json!({ "error": format!("create: {e}") })),
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

/// Adds a cell's totals to the sum: integers add up; anything else is kept
/// from the first cell that has it.
fn add_totals(sum: &mut Map<String, Value>, theirs: &Map<String, Value>) {
    for (key, value) in theirs {
        match (sum.get(key).and_then(Value::as_u64), value.as_u64()) {
            (Some(a), Some(b)) => {
                sum.insert(key.clone(), json!(a + b));
            }
            (None, _) if !sum.contains_key(key) => {
                sum.insert(key.clone(), value.clone());
            }
            _ => {}
        }
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
            json!({"requests": 5, "running": 2, "note": "a"})
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
            Value::Object(sum),
            json!({"requests": 12, "running": 3, "note": "a", "crashed": 1})
        );
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
