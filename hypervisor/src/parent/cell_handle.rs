//! The parent's side of its cells: starting one, the handshake that hands
//! its guest memory to the pager, and the link it is driven through.
//!
//! A cell is untrusted input: its hello is checked against what the parent
//! asked for ([`HelloError`]), descriptors arrive close-on-exec, every wait
//! has a deadline ([`deadline`]), and a cell is started with every
//! descriptor of the parent above stderr closed.

use super::steering::{Steering, SteeringError};
use crate::config::CellSettings;
use crate::link::fds::{self, recv_with_fds, FdStream};
use crate::link::framing::{FrameError, LineStream};
use crate::link::idle_profile::IdleProfile;
use crate::link::protocol::{
    deadline, CellConfig, FromCell, Hello, Request, ToCell, MAX_LINK_LINE,
};
use paging_policy::{Pager, PagerError, SpaceHandoff, SpaceId};
use std::io::{self, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest hello accepted (126 spaces take about 6 KiB).
const MAX_HELLO: usize = 64 << 10;
/// Longest message of a cell quoted in a reason.
const MAX_QUOTED: usize = 200;

/// A hello that does not match the cell the parent started.
#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    /// It is not JSON of a hello.
    #[error("unreadable: {0}")]
    Unreadable(serde_json::Error),
    /// Longer than [`MAX_HELLO`] bytes.
    #[error("longer than {MAX_HELLO} bytes")]
    TooLong,
    /// Another pid than the child's.
    #[error("pid {said}, but the cell is {actual}")]
    Pid {
        /// What it said.
        said: u32,
        /// The child's.
        actual: u32,
    },
    /// No VM per holder.
    #[error("{holder_vms} VMs per holder for a capacity of {capacity}")]
    HolderVms {
        /// What it said.
        holder_vms: u32,
        /// The cell's capacity.
        capacity: u32,
    },
    /// Not one space per holder.
    #[error("{spaces} spaces where its {capacity} slots need {needed}")]
    Spaces {
        /// How many it sent.
        spaces: usize,
        /// The cell's capacity.
        capacity: u32,
        /// How many the slots need.
        needed: u64,
    },
    /// Not a userfaultfd per space, then the guest-RAM memfd and the cell's
    /// socket.
    #[error("{fds} descriptors for {spaces} spaces (a userfaultfd each, then the memfd and the cell's socket)")]
    Descriptors {
        /// How many came.
        fds: usize,
        /// Spaces it sent.
        spaces: usize,
    },
    /// A space that is not whole pages, overlaps another or has the wrong length.
    #[error("space {space}: {base:#x}+{len:#x} {why}")]
    Space {
        /// Its index.
        space: usize,
        /// Its base.
        base: usize,
        /// Its length.
        len: usize,
        /// What is wrong.
        why: &'static str,
    },
    /// Another platform than the parent's.
    #[error("platform {said:?}, but the host is {actual:?}")]
    Platform {
        /// What it said (cut short).
        said: String,
        /// The parent's.
        actual: &'static str,
    },
}

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
    /// No hello within the deadline.
    #[error("no hello within {} s", deadline::CELL_HELLO.as_secs())]
    Timeout,
    /// The process ended during start-up (how, in words).
    #[error("{0}")]
    Ended(String),
    /// The link closed during start-up.
    #[error("closed the link during start-up")]
    Closed,
    /// The cell could not start, and said why.
    #[error("{0}")]
    Refused(String),
    /// Its hello does not fit the cell.
    #[error("bad hello: {0}")]
    BadHello(#[from] HelloError),
    /// The pager refused its memory or a VM.
    #[error(transparent)]
    Pager(#[from] PagerError),
    /// Its socket or its addresses could not be steered.
    #[error(transparent)]
    Steering(#[from] SteeringError),
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

/// `text` cut to [`MAX_QUOTED`] bytes and one line, for a reason.
pub fn quote(text: &str) -> String {
    let mut end = text.len().min(MAX_QUOTED);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let cut: String = text[..end]
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if end < text.len() {
        format!("{cut}...")
    } else {
        cut
    }
}

/// A cell started but not yet handed over.
pub struct PendingCell {
    index: u32,
    child: Child,
    link: UnixStream,
    first_id: u32,
    count: u32,
    capacity: u32,
    addr_base: Ipv4Addr,
}

impl PendingCell {
    /// Starts `densevm cell` for VMs `first_id..first_id + count`, with room
    /// for `capacity`, and sends it its configuration. The cell inherits
    /// stdin (its link), stderr and nothing else: every other descriptor of
    /// the parent (other cells' links, userfaultfds and guest memory, the
    /// swap, the control socket) is close-on-exec in it.
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
        let mut command = Command::new("/proc/self/exe");
        command
            .arg0("densevm")
            .arg("cell")
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        // SAFETY: runs in the child between fork and exec, after its stdio
        // is in place; close_range is async-signal-safe. CLOEXEC rather
        // than closing keeps the descriptor std reports a failed exec on.
        unsafe {
            command.pre_exec(|| {
                let rc = libc::syscall(
                    libc::SYS_close_range,
                    3u32,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                );
                if rc != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // This very binary, even if the file was replaced since it started.
        let child = command
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
            addr_base: settings.addr_base,
        };
        let sent = cell
            .link
            .set_write_timeout(Some(deadline::CELL_HELLO))
            .and_then(|()| (&cell.link).write_all(&line));
        if let Err(e) = sent {
            let _ = cell.child.kill();
            let _ = cell.child.wait();
            return Err(failed(StartFailure::SendConfig(e)));
        }
        Ok(cell)
    }

    /// Receives the cell's guest memory and socket, gives the memory to the
    /// pager with the cell's VMs, steers their addresses to the socket, and
    /// lets the cell boot them. Waits at most [`deadline::CELL_HELLO`] (or
    /// until `by`, if sooner) for the hello. On any failure the cell is
    /// killed and nothing stays registered or steered.
    pub fn handshake(
        mut self,
        pager: &Pager,
        steering: &mut Steering,
        ram_bytes: usize,
        platform: &'static str,
        by: Option<Instant>,
    ) -> Result<Cell, CellStartError> {
        let mut by_then = Instant::now() + deadline::CELL_HELLO;
        if let Some(by) = by {
            by_then = by_then.min(by);
        }
        let handed = self
            .try_handshake(pager, steering, ram_bytes, platform, by_then)
            .and_then(|handed| {
                if let Err(e) = self.link.set_nonblocking(true) {
                    handed.0.iter().for_each(|&s| pager.detach_space(s));
                    return Err(StartFailure::Link(e));
                }
                Ok(handed)
            });
        match handed {
            Ok((spaces, holder_vms)) => {
                let link = FdStream::new(mio::net::UnixStream::from_std(self.link));
                Ok(Cell {
                    index: self.index,
                    pid: self.child.id(),
                    child: self.child,
                    link: Some(LineStream::new(link, MAX_LINK_LINE)),
                    spaces,
                    holder_vms,
                    first_id: self.first_id,
                    count: self.count,
                    capacity: self.capacity,
                    booted: None,
                    dead: None,
                    next_request: 1,
                    forgotten: Vec::new(),
                    idle: None,
                    stopped: Vec::new(),
                })
            }
            Err(failure) => {
                for id in self.first_id..self.first_id + self.count {
                    steering.unroute(self.addr_of(id));
                }
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(CellStartError {
                    cell: self.index,
                    failure,
                })
            }
        }
    }

    /// Waits for the link to be readable until `by`.
    fn wait_readable(&self, by: Instant) -> Result<(), StartFailure> {
        loop {
            let left = by.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StartFailure::Timeout);
            }
            let mut fds = [libc::pollfd {
                fd: self.link.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, left.as_millis().min(1000) as i32) };
            if n > 0 {
                return Ok(());
            }
        }
    }

    fn try_handshake(
        &mut self,
        pager: &Pager,
        steering: &mut Steering,
        ram_bytes: usize,
        platform: &'static str,
        by: Instant,
    ) -> Result<(Vec<SpaceId>, u32), StartFailure> {
        self.wait_readable(by)?;
        let mut buf = vec![0u8; 4096];
        // Close-on-exec on receipt: no cell started later inherits them.
        let (bytes, received) = loop {
            match recv_with_fds(&self.link, &mut buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                received => break received.map_err(StartFailure::Receive)?,
            }
        };
        if bytes == 0 {
            return Err(self
                .exit_reason()
                .map_or(StartFailure::Closed, StartFailure::Ended));
        }
        let mut hello = buf[..bytes].to_vec();
        while !hello.ends_with(b"\n") {
            if hello.len() > MAX_HELLO {
                return Err(HelloError::TooLong.into());
            }
            self.wait_readable(by)?;
            let n = match self.link.read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(StartFailure::Receive(e)),
            };
            if n == 0 {
                return Err(StartFailure::Closed);
            }
            hello.extend_from_slice(&buf[..n]);
        }
        // A cell that failed to start sends its reason instead of a hello.
        if let Ok(FromCell::Failed { error }) = serde_json::from_slice::<FromCell>(&hello) {
            return Err(StartFailure::Refused(quote(&error)));
        }
        let hello: Hello = serde_json::from_slice(&hello).map_err(HelloError::Unreadable)?;
        check_hello(
            &hello,
            self.child.id(),
            self.capacity,
            received.len(),
            ram_bytes,
            platform,
        )?;
        let mut spaces = Vec::with_capacity(hello.spaces.len());
        let handed = self.hand_over(pager, steering, &hello, received, ram_bytes, &mut spaces);
        if let Err(e) = handed {
            // Detaching a space unregisters every VM registered in it.
            spaces.iter().for_each(|&s| pager.detach_space(s));
            return Err(e);
        }
        Ok((spaces, hello.holder_vms))
    }

    /// Attaches the spaces (pushed to `spaces` as they are), registers the
    /// VMs, steers their addresses to the cell's socket and tells the cell
    /// to boot them.
    fn hand_over(
        &mut self,
        pager: &Pager,
        steering: &mut Steering,
        hello: &Hello,
        received: Vec<OwnedFd>,
        ram_bytes: usize,
        spaces: &mut Vec<SpaceId>,
    ) -> Result<(), StartFailure> {
        let mut fds = received.into_iter();
        let uffds: Vec<OwnedFd> = fds.by_ref().take(hello.spaces.len()).collect();
        let (Some(memfd), Some(listener)) = (fds.next(), fds.next()) else {
            unreachable!("the memfd and the socket follow the spaces, checked by check_hello")
        };
        // One memfd for every holder's part: each part is a slice of it, at
        // the slots before it.
        let memfd = std::sync::Arc::new(memfd);
        let mut memfd_offset = 0;
        for (space, uffd) in hello.spaces.iter().zip(uffds) {
            let handoff = SpaceHandoff {
                uffd,
                memfd: std::sync::Arc::clone(&memfd),
                memfd_offset,
                base: space.base,
                len: space.len,
            };
            spaces.push(pager.attach_space(handoff)?);
            memfd_offset += space.len;
        }
        // The map keeps the socket; the cell's copy is its only descriptor.
        steering.add_cell(self.index, &listener)?;
        drop(listener);
        for i in 0..self.count {
            let (space, offset) = space_of(spaces, hello.holder_vms, i, ram_bytes);
            let space = space.expect("every slot has a space, checked by check_hello");
            pager.register_vm(self.first_id + i, space, offset, ram_bytes)?;
            steering.route(self.addr_of(self.first_id + i), self.index)?;
        }
        let mut go = serde_json::to_vec(&Request {
            id: 0,
            req: ToCell::Go,
        })
        .expect("serializes");
        go.push(b'\n');
        self.link.write_all(&go).map_err(StartFailure::Go)
    }

    fn addr_of(&self, id: u32) -> Ipv4Addr {
        crate::config::vm_addr(self.addr_base, id)
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

/// Checks a cell's hello against what the parent started it for: its pid,
/// one whole-page space per holder of `holder_vms` slots, as long as those
/// slots, not overlapping; a userfaultfd a space, then the memfd and the
/// socket; the host's platform.
fn check_hello(
    hello: &Hello,
    pid: u32,
    capacity: u32,
    fds: usize,
    ram_bytes: usize,
    platform: &'static str,
) -> Result<(), HelloError> {
    if hello.pid != pid {
        return Err(HelloError::Pid {
            said: hello.pid,
            actual: pid,
        });
    }
    if hello.holder_vms == 0 {
        return Err(HelloError::HolderVms {
            holder_vms: hello.holder_vms,
            capacity,
        });
    }
    let needed = capacity.div_ceil(hello.holder_vms) as u64;
    if hello.spaces.len() as u64 != needed || hello.spaces.len() > fds::MAX_FDS - 2 {
        return Err(HelloError::Spaces {
            spaces: hello.spaces.len(),
            capacity,
            needed,
        });
    }
    if fds != hello.spaces.len() + 2 {
        return Err(HelloError::Descriptors {
            fds,
            spaces: hello.spaces.len(),
        });
    }
    let page = 4096;
    let mut taken: Vec<(usize, usize)> = Vec::with_capacity(hello.spaces.len());
    for (h, space) in hello.spaces.iter().enumerate() {
        let bad = |why| HelloError::Space {
            space: h,
            base: space.base,
            len: space.len,
            why,
        };
        let slots = (capacity - h as u32 * hello.holder_vms).min(hello.holder_vms) as usize;
        if space.base == 0 || space.base % page != 0 || space.len % page != 0 {
            return Err(bad("is not whole pages"));
        }
        if Some(space.len) != slots.checked_mul(ram_bytes) {
            return Err(bad("is not as long as its slots"));
        }
        let Some(end) = space.base.checked_add(space.len) else {
            return Err(bad("wraps around"));
        };
        if taken.iter().any(|&(b, e)| space.base < e && b < end) {
            return Err(bad("overlaps another space"));
        }
        taken.push((space.base, end));
    }
    if hello.platform != platform {
        return Err(HelloError::Platform {
            said: quote(&hello.platform),
            actual: platform,
        });
    }
    Ok(())
}

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
    /// The link (registered with the parent's event loop), until the cell ends.
    pub link: Option<LineStream<FdStream>>,
    /// Its holders' guest memory in the pager, until it is detached.
    pub spaces: Vec<SpaceId>,
    /// VMs per holder: slot `i` is in `spaces[i / holder_vms]`.
    pub holder_vms: u32,
    /// Id of its first VM.
    pub first_id: u32,
    /// VMs it holds (ids `first_id..first_id + count`).
    pub count: u32,
    /// VMs it can hold: its slots, or as many as it holds once it failed
    /// to build some asked of it.
    pub capacity: u32,
    /// Its first boot's outcome: (ready, failed).
    pub booted: Option<(u32, u32)>,
    /// Why it is gone, once it is.
    pub dead: Option<String>,
    /// The id of the next request.
    next_request: u64,
    /// Once it is gone: which of its VMs were destroyed (forgotten).
    forgotten: Vec<bool>,
    /// VMs reported stopped, per holder (space).
    stopped: Vec<u32>,
    /// With `--max-live`: its latest report of its awake VMs.
    pub idle: Option<IdleProfile>,
}

impl Cell {
    /// The pager space and offset of the cell's VM `id`.
    pub fn space_of(&self, id: u32, ram_bytes: usize) -> (Option<SpaceId>, usize) {
        space_of(&self.spaces, self.holder_vms, id - self.first_id, ram_bytes)
    }

    /// Whether VM `id` is one of this cell's.
    pub fn holds(&self, id: u32) -> bool {
        id >= self.first_id && id - self.first_id < self.count
    }

    /// Queues a request and writes what the socket takes; returns the id
    /// its reply must carry.
    pub fn send(&mut self, request: &ToCell) -> Result<u64, FrameError> {
        let Some(link) = self.link.as_mut() else {
            return Err(FrameError::Closed);
        };
        let id = self.next_request;
        self.next_request += 1;
        let line = serde_json::to_vec(&Request {
            id,
            req: request.clone(),
        })
        .expect("requests serialize");
        link.queue(&line);
        link.flush()?;
        Ok(id)
    }

    /// Queues a notice (a request that gets no reply, id 0) and writes what
    /// the socket takes.
    pub fn notify(&mut self, notice: &ToCell) -> Result<(), FrameError> {
        let Some(link) = self.link.as_mut() else {
            return Err(FrameError::Closed);
        };
        let line = serde_json::to_vec(&Request {
            id: 0,
            req: notice.clone(),
        })
        .expect("requests serialize");
        link.queue(&line);
        link.flush()?;
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
                Ok(None) => return self.kill(),
                Err(e) => return format!("lost: {e}"),
            }
        }
    }

    /// Kills the process at once; returns how it ended.
    pub fn kill(&mut self) -> String {
        let _ = self.child.kill();
        self.child
            .wait()
            .map(describe_exit)
            .unwrap_or_else(|e| format!("lost: {e}"))
    }

    /// Forgets VM `id` of a cell that is gone (`destroy` of a crashed VM);
    /// false if it is not one of its VMs or was forgotten already.
    pub fn forget(&mut self, id: u32) -> bool {
        if self.dead.is_none() || !self.holds(id) {
            return false;
        }
        if self.forgotten.is_empty() {
            self.forgotten = vec![false; self.count as usize];
        }
        let slot = &mut self.forgotten[(id - self.first_id) as usize];
        !std::mem::replace(slot, true)
    }

    /// Counts VM `id` stopped. Returns its holder's space once every VM
    /// that space can hold was created and has stopped: ids are never
    /// reused, so no VM will run in it again, and the pager can let its
    /// descriptors go (a killed holder's, say, in a cell that lives on).
    pub fn note_stopped(&mut self, id: u32) -> Option<SpaceId> {
        let holder = ((id - self.first_id) / self.holder_vms.max(1)) as usize;
        let space = *self.spaces.get(holder)?;
        self.stopped.resize(self.spaces.len(), 0);
        self.stopped[holder] = self.stopped[holder].saturating_add(1);
        let stopped = self.stopped[holder];
        spent(
            holder as u32,
            self.holder_vms,
            self.capacity,
            self.count,
            stopped,
        )
        .then_some(space)
    }

    /// Forgets every VM of a cell that is gone (it was retired).
    pub fn forget_all(&mut self) {
        self.forgotten = vec![true; self.count as usize];
    }

    /// The VMs of a cell that is gone that are still listed (not forgotten).
    pub fn remembered(&self) -> impl Iterator<Item = u32> + '_ {
        (self.first_id..self.first_id + self.count).filter(|&id| {
            !self
                .forgotten
                .get((id - self.first_id) as usize)
                .copied()
                .unwrap_or(false)
        })
    }
}

