//! The cell's one listening socket. The parent steers every address of the
//! cell's VMs to it (`parent::steering`); a connection's local address says
//! which VM it is for. A VM, awake or asleep, has no socket of its own: its
//! accepted connections wait in its queue ([`Held`]) until it has a free
//! slot.

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;

pub use crate::config::HELD_PER_CELL;

/// Connections accepted for one VM and not yet given a slot. Past this a
/// new one is reset: a client flooding one VM takes at most this share of
/// [`HELD_PER_CELL`] (a listener per VM had a backlog of its own).
pub const HELD_PER_VM: usize = 256;
/// Connections accepted per turn of the loop before the others get theirs.
pub const ACCEPTS_PER_TURN: usize = 256;

/// How long the kernel holds a connection whose client has sent nothing
/// before the listener reports it (TCP_DEFER_ACCEPT, rounded up to its
/// first SYN-ACK retransmission).
const DEFER_ACCEPT_SECS: libc::c_int = 1;
/// Connections the socket queues. Deferred connections wait in the SYN
/// queue until their request arrives, and past this length the kernel
/// answers with SYN cookies, whose connections skip the deferral. The loop
/// drains the queue into the VMs' own queues, so it stays short.
const LISTEN_BACKLOG: i32 = 4096;

/// The cell's socket, bound to an ephemeral port of 127.0.0.1: only the
/// steering sends it connections for the VMs' addresses. Connections
/// accepted from it inherit TCP_NODELAY (Linux copies the option on
/// accept). With TCP_DEFER_ACCEPT a connection becomes acceptable when its
/// request arrives, so accepting it and reading the request take one
/// wake-up of the cell's loop instead of two.
pub fn listen() -> std::io::Result<mio::net::TcpListener> {
    listen_on(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
}

fn listen_on(addr: SocketAddrV4) -> std::io::Result<mio::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    // Accepted connections inherit it: once densevm is gone, their
    // TIME_WAIT remains do not keep anyone from listening on a VM's address.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    // SAFETY: an open socket and an int-sized option value that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&DEFER_ACCEPT_SECS as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(mio::net::TcpListener::from_std(socket.into()))
}

/// The VM id a connection was made to, from its local address (`addr_base`
/// is VM 0's); None for an address below the base or not IPv4.
pub fn vm_of(stream: &mio::net::TcpStream, addr_base: Ipv4Addr) -> Option<u32> {
    match stream.local_addr().ok()? {
        SocketAddr::V4(local) => u32::from(*local.ip()).checked_sub(u32::from(addr_base)),
        SocketAddr::V6(_) => None,
    }
}

/// Accepted connections waiting for a slot of their VM, by VM index: only
/// VMs with some have a queue.
#[derive(Default)]
pub struct Held {
    queues: HashMap<usize, VecDeque<mio::net::TcpStream>>,
    total: usize,
}

impl Held {
    /// Queues `stream` for VM `vm`, or resets it if the VM holds
    /// [`HELD_PER_VM`] or the cell [`HELD_PER_CELL`] already. True if queued.
    pub fn hold(&mut self, vm: usize, stream: mio::net::TcpStream) -> bool {
        let queue = self.queues.entry(vm).or_default();
        if queue.len() >= HELD_PER_VM || self.total >= HELD_PER_CELL {
            if queue.is_empty() {
                self.queues.remove(&vm);
            }
            refuse(stream);
            return false;
        }
        queue.push_back(stream);
        self.total += 1;
        true
    }

    /// Whether a connection waits for VM `vm`.
    pub fn waits(&self, vm: usize) -> bool {
        self.queues.contains_key(&vm)
    }

    /// The oldest connection waiting for VM `vm`.
    pub fn take(&mut self, vm: usize) -> Option<mio::net::TcpStream> {
        let queue = self.queues.get_mut(&vm)?;
        let stream = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(&vm);
        }
        self.total -= stream.is_some() as usize;
        stream
    }

    /// Answers every connection waiting for VM `vm` [`UNAVAILABLE`] and
    /// closes it (the VM is gone).
    pub fn drop_vm(&mut self, vm: usize) {
        if let Some(queue) = self.queues.remove(&vm) {
            self.total -= queue.len();
            queue.into_iter().for_each(turn_away);
        }
    }

    /// Connections waiting, in the whole cell.
    pub fn len(&self) -> usize {
        self.total
    }
}

/// What a client whose VM stopped before answering it gets (a VM whose
/// wake failed, or that was destroyed or crashed): a clear error, not an
/// empty reply. The client is not told why; the VM's listing says.
pub const UNAVAILABLE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 18\r\nConnection: close\r\n\r\nVM is not running\n";

/// Most bytes of a turned-away connection's request read before it is
/// answered.
const TURN_AWAY_READ: usize = 64 << 10;

