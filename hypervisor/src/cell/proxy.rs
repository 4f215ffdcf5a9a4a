//! The TCP-to-ring proxy: host sockets on one side, each VM's rings on the
//! other, with per-connection flow control.
//!
//! The host never sends a connection more request bytes than the guest's
//! buffer for it holds (credit), and acknowledges response bytes only once
//! the socket took them, so the guest never has more than its window of a
//! connection's response unacknowledged. A slow client stalls only its own
//! connection.
//!
//! Guests are not trusted: one call takes at most a ring's worth of a VM's
//! records (the rest waits for the next turn of the loop), a guest that
//! sends past its window is a protocol violator, and a guest that keeps a
//! slot after the client's FIN loses the host socket after [`FIN_GRACE`].
//!
//! A guest's CLOSE frees its slot at once, while the host may still hold
//! output the client has not read (up to the window): the connection
//! *lingers*. Lingerers are bounded three ways: a VM's open and lingering
//! connections together stay within its slot count (accepting pauses for
//! that VM only); a lingerer is reset [`LINGER_DEADLINE`] after the CLOSE;
//! and the output all lingerers of the cell hold stays below
//! [`LINGER_BYTES_MAX`], the largest lingerer being reset past it.

use crate::cell::listener::{Held, UNAVAILABLE};
use crate::cell::microvm::MicroVm;
use crate::cell::vmtable::VmTable;
use crate::devices::stream::{ProtocolViolation, TxRecord};
use crate::guest::abi;
use crate::link::framing::nonblocking;
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use slab::Slab;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Most bytes moved from a socket into a ring at once.
const READ_CHUNK: u32 = 64 << 10;
/// Most tx-ring bytes taken from one VM per call of [`Proxy::drain_tx`]: a
/// guest producing as fast as the host retires cannot hold the loop.
const TX_BUDGET: u64 = abi::TX_RING_BYTES;
/// How long a guest may keep a slot after the client's FIN before its host
/// socket is closed (the slot stays the guest's until it sends CLOSE).
pub const FIN_GRACE: Duration = Duration::from_secs(5);
/// Shortest HTTP request ("GET / HTTP/1.0" and an empty line): bounds the
/// requests a guest can claim to have served by the bytes it was sent.
pub const MIN_REQUEST_BYTES: u64 = 18;
/// Longest a connection the guest released may keep unsent output before
/// it is reset.
pub const LINGER_DEADLINE: Duration = Duration::from_secs(15);
/// Most output bytes the cell's lingering connections hold together; past
/// it the largest is reset.
pub const LINGER_BYTES_MAX: usize = 64 << 20;

/// What an event said about a connection's socket.
#[derive(Debug, Clone, Copy)]
pub struct Readiness {
    /// Bytes (or EOF) to read.
    pub readable: bool,
    /// Room to write.
    pub writable: bool,
    /// The client's FIN or an error arrived: read to the end.
    pub read_closed: bool,
}

/// Why [`Proxy::drain_tx`] stopped a VM as a protocol violator.
#[derive(Debug, thiserror::Error)]
pub enum TxError {
    /// A malformed record.
    #[error(transparent)]
    Record(#[from] ProtocolViolation),
    /// Response bytes past the slot's window.
    #[error("slot {slot}: {buffered} response bytes unacknowledged, window {window}")]
    Window {
        /// The connection slot.
        slot: usize,
        /// Bytes the host holds unacknowledged.
        buffered: usize,
        /// The window.
        window: u32,
    },
}

/// What [`Proxy::drain_tx`] left behind.
#[derive(Debug, PartialEq, Eq)]
pub enum Drained {
    /// The tx ring is empty.
    All,
    /// The budget ran out: call again on the next turn.
    More,
    /// The VM spent its record rate: call again at this time, not before.
    Throttled(Instant),
}

/// One client connection to a VM.
struct Conn {
    /// Index of the VM in the cell's table.
    vm: usize,
    slot: Option<usize>,
    /// `None` once closed because the guest kept the slot past [`FIN_GRACE`].
    stream: Option<TcpStream>,
    out: Vec<u8>,
    out_start: usize,
    /// When FIN (EOF or error) reached the guest.
    fin_sent: Option<Instant>,
    /// The socket failed: output is discarded.
    broken: bool,
    /// The guest sent it output.
    answered: bool,
    /// The guest released the slot: close once the output is flushed.
    guest_closed: bool,
    /// Since when it lingers: released by the guest with output unsent.
    lingering: Option<Instant>,
    /// An event reported the client's FIN (or an error): read to the end.
    /// Until then a short read means the socket is drained, since any byte
    /// that arrives later raises a new edge.
    read_closed: bool,
    /// The last read found the socket empty (or at EOF) and no readable
    /// event came since: closing cannot reset the connection over unread
    /// request bytes.
    drained: bool,
}

impl Conn {
    fn buffered(&self) -> usize {
        self.out.len() - self.out_start
    }

