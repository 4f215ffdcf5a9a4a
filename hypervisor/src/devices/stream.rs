//! Host side of the stream device: the rx ring (host produces), the tx ring
//! (guest produces) and per-slot flow control, over a VM's system pages.
//!
//! Everything the guest writes is validated here: a malformed record makes
//! the VM a protocol violator, never a monitor crash.

use crate::guest::abi::{self, credit, ring_hdr};
use crate::guest::memory::Mapping;
use std::sync::atomic::{fence, Ordering};

const RX_SIZE: u32 = abi::RX_RING_BYTES as u32;
const TX_SIZE: u32 = abi::TX_RING_BYTES as u32;
const HEADER: u32 = abi::RECORD_HEADER;
/// Tails shorter than this are padded over rather than filled.
const MIN_CHUNK: u32 = 1024;
/// An empty rx ring starts again at its first byte once its position is
/// past this ([`StreamDevice::rx_reserve`]).
const RX_RESTART: u32 = 16 << 10;

/// `n` rounded up to a multiple of 8 (saturating: callers check lengths
/// against the ring first, and a guest word must never overflow here).
fn round8(n: u32) -> u32 {
    n.saturating_add(7) & !7
}

/// A guest record the host cannot accept.
#[derive(Debug, thiserror::Error)]
#[error("guest broke the stream protocol: {0}")]
pub struct ProtocolViolation(pub String);

/// Free payload space of a reserved rx record, inside guest memory.
#[derive(Debug)]
pub struct RingSpace {
    ptr: *mut u8,
    len: usize,
}

impl RingSpace {
    /// The space as a byte slice to fill.
    ///
    /// # Safety
    /// Only until the record is committed: the guest does not read
    /// unpublished ring space, and nothing else writes it meanwhile.
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        // SAFETY: rx_reserve checked the extent lies inside the rx ring.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// A record the guest sent.
#[derive(Debug, Clone, Copy)]
pub enum TxRecord {
    /// Response bytes for a slot, at `offset` in the tx ring.
    Data {
        /// Connection slot.
        slot: usize,
        /// Ring offset of the payload.
        offset: u64,
        /// Payload length.
        len: u32,
    },
    /// The guest released the slot.
    Close {
        /// Connection slot.
        slot: usize,
    },
}

/// Host-side ring and credit state of one VM.
#[derive(Debug)]
pub struct StreamDevice {
    rx_prod: u32,
    tx_cons: u32,
    rx_sent: [u32; abi::MAX_SLOTS],
    tx_received: [u32; abi::MAX_SLOTS],
    last_kick_gen: Option<u32>,
    /// The host put something in the rx ring since the last kick check.
    changed: bool,
    /// The host retired tx records or acknowledged response bytes since the
    /// last kick check: news only to a guest whose output waits for it.
    tx_progress: bool,
}

impl Default for StreamDevice {
    fn default() -> Self {
        StreamDevice {
            rx_prod: 0,
            tx_cons: 0,
            rx_sent: [0; abi::MAX_SLOTS],
            tx_received: [0; abi::MAX_SLOTS],
            last_kick_gen: None,
            changed: false,
            tx_progress: false,
        }
    }
}

impl StreamDevice {
    fn rx_cons(sys: &Mapping) -> u32 {
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::RX_CONS)
            .load(Ordering::Acquire)
    }

    /// Request bytes the guest will accept for `slot` now.
    pub fn rx_credit(&self, sys: &Mapping, slot: usize) -> u32 {
        let consumed = sys
            .atomic_u32(abi::CREDIT_GPA + credit::STRIDE * slot as u64 + credit::RX_CONSUMED)
            .load(Ordering::Acquire);
        abi::RX_WINDOW.saturating_sub(self.rx_sent[slot].wrapping_sub(consumed))
    }

