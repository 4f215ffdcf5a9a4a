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
    /// The guest released the slot: close once the output is flushed.
    guest_closed: bool,
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
}

impl Proxy {
    /// A proxy whose connections are registered under `token(key)`.
    pub fn new(token: fn(usize) -> Token) -> Self {
        Proxy {
            conns: Slab::new(),
            token,
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

    /// Accepts connections on VM `index`'s listener while it has a free slot
    /// and room in its rx ring for the OPEN record.
    ///
    /// The socket is neither read nor the guest kicked here: registering a
    /// connected socket reports it ready at once (it is writable, and
    /// readable, since the listener defers a connection until its request
    /// arrives), so that first event reads the request and kicks the guest
    /// once for OPEN and data together. TCP_NODELAY and the deferral come
    /// from the listener (`vm::listen`).
    pub fn accept(&mut self, vms: &mut VmTable, index: usize, registry: &Registry) {
        loop {
            let Some(vm) = vms.live(index) else { return };
            let Some(slot) = vm.slots.iter().position(Option::is_none) else {
                vm.accept_paused = true;
                return;
            };
            if vm.stream.rx_reserve(&vm.sys, 0).is_none() {
                vm.accept_paused = true;
                return;
            }
            let mut stream = match nonblocking(|| vm.listener.accept()) {
                Ok(Some((stream, _))) => stream,
                Ok(None) => return,
                Err(e) => {
                    // EMFILE and friends: stop accepting until something closes.
                    eprintln!("densevm: VM {}: accept: {e}", vm.id);
                    vm.accept_paused = true;
                    return;
                }
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
                guest_closed: false,
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
        let _ = vm.irq.write(1);
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