    /// Sends what the socket takes now and buffers the rest.
    fn send(&mut self, payload: &[u8]) {
        self.answered |= !payload.is_empty();
        let buffered = self.buffered();
        let (false, Some(stream)) = (self.broken, self.stream.as_mut()) else {
            return;
        };
        let mut written = 0;
        if buffered == 0 {
            while written < payload.len() {
                match nonblocking(|| stream.write(&payload[written..])) {
                    Ok(Some(n)) => written += n,
                    Ok(None) => break,
                    Err(_) => {
                        self.broken = true;
                        return;
                    }
                }
            }
        }
        self.out.extend_from_slice(&payload[written..]);
    }
}

/// Every connection of a cell's VMs.
pub struct Proxy {
    conns: Slab<Conn>,
    /// Turns a connection key into its event-loop token.
    token: fn(usize) -> Token,
    /// Output bytes the lingering connections hold.
    lingering_bytes: usize,
    /// VMs whose accepting paused and that a lingerer's end may resume.
    resume: Vec<usize>,
    /// Accepted connections waiting for a slot of their VM.
    pub held: Held,
}

impl Proxy {
    /// A proxy whose connections are registered under `token(key)`.
    pub fn new(token: fn(usize) -> Token) -> Self {
        Proxy {
            conns: Slab::new(),
            token,
            lingering_bytes: 0,
            resume: Vec::new(),
            held: Held::default(),
        }
    }

    /// Open connections.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// The VM (index) a connection belongs to.
    pub fn vm_of(&self, key: usize) -> Option<usize> {
        self.conns.get(key).map(|c| c.vm)
    }

    /// Takes VM `index`'s held connections (`cell::listener`) while it has
    /// a free slot (open and lingering connections together within its slot
    /// count) and room in its rx ring for the OPEN record.
    ///
    /// The socket is neither read nor the guest kicked here: registering a
    /// connected socket reports it ready at once (it is writable, and
    /// readable, since the listener defers a connection until its request
    /// arrives), so that first event reads the request and kicks the guest
    /// once for OPEN and data together. TCP_NODELAY and the deferral come
    /// from the cell's socket (`listener::listen`).
    pub fn accept(&mut self, vms: &mut VmTable, index: usize, registry: &Registry) {
        loop {
            let Some(vm) = vms.live(index) else { return };
            let open = vm.slots.iter().flatten().count();
            let free = vm.slots.iter().position(Option::is_none);
            let Some(slot) = free.filter(|_| open + vm.lingering < abi::MAX_SLOTS) else {
                vm.accept_paused = true;
                return;
            };
            if !self.held.waits(index) {
                return;
            }
            // A sleeping VM's rings take the connection: its pages come back.
            vm.unpack_sys();
            if vm.stream.rx_reserve(&vm.sys, 0).is_none() {
                vm.accept_paused = true;
                return;
            }
            let Some(mut stream) = self.held.take(index) else {
                return;
            };
            let entry = self.conns.vacant_entry();
            let key = entry.key();
            if registry
                .register(
                    &mut stream,
                    (self.token)(key),
                    Interest::READABLE | Interest::WRITABLE,
                )
                .is_err()
            {
                continue;
            }
            entry.insert(Conn {
                vm: index,
                slot: Some(slot),
                stream: Some(stream),
                out: Vec::new(),
                out_start: 0,
                fin_sent: None,
                broken: false,
                answered: false,
                guest_closed: false,
                lingering: None,
                read_closed: false,
                drained: false,
            });
            vm.slots[slot] = Some(key);
            vm.stream.rx_control(&vm.sys, slot, abi::REC_OPEN);
        }
    }