    /// Reserves an rx record for up to `want` payload bytes (`want` may be
    /// 0 for OPEN and FIN); returns where its payload goes, or `None` when
    /// the ring has no room now.
    ///
    /// An empty ring past [`RX_RESTART`] starts again at its first byte (a
    /// padding record skips the rest): a VM that gets a request now and
    /// then reuses its first few pages instead of walking its whole ring,
    /// whose every page touched for the first time costs a fault and stays
    /// host memory.
    pub fn rx_reserve(&mut self, sys: &Mapping, want: u32) -> Option<RingSpace> {
        for _ in 0..2 {
            // The guest's consumer index: past the producer or more than a
            // ring behind it, it is a lie, and the guest gets no room.
            let used = self.rx_prod.wrapping_sub(Self::rx_cons(sys));
            let free = RX_SIZE.checked_sub(used)?;
            let pos = self.rx_prod % RX_SIZE;
            let contig = RX_SIZE - pos;
            let needed = HEADER + round8(want.min(MIN_CHUNK));
            // Until the guest consumes the padding, only the bytes before
            // `pos` are free: restart only where the whole record and the
            // next few fit there (a padding record alone does not wake the
            // guest to consume it).
            let restart = free == RX_SIZE && pos >= RX_RESTART.max(HEADER + round8(want));
            if !restart {
                let room = free.min(contig);
                if room >= needed {
                    let len = (room - HEADER).min(want);
                    return Some(RingSpace {
                        ptr: sys.at(abi::RX_RING_GPA + (pos + HEADER) as u64),
                        len: len as usize,
                    });
                }
                if contig >= free {
                    return None;
                }
            }
            self.write_rx_header(sys, pos, 0, abi::REC_PAD, contig - HEADER);
            self.rx_prod = self.rx_prod.wrapping_add(contig);
            self.publish_rx(sys);
        }
        None
    }

    fn write_rx_header(&self, sys: &Mapping, pos: u32, slot: usize, kind: u8, len: u32) {
        let header = (slot as u64) | ((kind as u64) << 16) | ((len as u64) << 32);
        sys.write_obj(abi::RX_RING_GPA + pos as u64, header);
    }

    /// Completes the record reserved last, with `len` payload bytes.
    pub fn rx_commit(&mut self, sys: &Mapping, slot: usize, kind: u8, len: u32) {
        self.write_rx_header(sys, self.rx_prod % RX_SIZE, slot, kind, len);
        self.rx_prod = self.rx_prod.wrapping_add(HEADER + round8(len));
        if kind == abi::REC_DATA {
            self.rx_sent[slot] = self.rx_sent[slot].wrapping_add(len);
        }
        self.publish_rx(sys);
        // An OPEN alone asks nothing of the guest (an HTTP server speaks
        // second): it rides along with the request's kick.
        self.changed |= kind != abi::REC_OPEN;
    }

