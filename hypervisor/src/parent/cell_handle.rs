//! The parent's side of its cells: starting one, the handshake that hands
//! its guest memory to the pager, and the link it is driven through.

use crate::config::CellSettings;
use crate::link::framing::{FrameError, LineStream};
use crate::link::protocol::{CellConfig, FromCell, Hello, ToCell, MAX_LINK_LINE};
use paging_policy::{Pager, PagerError, SpaceHandoff, SpaceId};
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Longest a cell may take to start and hand over its memory.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// A step of a cell's start that failed.
#[derive(Debug, thiserror::Error)]
pub enum StartFailure {
    /// The link could not be made.
    #[error("socketpair: {0}")]
    Socketpair(io::Error),
    /// The process could not be started.
    #[error("start: {0}")]
    Spawn(io::Error),
    /// Its configuration could not be sent.
    #[error("send its configuration: {0}")]
    SendConfig(io::Error),
    /// The link could not be set up.
    #[error("link: {0}")]
    Link(io::Error),
    /// Its hello could not be received.
    #[error("receive its memory: {0}")]
    Receive(io::Error),
    /// The process ended during start-up (how, in words).
    #[error("{0}")]
    Ended(String),
    /// The link closed during start-up.
    #[error("closed the link during start-up")]
    Closed,
    /// The cell could not start, and said why.
    #[error("{0}")]
    Refused(String),
    /// Its hello could not be read.
    #[error("bad hello: {0}")]
    BadHello(serde_json::Error),
    /// Its hello lacks descriptors.
    #[error("its hello lacks the guest-memory descriptors")]
    NoDescriptors,
    /// The pager refused its memory or a VM.
    #[error(transparent)]
    Pager(#[from] PagerError),
    /// A VM's slot is in no space the cell sent.
    #[error("VM {0}: no space")]
    NoSpace(u32),
    /// It could not be told to boot.
    #[error("start it: {0}")]
    Go(io::Error),
}

/// A cell that could not be started or handed over.
#[derive(Debug, thiserror::Error)]
#[error("cell {cell}: {failure}")]
pub struct CellStartError {
    /// Its index.
    pub cell: u32,
    /// The step that failed.
    pub failure: StartFailure,
}

/// A cell started but not yet handed over.
pub struct PendingCell {
    index: u32,
    child: Child,
    link: UnixStream,
    first_id: u32,
    count: u32,
    capacity: u32,
}

impl PendingCell {
    /// Starts `densevm cell` for VMs `first_id..first_id + count`, with room
    /// for `capacity`, and sends it its configuration.
    pub fn spawn(
        settings: &CellSettings,
        index: u32,
        first_id: u32,
        count: u32,
        capacity: u32,
    ) -> Result<PendingCell, CellStartError> {
        let failed = |failure| CellStartError {
            cell: index,
            failure,
        };
        let (ours, theirs) = UnixStream::pair().map_err(|e| failed(StartFailure::Socketpair(e)))?;
        // This very binary, even if the file was replaced since it started.
        let child = Command::new("/proc/self/exe")
            .arg0("densevm")
            .arg("cell")
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| failed(StartFailure::Spawn(e)))?;
        let config = CellConfig {
            settings: settings.clone(),
            cell: index,
            parent_pid: std::process::id(),
            first_id,
            count,
            capacity,
        };
        let mut line = serde_json::to_vec(&config).expect("config serializes");
        line.push(b'\n');
        let mut cell = PendingCell {
            index,
            child,
            link: ours,
            first_id,
            count,
            capacity,
        };
        if let Err(e) = (&cell.link).write_all(&line) {
            let _ = cell.child.kill();
            let _ = cell.child.wait();
            return Err(failed(StartFailure::SendConfig(e)));
        }
        Ok(cell)
    }