    /// A connection's socket is ready.
    pub fn ready(&mut self, vms: &mut VmTable, key: usize, readiness: Readiness) {
        if let Some(conn) = self.conns.get_mut(key) {
            conn.read_closed |= readiness.read_closed;
            conn.drained &= !readiness.readable;
        }
        if readiness.writable {
            self.flush(vms, key);
        }
        if readiness.readable {
            self.pump_rx(vms, key);
        }
        if let Some(index) = self.vm_of(key) {
            kick(vms, index);
        }
    }

    /// Moves socket bytes into the rx ring as far as credit and room allow.
    pub fn pump_rx(&mut self, vms: &mut VmTable, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        let (Some(slot), None, Some(stream)) = (conn.slot, conn.fin_sent, conn.stream.as_mut())
        else {
            return;
        };
        let Some(vm) = vms.live(conn.vm) else { return };
        loop {
            let credit = vm.stream.rx_credit(&vm.sys, slot).min(READ_CHUNK);
            let Some(space) = (credit > 0)
                .then(|| vm.stream.rx_reserve(&vm.sys, credit))
                .flatten()
            else {
                wait_for_room(vm, key);
                return;
            };
            // SAFETY: the space is filled before the record is committed.
            let buffer = unsafe { space.as_mut_slice() };
            let room = buffer.len();
            match nonblocking(|| stream.read(buffer)) {
                Ok(Some(0)) => {
                    conn.drained = true;
                    break;
                }
                Ok(Some(n)) => {
                    vm.stream.rx_commit(&vm.sys, slot, abi::REC_DATA, n as u32);
                    vm.rx_bytes += n as u64;
                    if n < room && !conn.read_closed {
                        conn.drained = true;
                        return;
                    }
                }
                Ok(None) => {
                    conn.drained = true;
                    return;
                }
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
            conn.fin_sent = Some(Instant::now());
        } else {
            wait_for_room(vm, key);
        }
    }

    /// Takes in what the guest put in its tx ring, up to [`TX_BUDGET`]
    /// bytes: data goes to its connections, CLOSE records release slots.
    /// Err: a malformed record, or response bytes past the slot's window.
    pub fn drain_tx(&mut self, vms: &mut VmTable, index: usize) -> Result<Drained, TxError> {
        let mut taken = 0u64;
        let now = Instant::now();
        loop {
            let Some(vm) = vms.live(index) else {
                return Ok(Drained::All);
            };
            if taken >= TX_BUDGET {
                return Ok(Drained::More);
            }
            let Some(record) = vm.stream.tx_peek(&vm.sys)? else {
                return Ok(Drained::All);
            };
            if !vm.tx_records.take(now) {
                return Ok(Drained::Throttled(vm.tx_records.ready_at()));
            }
            taken += abi::RECORD_HEADER as u64;
            match record {
                TxRecord::Data { slot, offset, len } => {
                    taken += len as u64;
                    let conn = vm.slots[slot].and_then(|k| self.conns.get_mut(k));
                    let mut buffered = 0;
                    if let Some(conn) = conn {
                        // SAFETY: tx_peek checked the payload lies in the tx ring.
                        conn.send(unsafe {
                            std::slice::from_raw_parts(vm.sys.at(offset), len as usize)
                        });
                        buffered = conn.buffered();
                        vm.tx_responses += u64::from(len > 0);
                    }
                    // The host acknowledged all but `buffered` bytes, so a
                    // guest within its window never gets past it here.
                    if buffered > abi::TX_WINDOW as usize {
                        return Err(TxError::Window {
                            slot,
                            buffered,
                            window: abi::TX_WINDOW,
                        });
                    }
                    vm.stream.tx_consume(&vm.sys, &record);
                    vm.stream.ack(&vm.sys, slot, buffered);
                }
                TxRecord::Close { slot } => {
                    vm.stream.tx_consume(&vm.sys, &record);
                    vm.stream.ack(&vm.sys, slot, 0);
                    if let Some(key) = vm.slots[slot].take() {
                        vm.waiting.retain(|k| *k != key);
                        if let Some(conn) = self.conns.get_mut(key) {
                            conn.slot = None;
                            conn.guest_closed = true;
                        }
                        self.finish_if_done(vms, key);
                        self.linger(vms, key, now);
                    }
                }
            }
        }
    }

    /// Feeds the connections of VM `index` that waited for ring room, and
    /// accepts again if accepting was paused.
    pub fn retry_waiting(&mut self, vms: &mut VmTable, index: usize, registry: &Registry) {
        let Some(vm) = vms.live(index) else { return };
        let waiting = std::mem::take(&mut vm.waiting);
        let paused = std::mem::replace(&mut vm.accept_paused, false);
        for key in waiting {
            self.pump_rx(vms, key);
        }
        if paused {
            self.accept(vms, index, registry);
        }
    }

    fn flush(&mut self, vms: &mut VmTable, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        let before = conn.buffered();
        while let (true, false, Some(stream)) =
            (conn.buffered() > 0, conn.broken, conn.stream.as_mut())
        {
            match nonblocking(|| stream.write(&conn.out[conn.out_start..])) {
                Ok(Some(n)) => conn.out_start += n,
                Ok(None) => break,
                Err(_) => conn.broken = true,
            }
        }
        if conn.buffered() == 0 || conn.broken {
            conn.out.clear();
            conn.out_start = 0;
        }
        if conn.lingering.is_some() {
            self.lingering_bytes = self
                .lingering_bytes
                .saturating_sub(before.saturating_sub(conn.buffered()));
        }
        if let Some(slot) = conn.slot {
            let buffered = conn.buffered();
            if let Some(vm) = vms.live(conn.vm) {
                vm.stream.ack(&vm.sys, slot, buffered);
            }
        }
        self.finish_if_done(vms, key);
    }

    /// Closes a connection the guest released once its output is out.
    fn finish_if_done(&mut self, vms: &mut VmTable, key: usize) {
        let Some(conn) = self.conns.get(key) else {
            return;
        };
        if conn.guest_closed && (conn.buffered() == 0 || conn.broken) {
            self.close(vms, key);
        }
    }

    /// Closes a connection and frees its slot. Closing the socket takes it
    /// out of the event loop's set (no other descriptor refers to it), so
    /// there is no deregistration call. On a drained socket it sends the FIN
    /// after the response; with request bytes possibly unread it would send
    /// a reset that can overtake the response, so the FIN goes first.
    pub fn close(&mut self, vms: &mut VmTable, key: usize) {
        let Some(conn) = self.conns.try_remove(key) else {
            return;
        };
        if let (false, Some(stream)) = (conn.drained, conn.stream.as_ref()) {
            let _ = stream.shutdown(std::net::Shutdown::Write);
        }
        if let (Some(slot), Some(vm)) = (conn.slot, vms.live(conn.vm)) {
            vm.slots[slot] = None;
        }
        if conn.lingering.is_some() {
            self.lingering_bytes = self.lingering_bytes.saturating_sub(conn.buffered());
            if let Some(vm) = vms.live(conn.vm) {
                vm.lingering = vm.lingering.saturating_sub(1);
                if vm.accept_paused {
                    self.resume.push(conn.vm);
                }
            }
        }
    }

    /// Resets a connection (RST, its unsent output dropped) and closes it.
    fn reset(&mut self, vms: &mut VmTable, key: usize) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        if let Some(stream) = conn.stream.as_ref() {
            let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
        }
        // No FIN first: the reset is the point.
        conn.drained = true;
        if let Some(vm) = vms.live(conn.vm) {
            vm.linger_resets += 1;
        }
        self.close(vms, key);
    }