    /// Moves the guest-visible producer index; a padding record alone is no news.
    fn publish_rx(&self, sys: &Mapping) {
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::RX_PROD)
            .store(self.rx_prod, Ordering::Release);
    }

    /// Sends a payload-less record (OPEN or FIN); false when the ring is full.
    pub fn rx_control(&mut self, sys: &Mapping, slot: usize, kind: u8) -> bool {
        if self.rx_reserve(sys, 0).is_none() {
            return false;
        }
        self.rx_commit(sys, slot, kind, 0);
        true
    }

    /// The next record the guest produced, if any. Call [`Self::tx_consume`]
    /// once it has been handled.
    pub fn tx_peek(&mut self, sys: &Mapping) -> Result<Option<TxRecord>, ProtocolViolation> {
        loop {
            let prod = sys
                .atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_PROD)
                .load(Ordering::Acquire);
            let pending = prod.wrapping_sub(self.tx_cons);
            if pending == 0 {
                return Ok(None);
            }
            if pending > TX_SIZE || !pending.is_multiple_of(8) {
                return Err(ProtocolViolation(format!(
                    "tx producer index moved by {pending} bytes"
                )));
            }
            let pos = self.tx_cons % TX_SIZE;
            let header: u64 = sys.read_volatile(abi::TX_RING_GPA + pos as u64);
            let slot = (header & 0xffff) as usize;
            let kind = ((header >> 16) & 0xff) as u8;
            let len = (header >> 32) as u32;
            let contig = TX_SIZE - pos;
            if kind == abi::REC_PAD {
                if contig > pending {
                    return Err(ProtocolViolation("padding past the producer".into()));
                }
                self.tx_cons = self.tx_cons.wrapping_add(contig);
                continue;
            }
            if slot >= abi::MAX_SLOTS || len > contig - HEADER || HEADER + round8(len) > pending {
                return Err(ProtocolViolation(format!(
                    "record slot {slot} len {len} at {pos}"
                )));
            }
            return match kind {
                abi::REC_DATA => Ok(Some(TxRecord::Data {
                    slot,
                    offset: abi::TX_RING_GPA + (pos + HEADER) as u64,
                    len,
                })),
                abi::REC_CLOSE if len == 0 => Ok(Some(TxRecord::Close { slot })),
                _ => Err(ProtocolViolation(format!("record type {kind:#x}"))),
            };
        }
    }

    /// Retires the record returned by the last [`Self::tx_peek`].
    pub fn tx_consume(&mut self, sys: &Mapping, record: &TxRecord) {
        let len = match *record {
            TxRecord::Data { slot, len, .. } => {
                self.tx_received[slot] = self.tx_received[slot].wrapping_add(len);
                len
            }
            TxRecord::Close { .. } => 0,
        };
        self.tx_cons = self.tx_cons.wrapping_add(HEADER + round8(len));
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_CONS)
            .store(self.tx_cons, Ordering::Release);
        self.tx_progress = true;
    }

    /// Where the two consumers stand (the host's in the tx ring, the
    /// guest's in the rx ring): a doorbell after which neither moved
    /// brought nothing.
    pub fn progress_mark(&self, sys: &Mapping) -> (u32, u32) {
        (self.tx_cons, Self::rx_cons(sys))
    }

    /// Whether both rings are empty: the guest took every request byte and
    /// the host every response byte, so the rings' bytes hold nothing
    /// anyone will read.
    pub fn drained(&self, sys: &Mapping) -> bool {
        let tx_prod = sys
            .atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_PROD)
            .load(Ordering::Acquire);
        self.rx_prod == Self::rx_cons(sys) && self.tx_cons == tx_prod
    }

    /// Acknowledges every response byte of `slot` except `still_buffered`.
    pub fn ack(&mut self, sys: &Mapping, slot: usize, still_buffered: usize) {
        let acked = self.tx_received[slot].wrapping_sub(still_buffered as u32);
        let word =
            sys.atomic_u32(abi::CREDIT_GPA + credit::STRIDE * slot as u64 + credit::TX_ACKED);
        if word.swap(acked, Ordering::Release) != acked {
            self.tx_progress = true;
        }
    }

    /// Whether the guest must be interrupted: the host changed something it
    /// reads, and it is (about to be) halted without having been kicked in
    /// this idle period. Marks it kicked. A guest that is not idle sees the
    /// change itself before it halts, so the change is consumed either way.
    ///
    /// Tx progress (ring room, acknowledgements) counts only while the guest
    /// says it idles with output held back (`tx_waiting`): a guest that
    /// sent all it had waits for nothing on the tx side, and waking it after
    /// every response would cost a vCPU switch per request for nothing. A
    /// guest that claims to wait when it does not is only woken for the
    /// progress of its own output.
    pub fn take_kick(&mut self, sys: &Mapping) -> bool {
        let rx_news = std::mem::take(&mut self.changed);
        let tx_news = std::mem::take(&mut self.tx_progress);
        if !(rx_news || tx_news) {
            return false;
        }
        fence(Ordering::SeqCst);
        if sys
            .atomic_u32(abi::RINGHDR_GPA + ring_hdr::GUEST_IDLE)
            .load(Ordering::Acquire)
            == 0
        {
            return false;
        }
        // Read after guest_idle: the guest announces it first.
        if !rx_news
            && sys
                .atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_WAITING)
                .load(Ordering::Acquire)
                == 0
        {
            return false;
        }
        let generation = sys
            .atomic_u32(abi::RINGHDR_GPA + ring_hdr::IDLE_GEN)
            .load(Ordering::Acquire);
        if self.last_kick_gen == Some(generation) {
            return false;
        }
        self.last_kick_gen = Some(generation);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sys() -> Mapping {
        Mapping::anonymous(abi::SYS_BYTES as usize, false).unwrap()
    }

    /// Plays the guest's part of the tx ring (a test double of the C code).
    fn guest_send(sys: &Mapping, prod: &mut u32, slot: u16, kind: u8, payload: &[u8]) {
        let pos = *prod % TX_SIZE;
        let header = (slot as u64) | ((kind as u64) << 16) | ((payload.len() as u64) << 32);
        sys.write_obj(abi::TX_RING_GPA + pos as u64, header);
        sys.write_bytes(abi::TX_RING_GPA + (pos + HEADER) as u64, payload);
        *prod += HEADER + round8(payload.len() as u32);
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_PROD)
            .store(*prod, Ordering::Release);
    }

    #[test]
    fn rx_records_respect_ring_space_and_pad_at_the_end() {
        let sys = sys();
        let mut dev = StreamDevice::default();
        let mut total = 0u32;
        while let Some(space) = dev.rx_reserve(&sys, 5000) {
            let n = space.len as u32;
            dev.rx_commit(&sys, 1, abi::REC_DATA, n);
            total += n;
        }
        assert!(
            total <= RX_SIZE && total > RX_SIZE - 2 * MIN_CHUNK - 64,
            "filled {total}"
        );
        // The guest consumes everything: the next record must pad and wrap.
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::RX_CONS)
            .store(dev.rx_prod, Ordering::Release);
        let space = dev.rx_reserve(&sys, 5000).expect("room after consumption");
        assert_eq!(space.len, 5000);
    }

    #[test]
    fn an_empty_rx_ring_past_its_restart_point_starts_again_at_the_front() {
        let sys = sys();
        let mut dev = StreamDevice::default();
        let consume_all = |dev: &StreamDevice| {
            sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::RX_CONS)
                .store(dev.rx_prod, Ordering::Release)
        };
        let send = |dev: &mut StreamDevice| {
            let ptr = dev.rx_reserve(&sys, 5000).unwrap().ptr;
            dev.rx_commit(&sys, 1, abi::REC_DATA, 5000);
            ptr
        };
        let front = send(&mut dev);
        // Emptied before the restart point: records go on from there.
        for n in 1..4 {
            consume_all(&dev);
            assert_eq!(send(&mut dev), front.wrapping_add(5008 * n));
        }
        // Past it (20,032 bytes in) but not empty: still on from there.
        assert_eq!(send(&mut dev), front.wrapping_add(5008 * 4));
        consume_all(&dev);
        // Past it and empty: back to the front.
        assert_eq!(send(&mut dev), front);
        assert_eq!(send(&mut dev), front.wrapping_add(5008));
    }

    #[test]
    fn rx_credit_follows_the_guest_consumption_counter() {
        let sys = sys();
        let mut dev = StreamDevice::default();
        assert_eq!(dev.rx_credit(&sys, 3), abi::RX_WINDOW);
        dev.rx_reserve(&sys, 3000).unwrap();
        dev.rx_commit(&sys, 3, abi::REC_DATA, 3000);
        assert_eq!(dev.rx_credit(&sys, 3), abi::RX_WINDOW - 3000);
        sys.atomic_u32(abi::CREDIT_GPA + 3 * credit::STRIDE)
            .store(1000, Ordering::Release);
        assert_eq!(dev.rx_credit(&sys, 3), abi::RX_WINDOW - 2000);
        assert_eq!(dev.rx_credit(&sys, 4), abi::RX_WINDOW);
    }

    #[test]
    fn tx_records_are_parsed_and_acknowledged() {
        let sys = sys();
        let mut dev = StreamDevice::default();
        let mut prod = 0;
        guest_send(&sys, &mut prod, 7, abi::REC_DATA, b"hello");
        guest_send(&sys, &mut prod, 7, abi::REC_CLOSE, b"");
        let rec = dev.tx_peek(&sys).unwrap().unwrap();
        let TxRecord::Data {
            slot: 7,
            offset,
            len: 5,
        } = rec
        else {
            panic!("{rec:?}")
        };
        assert_eq!(sys.read_volatile::<u8>(offset), b'h');
        dev.tx_consume(&sys, &rec);
        dev.ack(&sys, 7, 2);
        assert_eq!(
            sys.atomic_u32(abi::CREDIT_GPA + 7 * credit::STRIDE + credit::TX_ACKED)
                .load(Ordering::Acquire),
            3
        );
        let rec = dev.tx_peek(&sys).unwrap().unwrap();
        assert!(matches!(rec, TxRecord::Close { slot: 7 }));
        dev.tx_consume(&sys, &rec);
        assert!(dev.tx_peek(&sys).unwrap().is_none());
    }

    #[test]
    fn malformed_guest_records_are_protocol_violations() {
        let sys = sys();
        let mut prod = 0;
        guest_send(&sys, &mut prod, 200, abi::REC_DATA, b"x");
        assert!(
            StreamDevice::default().tx_peek(&sys).is_err(),
            "slot out of range"
        );

        let sys = self::sys();
        let mut prod = 0;
        guest_send(&sys, &mut prod, 1, 0x33, b"");
        assert!(
            StreamDevice::default().tx_peek(&sys).is_err(),
            "unknown type"
        );

        let sys = self::sys();
        sys.write_obj(
            abi::TX_RING_GPA,
            (1u64) | ((abi::REC_DATA as u64) << 16) | ((1u64 << 31) << 32),
        );
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_PROD)
            .store(64, Ordering::Release);
        assert!(
            StreamDevice::default().tx_peek(&sys).is_err(),
            "length past the ring"
        );

        let sys = self::sys();
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_PROD)
            .store(TX_SIZE + 8, Ordering::Release);
        assert!(
            StreamDevice::default().tx_peek(&sys).is_err(),
            "producer beyond the ring size"
        );
    }

    #[test]
    fn a_lying_rx_consumer_index_gives_no_room_and_no_overflow() {
        let sys = sys();
        let mut dev = StreamDevice::default();
        dev.rx_reserve(&sys, 100).unwrap();
        dev.rx_commit(&sys, 0, abi::REC_DATA, 100);
        let prod = dev.rx_prod;
        for lie in [
            prod + 8,
            prod.wrapping_add(RX_SIZE),
            prod.wrapping_sub(RX_SIZE + 8),
        ] {
            sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::RX_CONS)
                .store(lie, Ordering::Release);
            assert!(dev.rx_reserve(&sys, 100).is_none(), "consumer at {lie}");
            assert!(!dev.rx_control(&sys, 0, abi::REC_FIN));
        }
        assert_eq!(round8(u32::MAX), !7);
    }

    #[test]
    fn kicks_an_idle_guest_once_and_only_for_news() {
        let sys = sys();
        let mut dev = StreamDevice::default();
        dev.rx_control(&sys, 0, abi::REC_OPEN);
        assert!(
            !dev.take_kick(&sys),
            "busy guest: it sees the record itself"
        );
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::IDLE_GEN)
            .store(1, Ordering::Release);
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::GUEST_IDLE)
            .store(1, Ordering::Release);
        assert!(!dev.take_kick(&sys), "idle, but nothing new for it");
        dev.rx_control(&sys, 0, abi::REC_FIN);
        assert!(dev.take_kick(&sys));
        dev.ack(&sys, 0, 0);
        assert!(
            !dev.take_kick(&sys),
            "an unchanged acknowledgement is no news"
        );
        dev.rx_control(&sys, 0, abi::REC_FIN);
        assert!(!dev.take_kick(&sys), "already kicked in this idle period");
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::IDLE_GEN)
            .store(2, Ordering::Release);
        dev.rx_control(&sys, 0, abi::REC_FIN);
        assert!(dev.take_kick(&sys));
    }

    /// A guest that announced it is idle, and its fresh host side.
    fn idle_guest() -> (Mapping, StreamDevice) {
        let sys = sys();
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::GUEST_IDLE)
            .store(1, Ordering::Release);
        (sys, StreamDevice::default())
    }

    #[test]
    fn an_open_alone_does_not_wake_the_guest_its_request_does() {
        let (sys, mut dev) = idle_guest();
        dev.rx_control(&sys, 0, abi::REC_OPEN);
        assert!(!dev.take_kick(&sys));
        dev.rx_reserve(&sys, 16).expect("room");
        dev.rx_commit(&sys, 0, abi::REC_DATA, 16);
        assert!(dev.take_kick(&sys));
    }

    #[test]
    fn tx_progress_kicks_only_a_guest_whose_output_waits_for_it() {
        let (sys, mut dev) = idle_guest();
        dev.ack(&sys, 0, 10);
        assert!(
            !dev.take_kick(&sys),
            "all its output sent: ring room is no news"
        );
        sys.atomic_u32(abi::RINGHDR_GPA + ring_hdr::TX_WAITING)
            .store(1, Ordering::Release);
        dev.ack(&sys, 0, 20);
        assert!(dev.take_kick(&sys), "output held back waits for it");
    }
}