/// Whether every slot of holder `holder` (of `holder_vms`, in a cell of
/// `capacity` slots of which `count` were used) was used and its VM stopped.
fn spent(holder: u32, holder_vms: u32, capacity: u32, count: u32, stopped: u32) -> bool {
    let first = holder.saturating_mul(holder_vms);
    let end = first.saturating_add(holder_vms).min(capacity);
    count >= end && stopped >= end.saturating_sub(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::protocol::Space;

    #[test]
    fn a_space_is_spent_once_its_every_slot_was_used_and_stopped() {
        assert!(spent(0, 20, 100, 100, 20));
        assert!(!spent(0, 20, 100, 100, 19), "one VM still runs");
        assert!(
            !spent(1, 20, 100, 30, 10),
            "create will still use its slots 30-39"
        );
        assert!(
            spent(4, 20, 90, 90, 10),
            "the last holder holds the 10 left"
        );
    }

    fn hello(holder_vms: u32, spaces: &[(usize, usize)]) -> Hello {
        Hello {
            pid: 7,
            holder_vms,
            spaces: spaces
                .iter()
                .map(|&(base, len)| Space { base, len })
                .collect(),
            platform: "kvm".into(),
        }
    }

    #[test]
    fn a_hello_that_fits_the_cell_is_accepted() {
        const RAM: usize = 1 << 20;
        let good = hello(8, &[(1 << 30, 8 * RAM), (2 << 30, 2 * RAM)]);
        check_hello(&good, 7, 10, 4, RAM, "kvm").unwrap();
    }

    #[test]
    fn a_hello_that_does_not_fit_the_cell_is_refused_with_a_reason() {
        const RAM: usize = 1 << 20;
        let base = 1 << 30;
        for (h, capacity, fds, platform, fragment) in [
            (hello(0, &[(base, RAM)]), 1, 3, "kvm", "VMs per holder"),
            (hello(8, &[(base, 8 * RAM)]), 10, 3, "kvm", "need 2"),
            (hello(8, &[(base, 8 * RAM)]), 8, 1, "kvm", "descriptors"),
            (hello(8, &[(base, 8 * RAM)]), 8, 2, "kvm", "descriptors"),
            (
                hello(4, &[(base, 4 * RAM), (base + 4 * RAM, 4 * RAM)]),
                8,
                5,
                "kvm",
                "descriptors",
            ),
            (hello(8, &[(base + 1, 8 * RAM)]), 8, 3, "kvm", "whole pages"),
            (hello(8, &[(base, 4 * RAM)]), 8, 3, "kvm", "as long as"),
            (
                hello(8, &[(usize::MAX - 4095, 8 * RAM)]),
                8,
                3,
                "kvm",
                "wraps",
            ),
            (
                hello(4, &[(base, 4 * RAM), (base + RAM, 4 * RAM)]),
                8,
                4,
                "kvm",
                "overlaps",
            ),
            (hello(8, &[(base, 8 * RAM)]), 8, 3, "pvm", "platform"),
        ] {
            let error = check_hello(&h, 7, capacity, fds, RAM, platform)
                .unwrap_err()
                .to_string();
            assert!(error.contains(fragment), "{error:?} lacks {fragment:?}");
        }
        let mut other = hello(8, &[(base, 8 * RAM)]);
        other.pid = 8;
        assert!(check_hello(&other, 7, 8, 3, RAM, "kvm").is_err());
    }

    #[test]
    fn quoted_text_is_one_short_line() {
        assert_eq!(quote("a\nb"), "a b");
        assert!(quote(&"é".repeat(500)).len() <= MAX_QUOTED + 3);
    }
}