    /// After the guest's CLOSE: a connection still holding output lingers.
    /// It counts against its VM's slots until it ends, and the cell's
    /// lingerers together hold at most [`LINGER_BYTES_MAX`].
    fn linger(&mut self, vms: &mut VmTable, key: usize, now: Instant) {
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        if conn.lingering.is_some() {
            return;
        }
        conn.lingering = Some(now);
        // What was sent goes back to the allocator now.
        conn.out.drain(..conn.out_start);
        conn.out_start = 0;
        conn.out.shrink_to_fit();
        self.lingering_bytes = self.lingering_bytes.saturating_add(conn.buffered());
        if let Some(vm) = vms.live(conn.vm) {
            vm.lingering += 1;
        }
        while self.lingering_bytes > LINGER_BYTES_MAX {
            let largest = self
                .conns
                .iter()
                .filter(|(_, c)| c.lingering.is_some())
                .max_by_key(|(_, c)| c.buffered())
                .map(|(k, _)| k);
            match largest {
                Some(largest) => self.reset(vms, largest),
                None => {
                    self.lingering_bytes = 0;
                    break;
                }
            }
        }
    }

    /// Accepts again on the VMs whose lingering connections ended while
    /// accepting was paused.
    pub fn resume_accepts(&mut self, vms: &mut VmTable, registry: &Registry) {
        while let Some(index) = self.resume.pop() {
            let Some(vm) = vms.live(index) else { continue };
            if std::mem::replace(&mut vm.accept_paused, false) {
                self.accept(vms, index, registry);
            }
        }
    }

