//! Descriptors passed between densevm's processes with SCM_RIGHTS: a cell's
//! guest memory to the parent (at its start, and a restarted holder's
//! userfaultfd later, [`FdStream`]), a holder's VMs to its cell.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message carries (SCM_RIGHTS' limit).
pub const MAX_FDS: usize = 253;

/// Receives one message on `socket` and the descriptors attached to it,
/// each close-on-exec from the start (MSG_CMSG_CLOEXEC), so that none can
/// leak into a process started later. One `recvmsg`: EINTR and EWOULDBLOCK
/// come back as errors for the caller to handle. A message whose bytes or
/// descriptors did not fit (the kernel then closes the extra descriptors)
/// is an error.
pub fn recv_with_fds(socket: &impl AsRawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    const SPACE: usize = MAX_FDS * std::mem::size_of::<RawFd>();
    // u64 words keep the control buffer aligned for cmsghdr; the extra words
    // hold the header.
    let mut control = [0u64; SPACE.div_ceil(8) + 4];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is a valid empty header; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: msg points at live buffers for the whole call.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walks the control buffer as the kernel filled it, by its own macros.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let header = libc::CMSG_LEN(0) as usize;
                let count = ((*cmsg).cmsg_len as usize).saturating_sub(header)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    // Descriptors received are ours to own.
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::other("truncated message"));
    }
    Ok((n as usize, fds))
}

/// Descriptors an [`FdStream`] keeps unclaimed; more are closed at once.
/// A cell's holders have at most one `holder_started` each outstanding (the
/// next waits for `holder_attached`), so an honest cell never has more.
/// With 4, five holders restarted in a burst while the parent was busy
/// lost the fifth's userfaultfd, and the parent stopped the cell as
/// hostile (`hibernation_integrity.py`, wsswap: 586 failed requests).
pub const MAX_KEPT: usize = crate::config::MAX_HOLDERS as usize;

/// The parent's end of a cell link: a stream socket whose reads keep the
/// descriptors that came with the bytes, in order, for the message that
/// claims them ([`FdStream::take_fd`]). A cell sends one with the line that
/// needs it; a hostile cell that sends more gets them closed past
/// [`MAX_KEPT`], and one that sends none gets a refusal.
#[derive(Debug)]
pub struct FdStream {
    stream: mio::net::UnixStream,
    received: VecDeque<OwnedFd>,
}

impl FdStream {
    /// Wraps the parent's end of a cell link.
    pub fn new(stream: mio::net::UnixStream) -> Self {
        FdStream {
            stream,
            received: VecDeque::new(),
        }
    }

    /// The oldest descriptor received and not yet claimed.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.received.pop_front()
    }
}

impl io::Read for FdStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let (n, fds) = recv_with_fds(&self.stream, buf)?;
        for fd in fds {
            if self.received.len() < MAX_KEPT {
                self.received.push_back(fd);
            }
        }
        Ok(n)
    }
}

impl io::Write for FdStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

impl AsRawFd for FdStream {
    fn as_raw_fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

impl mio::event::Source for FdStream {
    fn register(
        &mut self,
        registry: &mio::Registry,
        token: mio::Token,
        interests: mio::Interest,
    ) -> io::Result<()> {
        self.stream.register(registry, token, interests)
    }

    fn reregister(
        &mut self,
        registry: &mio::Registry,
        token: mio::Token,
        interests: mio::Interest,
    ) -> io::Result<()> {
        self.stream.reregister(registry, token, interests)
    }

    fn deregister(&mut self, registry: &mio::Registry) -> io::Result<()> {
        self.stream.deregister(registry)
    }
}

#[cfg(test)]
mod tests {
    use super::recv_with_fds;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;

    #[test]
    fn descriptors_received_are_close_on_exec() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        a.send_with_fds(&[&b"hi\n"[..]], &[file.as_raw_fd()])
            .unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fds(&b, &mut buf).unwrap();
        assert_eq!((n, fds.len()), (3, 1));
        // SAFETY: F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(fds[0].as_raw_fd(), libc::F_GETFD) };
        assert_ne!(flags & libc::FD_CLOEXEC, 0);
    }

    /// A peer, our non-blocking stream from it, and a file to send.
    fn stream_with_a_file() -> (UnixStream, super::FdStream, std::fs::File) {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let ours = super::FdStream::new(mio::net::UnixStream::from_std(b));
        (a, ours, std::fs::File::open("/dev/null").unwrap())
    }

    #[test]
    fn a_stream_keeps_what_came_with_its_bytes_up_to_its_bound() {
        use super::MAX_KEPT;
        use std::io::Read;
        let (a, mut ours, file) = stream_with_a_file();
        let many = vec![file.as_raw_fd(); MAX_KEPT + 2];
        a.send_with_fds(&[&b"x\n"[..]], &many).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(ours.read(&mut buf).unwrap(), 2);
        for _ in 0..MAX_KEPT {
            assert!(ours.take_fd().is_some());
        }
        assert!(ours.take_fd().is_none(), "kept past its bound");
    }

    /// Every holder of a cell restarted at once: each line's descriptor is
    /// there when the lines are read in one go.
    #[test]
    fn a_burst_of_one_descriptor_a_line_from_every_holder_loses_none() {
        use std::io::Read;
        let (a, mut ours, file) = stream_with_a_file();
        let holders = crate::config::MAX_HOLDERS as usize;
        for _ in 0..holders {
            a.send_with_fds(&[&b"started\n"[..]], &[file.as_raw_fd()])
                .unwrap();
        }
        let mut buf = [0u8; 64];
        let mut read = 0;
        while let Ok(n) = ours.read(&mut buf) {
            read += n;
        }
        assert_eq!(read, holders * b"started\n".len());
        for holder in 0..holders {
            assert!(
                ours.take_fd().is_some(),
                "holder {holder}'s descriptor lost"
            );
        }
    }
}
