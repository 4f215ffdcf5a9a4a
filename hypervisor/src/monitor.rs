//! The monitor's event loop: VM listeners and connections on one side, the
//! VMs' rings on the other, plus the control API and signals.
//!
//! One thread does all host-side I/O. Guests notify it through doorbell
//! eventfds (shared by groups of VMs to stay within the fd limit); it
//! notifies guests through their irqfds, only when a guest is idle.

use crate::abi;
use crate::api::{self, Request};
use crate::devices::stream::TxRecord;
use crate::stats;
use crate::vm::{self, BuildContext, MicroVm, DOORBELL_GROUP};
use crate::vstate::vcpu::RunState;
use mio::net::{TcpStream, UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token, Waker};
use serde_json::{json, Value};
use slab::Slab;
use std::io::{self, ErrorKind, Read, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

const API: Token = Token(0);
const SIGNALS: Token = Token(1);
const WAKER: Token = Token(2);
const KIND_SHIFT: usize = 28;
const KIND_API_CLIENT: usize = 1;
const KIND_LISTENER: usize = 2;
const KIND_DOORBELL: usize = 3;
const KIND_CONN: usize = 4;
const READ_CHUNK: u32 = 64 << 10;
/// Longest control request accepted.
const MAX_API_LINE: usize = 64 << 10;
/// Threads that destroy VMs at shutdown.
const TEARDOWN_THREADS: usize = 16;

fn token(kind: usize, index: usize) -> Token {
    Token((kind << KIND_SHIFT) | index)
}

/// A VM's entry in the monitor: alive, or what is left of a dead one.
pub enum VmEntry {
    /// Booted and serving (or booting).
    Live(Box<MicroVm>),
    /// Its guest died or it was destroyed; kept for the stats.
    Dead(DeadVm),
}

/// Adds another component's figures to a stats reply (true: with its per-VM figures).
pub type StatsHook = Box<dyn Fn(&mut Value, bool)>;

/// What the stats report about a VM that no longer runs.
#[derive(Debug, Clone)]
pub struct DeadVm {
    /// Index.
    pub id: u32,
    /// Address it listened on.
    pub addr: std::net::SocketAddrV4,
    /// "crashed" or "stopped".
    pub state: &'static str,
    /// Why.
    pub reason: String,
    /// Its last control page.
    pub ctrl: abi::Ctrl,
}

struct Conn {
    vm: u32,
    slot: Option<usize>,
    stream: TcpStream,
    out: Vec<u8>,
    out_start: usize,
    /// FIN (EOF or error) has reached the guest.
    fin_sent: bool,
    /// The socket failed: output is discarded.
    broken: bool,
    /// The guest released the slot: close once the output is flushed.
    guest_closed: bool,
}

impl Conn {
    fn buffered(&self) -> usize {
        self.out.len() - self.out_start
    }
}

struct ApiClient {
    stream: UnixStream,
    input: Vec<u8>,
    output: Vec<u8>,
}

/// Why the event loop ended.
#[derive(Debug)]
pub enum Exit {
    /// SIGINT or SIGTERM.
    Signal(i32),
}

/// The monitor: every VM, every connection, the control API.
pub struct Monitor {
    poll: Poll,
    ctx: BuildContext,
    doorbells: Vec<EventFd>,
    vms: Vec<VmEntry>,
    conns: Slab<Conn>,
    api: UnixListener,
    api_path: PathBuf,
    api_clients: Slab<ApiClient>,
    signals: signal_hook_mio::v1_0::Signals,
    crashed: Arc<Mutex<Vec<u32>>>,
    boot_started: Instant,
    boot_reported: bool,
    boot_timeout: Duration,
    ready_line: Value,
    /// Called for every request the guests served: (vm, new requests).
    on_requests: Option<Box<dyn FnMut(u32, u64)>>,
    /// Fatal error raised by a component (the pager) that must end the run.
    fatal: Option<Box<dyn Fn() -> Option<String>>>,
    extra_stats: Option<StatsHook>,
    /// Charges or suspends the pager's disk model (`disk` requests).
    disk_control: Option<Box<dyn Fn(bool)>>,
    seen_requests: Vec<u64>,
}

/// Parameters of [`Monitor::new`].
pub struct MonitorSetup {
    /// Shared build context.
    pub ctx: BuildContext,
    /// Doorbell eventfds, one per group of [`DOORBELL_GROUP`] VMs.
    pub doorbells: Vec<EventFd>,
    /// The VMs, already built and running.
    pub vms: Vec<MicroVm>,
    /// Bound control socket.
    pub api: std::os::unix::net::UnixListener,
    /// Its path (removed at exit).
    pub api_path: PathBuf,
    /// Queue the vCPU threads push dead VMs onto.
    pub crashed: Arc<Mutex<Vec<u32>>>,
    /// When the boot started.
    pub boot_started: Instant,
    /// Give up when the VMs are not up by then.
    pub boot_timeout: Duration,
    /// Fields added to the ready line.
    pub ready_line: Value,
}

impl Monitor {
    /// Registers every VM, listener and doorbell; returns the monitor and the
    /// waker the vCPU threads use.
    pub fn new(setup: MonitorSetup) -> io::Result<(Self, Arc<Waker>)> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let mut api = UnixListener::from_std(setup.api);
        poll.registry().register(&mut api, API, Interest::READABLE)?;
        let mut signals = signal_hook_mio::v1_0::Signals::new([libc::SIGINT, libc::SIGTERM])?;
        poll.registry().register(&mut signals, SIGNALS, Interest::READABLE)?;
        for (group, evt) in setup.doorbells.iter().enumerate() {
            poll.registry().register(&mut mio::unix::SourceFd(&std::os::fd::AsRawFd::as_raw_fd(evt)), token(KIND_DOORBELL, group), Interest::READABLE)?;
        }
        let mut monitor = Monitor {
            poll,
            ctx: setup.ctx,
            doorbells: setup.doorbells,
            vms: Vec::new(),
            conns: Slab::new(),
            api,
            api_path: setup.api_path,
            api_clients: Slab::new(),
            signals,
            crashed: setup.crashed,
            boot_started: setup.boot_started,
            boot_reported: false,
            boot_timeout: setup.boot_timeout,
            ready_line: setup.ready_line,
            on_requests: None,
            fatal: None,
            extra_stats: None,
            disk_control: None,
            seen_requests: Vec::new(),
        };
        for vm in setup.vms {
            monitor.adopt(vm)?;
        }
        Ok((monitor, waker))
    }

    /// Receives (vm, new requests) whenever guests report served requests.
    pub fn on_requests(&mut self, f: Box<dyn FnMut(u32, u64)>) {
        self.on_requests = Some(f);
    }

    /// Polled every loop turn: a `Some` ends the run with that error.
    pub fn fatal_check(&mut self, f: Box<dyn Fn() -> Option<String>>) {
        self.fatal = Some(f);
    }

    /// Serves `disk` requests: charge (true) or suspend (false) the disk model.
    pub fn disk_control(&mut self, f: Box<dyn Fn(bool)>) {
        self.disk_control = Some(f);
    }

    /// Adds fields to the stats reply (pager stats).
    pub fn extra_stats(&mut self, f: StatsHook) {
        self.extra_stats = Some(f);
    }

    fn adopt(&mut self, mut vm: MicroVm) -> io::Result<()> {
        let id = vm.id as usize;
        self.poll.registry().register(&mut vm.listener, token(KIND_LISTENER, id), Interest::READABLE)?;
        if id >= self.vms.len() {
            self.seen_requests.resize(id + 1, 0);
        }
        let entry = VmEntry::Live(Box::new(vm));
        if id < self.vms.len() {
            self.vms[id] = entry;
        } else {
            self.vms.push(entry);
        }
        Ok(())
    }

    fn live(&mut self, id: usize) -> Option<&mut MicroVm> {
        match self.vms.get_mut(id) {
            Some(VmEntry::Live(vm)) => Some(vm),
            _ => None,
        }
    }

    /// Runs until a signal; the ready line is printed once every VM is up.
    pub fn run(&mut self) -> Result<Exit, String> {
        let mut events = Events::with_capacity(1024);
        for id in 0..self.vms.len() {
            self.service_vm(id);
        }
        loop {
            self.check_boot()?;
            if let Some(error) = self.fatal.as_ref().and_then(|f| f()) {
                return Err(error);
            }
            let timeout = if self.boot_reported { Duration::from_millis(500) } else { Duration::from_millis(50) };
            if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(format!("event loop: {e}"));
            }
            for event in events.iter() {
                let Token(t) = event.token();
                match event.token() {
                    API => self.accept_api(),
                    SIGNALS => {
                        if let Some(signal) = self.signals.pending().next() {
                            return Ok(Exit::Signal(signal));
                        }
                    }
                    WAKER => self.reap_crashed(),
                    _ => {
                        let index = t & ((1 << KIND_SHIFT) - 1);
                        match t >> KIND_SHIFT {
                            KIND_API_CLIENT => self.api_client_ready(index),
                            KIND_LISTENER => self.accept(index),
                            KIND_DOORBELL => self.doorbell(index),
                            KIND_CONN => self.conn_ready(index, event.is_readable(), event.is_writable()),
                            _ => {}
                        }
                    }
                }
            }
        }
    }

    fn check_boot(&mut self) -> Result<(), String> {
        if self.boot_reported {
            return Ok(());
        }
        let mut ready = 0;
        let mut dead = 0;
        for entry in &self.vms {
            match entry {
                VmEntry::Live(vm) if vm.ready => ready += 1,
                VmEntry::Live(_) => {}
                VmEntry::Dead(_) => dead += 1,
            }
        }
        if ready + dead == self.vms.len() {
            self.boot_reported = true;
            let mut line = self.ready_line.clone();
            line["event"] = json!("ready");
            line["vms"] = json!(ready);
            line["failed"] = json!(dead);
            line["boot_seconds"] = json!(self.boot_started.elapsed().as_secs_f64());
            println!("{line}");
            return Ok(());
        }
        if self.boot_started.elapsed() > self.boot_timeout {
            return Err(format!(
                "only {ready} of {} VMs came up within {:.0} s",
                self.vms.len(),
                self.boot_timeout.as_secs_f64()
            ));
        }
        Ok(())
    }

    // ---- guests ----

    fn doorbell(&mut self, group: usize) {
        let Some(evt) = self.doorbells.get(group) else { return };
        let _ = evt.read();
        let first = group * DOORBELL_GROUP as usize;
        let last = (first + DOORBELL_GROUP as usize).min(self.vms.len());
        for id in first..last {
            self.service_vm(id);
        }
    }

    /// Takes in what the guest produced, feeds it what it can now accept,
    /// and kicks it if it is idle.
    fn service_vm(&mut self, id: usize) {
        let Some(vm) = self.live(id) else { return };
        let ctrl = vm.ctrl();
        if ctrl.state == abi::STATE_READY {
            vm.ready = true;
        }
        let served = ctrl.requests;
        let new_requests = served.saturating_sub(self.seen_requests[id]);
        if new_requests > 0 {
            self.seen_requests[id] = served;
            if let Some(f) = self.on_requests.as_mut() {
                f(id as u32, new_requests);
            }
        }
        if let Err(violation) = self.drain_tx(id) {
            self.kill_vm(id, "crashed", violation);
            return;
        }
        self.retry_waiting(id);
        self.kick(id);
    }

    fn drain_tx(&mut self, id: usize) -> Result<(), String> {
        loop {
            let Some(vm) = self.live(id) else { return Ok(()) };
            let Some(record) = vm.stream.tx_peek(&vm.sys).map_err(|e| e.to_string())? else { return Ok(()) };
            match record {
                TxRecord::Data { slot, offset, len } => {
                    let conn_key = vm.slots[slot];
                    // SAFETY: tx_peek checked the payload lies in the tx ring.
                    let payload = unsafe { std::slice::from_raw_parts(vm.sys.at(offset), len as usize) };
                    if let Some(conn) = conn_key.and_then(|k| self.conns.get_mut(k)) {
                        send(conn, payload);
                    }
                    let Some(vm) = self.live(id) else { return Ok(()) };
                    vm.stream.tx_consume(&vm.sys, &record);
                    let buffered = conn_key.and_then(|k| self.conns.get(k)).map_or(0, Conn::buffered);
                    let Some(vm) = self.live(id) else { return Ok(()) };
                    vm.stream.ack(&vm.sys, slot, buffered);
                }
                TxRecord::Close { slot } => {
                    vm.stream.tx_consume(&vm.sys, &record);
                    vm.stream.ack(&vm.sys, slot, 0);
                    let conn_key = vm.slots[slot].take();
                    if let Some(key) = conn_key {
                        vm.waiting.retain(|k| *k != key);
                        if let Some(conn) = self.conns.get_mut(key) {
                            conn.slot = None;
                            conn.guest_closed = true;
                        }
                        self.finish_if_done(key);
                    }
                }
            }
        }
    }

    fn kick(&mut self, id: usize) {
        let Some(vm) = self.live(id) else { return };
        if vm.stream.take_kick(&vm.sys) {
            let _ = vm.irq.write(1);
        }
    }

    fn retry_waiting(&mut self, id: usize) {
        let Some(vm) = self.live(id) else { return };
        let waiting = std::mem::take(&mut vm.waiting);
        let paused = std::mem::replace(&mut vm.accept_paused, false);
        for key in waiting {
            self.pump_rx(key);
        }
        if paused {
            self.accept(id);
        }
    }

    fn reap_crashed(&mut self) {
        let ids: Vec<u32> = std::mem::take(&mut *self.crashed.lock().expect("crash queue"));
        for id in ids {
            let reason = match self.live(id as usize) {
                Some(vm) => vm.stop_reason().unwrap_or_default(),
                None => continue,
            };
            self.kill_vm(id as usize, "crashed", reason);
        }
    }

    /// Stops a VM, closes its listener and connections, and keeps a record.
    fn kill_vm(&mut self, id: usize, state: &'static str, reason: String) {
        if !matches!(self.vms.get(id), Some(VmEntry::Live(_))) {
            return;
        }
        let VmEntry::Live(mut vm) = std::mem::replace(&mut self.vms[id], VmEntry::Dead(placeholder(id))) else {
            unreachable!("checked above")
        };
        vm.vcpu.stop();
        let _ = self.poll.registry().deregister(&mut vm.listener);
        for key in vm.slots.iter().flatten().copied().collect::<Vec<_>>() {
            self.close_conn(key);
        }
        (self.ctx.unregister_ram)(vm.id);
        let dead = DeadVm { id: vm.id, addr: vm.addr, state, reason, ctrl: vm.ctrl() };
        if state == "crashed" {
            eprintln!("densevm: VM {} ({}) stopped: {}", dead.id, dead.addr, dead.reason);
        }
        self.vms[id] = VmEntry::Dead(dead);
    }

    // ---- connections ----

    fn accept(&mut self, id: usize) {
        loop {
            let Some(vm) = self.live(id) else { return };
            let Some(slot) = vm.slots.iter().position(Option::is_none) else {
                vm.accept_paused = true;
                return;
            };
            // An OPEN record must fit before a connection is taken.
            if vm.stream.rx_reserve(&vm.sys, 0).is_none() {
                vm.accept_paused = true;
                return;
            }
            let (mut stream, _) = match vm.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: stop accepting until something closes.
                    eprintln!("densevm: VM {id}: accept: {e}");
                    vm.accept_paused = true;
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            let entry = self.conns.vacant_entry();
            let key = entry.key();
            if self.poll.registry().register(&mut stream, token(KIND_CONN, key), Interest::READABLE | Interest::WRITABLE).is_err() {
                continue;
            }
            entry.insert(Conn { vm: id as u32, slot: Some(slot), stream, out: Vec::new(), out_start: 0, fin_sent: false, broken: false, guest_closed: false });
            let Some(vm) = self.live(id) else { return };
            vm.slots[slot] = Some(key);
            vm.stream.rx_control(&vm.sys, slot, abi::REC_OPEN);
            self.pump_rx(key);
            self.kick(id);
        }
    }

    fn conn_ready(&mut self, key: usize, readable: bool, writable: bool) {
        if writable {
            self.flush(key);
        }
        if readable {
            self.pump_rx(key);
        }
        if let Some(id) = self.conns.get(key).map(|c| c.vm as usize) {
            self.kick(id);
        }
    }

    /// Moves socket bytes into the rx ring as far as credit and room allow.
    fn pump_rx(&mut self, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else { return };
        let (Some(slot), false) = (conn.slot, conn.fin_sent) else { return };
        let id = conn.vm as usize;
        let Some(VmEntry::Live(vm)) = self.vms.get_mut(id) else { return };
        loop {
            let credit = vm.stream.rx_credit(&vm.sys, slot).min(READ_CHUNK);
            let Some(space) = (credit > 0).then(|| vm.stream.rx_reserve(&vm.sys, credit)).flatten() else {
                if !vm.waiting.contains(&key) {
                    vm.waiting.push(key);
                }
                return;
            };
            // SAFETY: the space is filled before the record is committed.
            match conn.stream.read(unsafe { space.as_mut_slice() }) {
                Ok(0) => break,
                Ok(n) => vm.stream.rx_commit(&vm.sys, slot, abi::REC_DATA, n as u32),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    conn.broken = true;
                    conn.out.clear();
                    conn.out_start = 0;
                    break;
                }
            }
        }
        // EOF or error: tell the guest; it answers what it has and releases the slot.
        if vm.stream.rx_control(&vm.sys, slot, abi::REC_FIN) {
            conn.fin_sent = true;
        } else if !vm.waiting.contains(&key) {
            vm.waiting.push(key);
        }
    }

    fn flush(&mut self, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else { return };
        if conn.buffered() > 0 && !conn.broken {
            loop {
                match conn.stream.write(&conn.out[conn.out_start..]) {
                    Ok(n) => {
                        conn.out_start += n;
                        if conn.buffered() == 0 {
                            conn.out.clear();
                            conn.out_start = 0;
                            break;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        conn.broken = true;
                        break;
                    }
                }
            }
        }
        if conn.broken {
            conn.out.clear();
            conn.out_start = 0;
        }
        if let (Some(slot), id) = (conn.slot, conn.vm as usize) {
            let buffered = conn.buffered();
            if let Some(vm) = self.live(id) {
                vm.stream.ack(&vm.sys, slot, buffered);
            }
        }
        self.finish_if_done(key);
    }

    /// Closes a connection the guest released once its output is out.
    fn finish_if_done(&mut self, key: usize) {
        let Some(conn) = self.conns.get(key) else { return };
        if conn.guest_closed && (conn.buffered() == 0 || conn.broken) {
            self.close_conn(key);
        }
    }

    fn close_conn(&mut self, key: usize) {
        if !self.conns.contains(key) {
            return;
        }
        let mut conn = self.conns.remove(key);
        let _ = self.poll.registry().deregister(&mut conn.stream);
        let _ = conn.stream.shutdown(std::net::Shutdown::Write);
        if let Some(slot) = conn.slot {
            if let Some(vm) = self.live(conn.vm as usize) {
                vm.slots[slot] = None;
            }
        }
    }

    // ---- control API ----

    fn accept_api(&mut self) {
        loop {
            match self.api.accept() {
                Ok((mut stream, _)) => {
                    let entry = self.api_clients.vacant_entry();
                    if self.poll.registry().register(&mut stream, token(KIND_API_CLIENT, entry.key()), Interest::READABLE | Interest::WRITABLE).is_ok() {
                        entry.insert(ApiClient { stream, input: Vec::new(), output: Vec::new() });
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return,
            }
        }
    }

    fn api_client_ready(&mut self, key: usize) {
        let mut closed = false;
        let mut lines = Vec::new();
        if let Some(client) = self.api_clients.get_mut(key) {
            let mut buf = [0u8; 4096];
            loop {
                match client.stream.read(&mut buf) {
                    Ok(0) => {
                        closed = true;
                        break;
                    }
                    Ok(n) => client.input.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
            while let Some(pos) = client.input.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = client.input.drain(..=pos).collect();
                lines.push(line);
            }
            if client.input.len() > MAX_API_LINE {
                client.input.clear();
                lines.push(b"\x00oversized".to_vec());
            }
        }
        for line in lines {
            let reply = match api::parse(&line) {
                Ok(request) => self.handle(request),
                Err(error) => json!({ "error": error }),
            };
            if let Some(client) = self.api_clients.get_mut(key) {
                client.output.extend_from_slice(reply.to_string().as_bytes());
                client.output.push(b'\n');
            }
        }
        if let Some(client) = self.api_clients.get_mut(key) {
            while !client.output.is_empty() {
                match client.stream.write(&client.output) {
                    Ok(n) => {
                        client.output.drain(..n);
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => {
                        closed = true;
                        break;
                    }
                }
            }
        }
        if closed {
            let mut client = self.api_clients.remove(key);
            let _ = self.poll.registry().deregister(&mut client.stream);
        }
    }

    fn handle(&mut self, request: Request) -> Value {
        match request {
            Request::Stats { per_vm } => self.stats(per_vm),
            Request::List => json!({ "ok": true, "vms": self.vms.iter().map(stats::vm_summary).collect::<Vec<_>>() }),
            Request::Create { count } => self.create(count),
            Request::Destroy { vm } => match self.live(vm as usize) {
                Some(_) => {
                    self.kill_vm(vm as usize, "stopped", "destroyed through the control API".into());
                    json!({ "ok": true, "vm": vm })
                }
                None => json!({ "error": format!("no running VM {vm}") }),
            },
            Request::Crash { vm, triple } => match self.live(vm as usize) {
                Some(vm_ref) => {
                    vm_ref.command(if triple { abi::CMD_TRIPLE } else { abi::CMD_CRASH });
                    let _ = vm_ref.irq.write(1);
                    json!({ "ok": true, "vm": vm })
                }
                None => json!({ "error": format!("no running VM {vm}") }),
            },
            Request::Pager => {
                let mut reply = json!({ "ok": true });
                if let Some(f) = self.extra_stats.as_ref() {
                    f(&mut reply, false);
                }
                json!({ "ok": true, "pager": reply.get("pager").cloned().unwrap_or(Value::Null) })
            }
            Request::Disk { modeled } => match self.disk_control.as_ref() {
                Some(f) => {
                    f(modeled);
                    json!({ "ok": true, "modeled": modeled })
                }
                None => json!({ "error": "no pager attached to this monitor" }),
            },
        }
    }

    fn create(&mut self, count: u32) -> Value {
        let mut created = Vec::new();
        for _ in 0..count {
            let id = self.vms.len() as u32;
            let group = (id / DOORBELL_GROUP) as usize;
            if group >= self.doorbells.len() {
                match EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK) {
                    Ok(evt) => {
                        let fd = std::os::fd::AsRawFd::as_raw_fd(&evt);
                        if let Err(e) = self.poll.registry().register(&mut mio::unix::SourceFd(&fd), token(KIND_DOORBELL, group), Interest::READABLE) {
                            return json!({ "error": format!("create VM {id}: {e}"), "created": created });
                        }
                        self.doorbells.push(evt);
                    }
                    Err(e) => return json!({ "error": format!("create VM {id}: {e}"), "created": created }),
                }
            }
            let parts = vm::park_vcpu(&self.ctx, id).and_then(|vcpu| Ok(vm::Prebuilt { vcpu, kvm: vm::create(&self.ctx, id)? }));
            match parts.and_then(|parts| vm::build(&self.ctx, id, parts, &self.doorbells[group])) {
                Ok(vm) => {
                    if let Err(e) = self.adopt(vm) {
                        return json!({ "error": format!("create VM {id}: {e}"), "created": created });
                    }
                    created.push(id);
                }
                Err(e) => return json!({ "error": format!("create: {e}"), "created": created }),
            }
        }
        json!({ "ok": true, "created": created })
    }

    fn stats(&self, per_vm: bool) -> Value {
        let mut reply = stats::collect(&self.vms, self.conns.len(), per_vm);
        if let Some(f) = self.extra_stats.as_ref() {
            f(&mut reply, per_vm);
        }
        reply
    }

    /// Stops every vCPU and destroys every VM; removes the API socket.
    ///
    /// Memory is released only after every KVM VM is gone: before that,
    /// each release would visit all remaining VMs' MMU notifiers. VMs are
    /// destroyed from several threads so their SRCU grace periods overlap.
    /// The pager's registrations go with the pager.
    pub fn shutdown(&mut self) {
        let _ = std::fs::remove_file(&self.api_path);
        let mut live: Vec<Box<MicroVm>> = Vec::new();
        for entry in self.vms.drain(..) {
            if let VmEntry::Live(mut vm) = entry {
                vm.vcpu.request_stop();
                live.push(vm);
            }
        }
        let per_thread = live.len().div_ceil(TEARDOWN_THREADS).max(1);
        std::thread::scope(|scope| {
            for chunk in live.chunks_mut(per_thread) {
                scope.spawn(move || chunk.iter_mut().for_each(|vm| vm.release_kvm()));
            }
        });
    }
}

/// Sends what the socket takes now and buffers the rest.
fn send(conn: &mut Conn, payload: &[u8]) {
    if conn.broken {
        return;
    }
    let mut written = 0;
    if conn.buffered() == 0 {
        while written < payload.len() {
            match conn.stream.write(&payload[written..]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    conn.broken = true;
                    return;
                }
            }
        }
    }
    conn.out.extend_from_slice(&payload[written..]);
}

fn placeholder(id: usize) -> DeadVm {
    DeadVm {
        id: id as u32,
        addr: std::net::SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 0),
        state: "stopped",
        reason: String::new(),
        ctrl: abi::Ctrl::default(),
    }
}

impl VmEntry {
    /// Run state name for the stats.
    pub fn state_name(&self) -> &'static str {
        match self {
            VmEntry::Live(vm) => match vm.vcpu_state().state() {
                RunState::Running if vm.ready => "running",
                RunState::Running => "booting",
                RunState::Crashed => "crashed",
                RunState::Stopped => "stopped",
            },
            VmEntry::Dead(dead) => dead.state,
        }
    }
}