    /// Closes every connection of VM `index`, lingering ones included;
    /// those it never answered get [`UNAVAILABLE`] first.
    pub fn close_vm(&mut self, vms: &mut VmTable, index: usize) {
        self.held.drop_vm(index);
        let keys: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| c.vm == index)
            .map(|(k, _)| k)
            .collect();
        for key in keys {
            if let Some(conn) = self.conns.get_mut(key).filter(|c| !c.answered) {
                conn.send(UNAVAILABLE);
            }
            self.close(vms, key);
        }
    }

    /// Resets the connections that have lingered past [`LINGER_DEADLINE`];
    /// returns how many.
    pub fn expire_lingering(&mut self, vms: &mut VmTable, now: Instant) -> usize {
        let expired: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.lingering
                    .is_some_and(|since| now.duration_since(since) >= LINGER_DEADLINE)
            })
            .map(|(k, _)| k)
            .collect();
        for &key in &expired {
            self.reset(vms, key);
        }
        expired.len()
    }
}

impl Proxy {
    /// Closes the host sockets of connections whose guest kept the slot
    /// more than [`FIN_GRACE`] after the client's FIN, so a guest cannot pin
    /// host descriptors. Returns how many it closed.
    pub fn expire_pinned(&mut self, now: Instant) -> usize {
        let mut closed = 0;
        for (_, conn) in self.conns.iter_mut() {
            let Some(fin) = conn.fin_sent else { continue };
            if conn.guest_closed || now.duration_since(fin) < FIN_GRACE {
                continue;
            }
            if conn.stream.take().is_some() {
                conn.broken = true;
                conn.out = Vec::new();
                conn.out_start = 0;
                closed += 1;
            }
        }
        closed
    }
}

fn wait_for_room(vm: &mut MicroVm, key: usize) {
    if !vm.waiting.contains(&key) {
        vm.waiting.push(key);
    }
}

/// Interrupts VM `index` if it is idle and the host gave it something.
pub fn kick(vms: &mut VmTable, index: usize) {
    let Some(vm) = vms.live(index) else { return };
    if vm.stream.take_kick(&vm.sys) {
        vm.kick();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::microvm::{RecordBudget, TX_RECORDS_PER_SEC, TX_RECORD_BURST};

    #[test]
    fn a_record_budget_allows_its_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut budget = RecordBudget::new(t0);
        let burst = TX_RECORD_BURST as usize;
        assert_eq!((0..burst + 10).filter(|_| budget.take(t0)).count(), burst);
        // Ready again once a turn's worth (1/64 of the burst) has refilled.
        let turn = Duration::from_secs_f64(TX_RECORD_BURST / 64.0 / TX_RECORDS_PER_SEC);
        let ready = budget.ready_at();
        assert!(ready >= t0 + turn - Duration::from_micros(1) && ready <= t0 + turn);
        // Ten milliseconds later: exactly the rate's worth of records more.
        let later = t0 + Duration::from_millis(10);
        let allowed = (0..burst).filter(|_| budget.take(later)).count();
        assert_eq!(allowed, (TX_RECORDS_PER_SEC * 0.01) as usize);
        // Idle for long: full again, never more than the burst.
        let much_later = t0 + Duration::from_secs(60);
        assert_eq!(
            (0..2 * burst).filter(|_| budget.take(much_later)).count(),
            burst
        );
    }
}