    /// Receives the cell's guest memory, gives it to the pager with the
    /// cell's VMs, and lets the cell boot them.
    pub fn handshake(mut self, pager: &Pager, ram_bytes: usize) -> Result<Cell, CellStartError> {
        let handed = self.try_handshake(pager, ram_bytes).and_then(|handed| {
            self.link
                .set_nonblocking(true)
                .map_err(StartFailure::Link)?;
            Ok(handed)
        });
        match handed {
            Ok((spaces, holder_vms)) => {
                let link = mio::net::UnixStream::from_std(self.link);
                Ok(Cell {
                    index: self.index,
                    pid: self.child.id(),
                    child: self.child,
                    link: LineStream::new(link, MAX_LINK_LINE),
                    spaces,
                    holder_vms,
                    first_id: self.first_id,
                    count: self.count,
                    capacity: self.capacity,
                    booted: None,
                    dead: None,
                })
            }
            Err(failure) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(CellStartError {
                    cell: self.index,
                    failure,
                })
            }
        }
    }

    fn try_handshake(
        &mut self,
        pager: &Pager,
        ram_bytes: usize,
    ) -> Result<(Vec<SpaceId>, u32), StartFailure> {
        self.link
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(StartFailure::Link)?;
        let mut buf = vec![0u8; 4096];
        let mut fds = [-1; MAX_HELLO_FDS];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the iovec points into `buf`, which outlives the call.
        let (bytes, nfds) = unsafe { self.link.recv_with_fds(&mut iov, &mut fds) }
            .map_err(|e| StartFailure::Receive(e.into()))?;
        // SAFETY: descriptors received are ours to own.
        let received: Vec<OwnedFd> = fds[..nfds]
            .iter()
            .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
            .collect();
        if bytes == 0 {
            return Err(self
                .exit_reason()
                .map_or(StartFailure::Closed, StartFailure::Ended));
        }
        let mut hello = buf[..bytes].to_vec();
        while !hello.ends_with(b"\n") {
            let n = self.link.read(&mut buf).map_err(StartFailure::Receive)?;
            if n == 0 {
                return Err(StartFailure::Closed);
            }
            hello.extend_from_slice(&buf[..n]);
        }
        // A cell that failed to start sends its reason instead of a hello.
        if let Ok(FromCell::Failed { error }) = serde_json::from_slice::<FromCell>(&hello) {
            return Err(StartFailure::Refused(error));
        }
        let hello: Hello = serde_json::from_slice(&hello).map_err(StartFailure::BadHello)?;
        if received.len() != 2 * hello.spaces.len() || hello.holder_vms == 0 {
            return Err(StartFailure::NoDescriptors);
        }
        let mut spaces = Vec::with_capacity(hello.spaces.len());
        let mut fds = received.into_iter();
        for space in &hello.spaces {
            let (Some(uffd), Some(memfd)) = (fds.next(), fds.next()) else {
                unreachable!("two descriptors a space, checked above")
            };
            let handoff = SpaceHandoff {
                uffd,
                memfd,
                base: space.base,
                len: space.len,
            };
            match pager.attach_space(handoff) {
                Ok(id) => spaces.push(id),
                Err(e) => {
                    spaces.iter().for_each(|&s| pager.detach_space(s));
                    return Err(e.into());
                }
            }
        }
        for i in 0..self.count {
            let (space, offset) = space_of(&spaces, hello.holder_vms, i, ram_bytes);
            let registered = space
                .ok_or(StartFailure::NoSpace(self.first_id + i))
                .and_then(|space| {
                    pager
                        .register_vm(self.first_id + i, space, offset, ram_bytes)
                        .map_err(StartFailure::from)
                });
            if let Err(e) = registered {
                spaces.iter().for_each(|&s| pager.detach_space(s));
                return Err(e);
            }
        }
        let mut go = serde_json::to_vec(&ToCell::Go).expect("serializes");
        go.push(b'\n');
        self.link.write_all(&go).map_err(StartFailure::Go)?;
        Ok((spaces, hello.holder_vms))
    }

    fn exit_reason(&mut self) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(describe_exit(status));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

/// Descriptors a cell's hello may carry (SCM_RIGHTS takes at most 253).
const MAX_HELLO_FDS: usize = 253;

/// The space holding a cell's slot `slot`, and the slot's offset in it.
fn space_of(
    spaces: &[SpaceId],
    holder_vms: u32,
    slot: u32,
    ram_bytes: usize,
) -> (Option<SpaceId>, usize) {
    let space = spaces.get((slot / holder_vms) as usize).copied();
    (space, (slot % holder_vms) as usize * ram_bytes)
}

/// How a cell process ended, in words.
pub fn describe_exit(status: std::process::ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => "ended".into(),
    }
}

/// A running cell, as the parent holds it.
pub struct Cell {
    /// Its index.
    pub index: u32,
    /// Its pid.
    pub pid: u32,
    child: Child,
    /// The link (registered with the parent's event loop).
    pub link: LineStream<mio::net::UnixStream>,
    /// Its holders' guest memory in the pager, until it is detached.
    pub spaces: Vec<SpaceId>,
    /// VMs per holder: slot `i` is in `spaces[i / holder_vms]`.
    pub holder_vms: u32,
    /// Id of its first VM.
    pub first_id: u32,
    /// VMs it holds (ids `first_id..first_id + count`).
    pub count: u32,
    /// VMs it can hold.
    pub capacity: u32,
    /// Its first boot's outcome: (ready, failed).
    pub booted: Option<(u32, u32)>,
    /// Why it is gone, once it is.
    pub dead: Option<String>,
}

impl Cell {
    /// The pager space and offset of the cell's VM `id`.
    pub fn space_of(&self, id: u32, ram_bytes: usize) -> (Option<SpaceId>, usize) {
        space_of(&self.spaces, self.holder_vms, id - self.first_id, ram_bytes)
    }

    /// Whether VM `id` is one of this cell's.
    pub fn holds(&self, id: u32) -> bool {
        id >= self.first_id && id < self.first_id + self.count
    }

    /// Queues a request and writes what the socket takes.
    pub fn send(&mut self, request: &ToCell) -> Result<(), FrameError> {
        let line = serde_json::to_vec(request).expect("requests serialize");
        self.link.queue(&line);
        self.link.flush()?;
        Ok(())
    }

    /// Waits for the process to end after its link closed (or kills it after
    /// `grace`); returns how it ended.
    pub fn reap(&mut self, grace: Duration) -> String {
        let deadline = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return describe_exit(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    return self
                        .child
                        .wait()
                        .map(describe_exit)
                        .unwrap_or_else(|e| format!("lost: {e}"));
                }
                Err(e) => return format!("lost: {e}"),
            }
        }
    }

    /// Kills the process at once (the run is failing).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