/// Answers a held connection [`UNAVAILABLE`] and closes it. Its request is
/// read first, at most [`TURN_AWAY_READ`] bytes: closing over unread bytes
/// sends a reset, which can overtake the answer.
pub fn turn_away(mut stream: mio::net::TcpStream) {
    use std::io::{Read, Write};
    let mut buf = [0u8; 4096];
    let mut read = 0;
    while read < TURN_AWAY_READ {
        match stream.read(&mut buf) {
            Ok(n) if n > 0 => read += n,
            _ => break,
        }
    }
    let _ = stream.write(UNAVAILABLE);
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Closes `stream` with a reset: the client learns at once that it was
/// turned away.
pub fn refuse(stream: mio::net::TcpStream) {
    let _ = socket2::SockRef::from(&stream).set_linger(Some(std::time::Duration::ZERO));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn accept(listener: &mio::net::TcpListener) -> mio::net::TcpStream {
        loop {
            match listener.accept() {
                Ok((stream, _)) => return stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("accept: {e}"),
            }
        }
    }

    #[test]
    fn an_accepted_connection_has_nodelay_and_names_its_vm() {
        let listener = listen().unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.write_all(b"GET /").unwrap();
        let accepted = accept(&listener);
        assert!(accepted.nodelay().unwrap());
        assert_eq!(vm_of(&accepted, Ipv4Addr::new(127, 0, 0, 0)), Some(1));
        assert_eq!(vm_of(&accepted, Ipv4Addr::new(127, 0, 0, 2)), None);
    }

    #[test]
    fn a_connection_is_accepted_once_its_request_arrives() {
        let listener = listen().unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let early = listener.accept().map(|_| ()).unwrap_err();
        assert_eq!(early.kind(), std::io::ErrorKind::WouldBlock);
        client.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut accepted = accept(&listener);
        socket2::SockRef::from(&accepted)
            .set_nonblocking(false)
            .unwrap();
        let mut request = [0u8; 18];
        accepted.read_exact(&mut request).unwrap();
        assert_eq!(&request, b"GET / HTTP/1.0\r\n\r\n");
    }

    fn connected(listener: &mio::net::TcpListener) -> (std::net::TcpStream, mio::net::TcpStream) {
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.write_all(b"x").unwrap();
        let accepted = accept(listener);
        (client, accepted)
    }

    fn assert_reset(client: &mut std::net::TcpStream) {
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let reset = client.read(&mut [0u8; 1]).unwrap_err();
        assert_eq!(reset.kind(), std::io::ErrorKind::ConnectionReset);
    }

    /// A connection waiting for a VM that goes away is answered 503, its
    /// request read first so that the close sends no reset over the answer.
    #[test]
    fn connections_held_for_a_vm_that_goes_are_answered_503() {
        let listener = listen().unwrap();
        let mut held = Held::default();
        let (mut client, accepted) = connected(&listener);
        client.write_all(&[b'x'; 10_000]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(held.hold(3, accepted));
        held.drop_vm(3);
        assert_eq!(held.len(), 0);
        client
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).unwrap();
        assert_eq!(answer, UNAVAILABLE);
        let (head, rest) = std::str::from_utf8(UNAVAILABLE)
            .unwrap()
            .split_once("\r\n\r\n")
            .unwrap();
        assert!(
            head.contains(&format!("Content-Length: {}", rest.len())),
            "{head}"
        );
    }

    #[test]
    fn a_vm_holds_at_most_its_share_and_the_cell_its_own() {
        let listener = listen().unwrap();
        let mut held = Held::default();
        let mut clients = Vec::new();
        for _ in 0..HELD_PER_VM {
            let (client, accepted) = connected(&listener);
            clients.push(client);
            assert!(held.hold(0, accepted));
        }
        let (mut over, accepted) = connected(&listener);
        assert!(!held.hold(0, accepted), "past its share");
        assert_reset(&mut over);
        // Other VMs fill the rest of the cell's room, then nobody gets more.
        let mut vm = 1;
        while held.len() < HELD_PER_CELL {
            let (client, accepted) = connected(&listener);
            clients.push(client);
            assert!(held.hold(vm, accepted));
            vm += (held.len() % HELD_PER_VM == 0) as usize;
        }
        let (mut over, accepted) = connected(&listener);
        assert!(!held.hold(vm + 1, accepted), "past the cell's room");
        assert_reset(&mut over);
        // What a VM's queue gives back, and what its end closes, is room again.
        assert!(held.take(0).is_some());
        held.drop_vm(1);
        assert_eq!(held.len(), HELD_PER_CELL - 1 - HELD_PER_VM);
        let (_client, accepted) = connected(&listener);
        assert!(held.hold(vm + 1, accepted));
    }
}
