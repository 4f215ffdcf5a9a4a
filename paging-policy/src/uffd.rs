//! A minimal userfaultfd wrapper: missing-page and write-protect modes, on
//! anonymous or shared (memfd) memory. A descriptor serves the address space
//! that created it, from any process that holds it: a cell creates one for
//! its guest RAM and hands it to the pager.
//!
//! The ioctls are issued directly instead of through the `userfaultfd` crate
//! because the pager needs `UFFDIO_COPY_MODE_WP` (install a block already
//! write-protected, so that the first write to a clean block is seen without a
//! window in which it could slip through untracked), which that crate does
//! not expose.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::error::PagerError;

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_AA01;
const UFFDIO_WAKE: libc::c_ulong = 0x8010_AA02;
const UFFDIO_COPY: libc::c_ulong = 0xC028_AA03;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xC018_AA06;

const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
/// Write protection on shared memory (memfd) as well as anonymous.
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFDIO_REGISTER_MODE_WP: u64 = 2;
const UFFDIO_COPY_MODE_DONTWAKE: u64 = 1;
const UFFDIO_COPY_MODE_WP: u64 = 2;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1;
/// Bit of `_UFFDIO_WRITEPROTECT` in the `ioctls` mask returned by register.
const UFFDIO_WRITEPROTECT_BIT: u64 = 1 << 0x06;

const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1;
const UFFD_PAGEFAULT_FLAG_WP: u64 = 2;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct uffd_msg` restricted to what a page-fault message carries.
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    flags: u64,
    address: u64,
    ptid: u64,
}

/// Why a thread stopped on guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The page is not mapped (never installed or evicted).
    Missing {
        /// The access was a write.
        write: bool,
    },
    /// A write hit a write-protected page.
    WriteProtect,
}

/// One page fault read from the descriptor.
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    /// Faulting address (page-aligned).
    pub addr: usize,
    /// Missing page or write-protect.
    pub kind: FaultKind,
}

/// The process's userfaultfd.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
}

fn ioctl<T>(fd: RawFd, req: libc::c_ulong, arg: &mut T) -> io::Result<()> {
    // SAFETY: `arg` points to a live, correctly sized #[repr(C)] struct for
    // `req`; the kernel writes only within it.
    let r = unsafe { libc::ioctl(fd, req, arg as *mut T) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn uerr(op: &'static str) -> impl FnOnce(io::Error) -> PagerError {
    move |source| PagerError::Uffd { op, source }
}

impl Uffd {
    /// Creates the descriptor (non-blocking, close-on-exec) and performs the
    /// API handshake. Kernel-mode faults (KVM touching guest memory) are
    /// included, which needs root or `vm.unprivileged_userfaultfd=1`.
    pub fn new() -> Result<Uffd, PagerError> {
        // SAFETY: plain syscall with flag arguments.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(PagerError::Uffd {
                op: "userfaultfd()",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: the syscall returned a fresh descriptor we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
            ioctls: 0,
        };
        ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api).map_err(uerr("UFFDIO_API"))?;
        Ok(Uffd { fd })
    }

    /// A descriptor created (and set up) by another process: a cell's.
    pub fn from_fd(fd: OwnedFd) -> Uffd {
        Uffd { fd }
    }

    /// The descriptor itself, for another process.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// A second descriptor for the same userfaultfd.
    pub fn try_clone(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    /// Registers `[start, start+len)` for missing-page and write-protect
    /// faults.
    pub fn register(&self, start: usize, len: usize) -> Result<(), PagerError> {
        let mut reg = UffdioRegister {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg).map_err(uerr("UFFDIO_REGISTER"))?;
        if reg.ioctls & UFFDIO_WRITEPROTECT_BIT == 0 {
            let _ = self.unregister(start, len);
            return Err(PagerError::Uffd {
                op: "UFFDIO_REGISTER",
                source: io::Error::other("kernel does not offer write-protect on this mapping"),
            });
        }
        Ok(())
    }

    /// Unregisters a range; blocked threads in it are woken.
    pub fn unregister(&self, start: usize, len: usize) -> Result<(), PagerError> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER, &mut r).map_err(uerr("UFFDIO_UNREGISTER"))
    }

    /// Wakes threads waiting on faults in the range, so that they retry.
    pub fn wake(&self, start: usize, len: usize) -> Result<(), PagerError> {
        let mut r = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE, &mut r).map_err(uerr("UFFDIO_WAKE"))
    }

    /// Installs `len` bytes from `src` at `dst` (atomically per page) without
    /// waking waiters: the caller wakes them with [`Uffd::wake`] once its
    /// bookkeeping says the block is resident, so that a guest never runs
    /// ahead of the pager's accounting. With `write_protect` the pages come
    /// in write-protected.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes; `dst` must lie in a registered
    /// range whose pages are not present.
    pub unsafe fn copy(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
        write_protect: bool,
    ) -> Result<(), PagerError> {
        let mut done = 0usize;
        while done < len {
            let mut c = UffdioCopy {
                dst: (dst + done) as u64,
                src: src as u64 + done as u64,
                len: (len - done) as u64,
                mode: UFFDIO_COPY_MODE_DONTWAKE
                    | if write_protect {
                        UFFDIO_COPY_MODE_WP
                    } else {
                        0
                    },
                copy: 0,
            };
            match ioctl(self.fd.as_raw_fd(), UFFDIO_COPY, &mut c) {
                Ok(()) => done = len,
                // The address space changed under the copy (another thread
                // mapped or unmapped memory): continue after what was copied.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    if c.copy > 0 {
                        done += c.copy as usize;
                    }
                }
                Err(e) => {
                    return Err(PagerError::Uffd {
                        op: "UFFDIO_COPY",
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }

    /// Sets (`protect`) or clears write protection on a range. Clearing also
    /// wakes writers waiting on it.
    pub fn write_protect(&self, start: usize, len: usize, protect: bool) -> Result<(), PagerError> {
        let mut wp = UffdioWriteprotect {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: if protect {
                UFFDIO_WRITEPROTECT_MODE_WP
            } else {
                0
            },
        };
        ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp)
            .map_err(uerr("UFFDIO_WRITEPROTECT"))
    }

    /// Reads one fault message if any is pending (the descriptor is
    /// non-blocking). Events other than page faults are not enabled, so they
    /// never arrive; should one appear it is skipped.
    pub fn read_fault(&self) -> Result<Option<Fault>, PagerError> {
        let mut msg = std::mem::MaybeUninit::<UffdMsg>::uninit();
        let size = std::mem::size_of::<UffdMsg>();
        // SAFETY: reading at most `size` bytes into our buffer.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), msg.as_mut_ptr().cast(), size) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                _ => Err(PagerError::Uffd {
                    op: "read",
                    source: e,
                }),
            };
        }
        if n as usize != size {
            return Ok(None);
        }
        // SAFETY: the kernel filled the whole message.
        let msg = unsafe { msg.assume_init() };
        if msg.event != UFFD_EVENT_PAGEFAULT {
            return Ok(None);
        }
        let kind = if msg.flags & UFFD_PAGEFAULT_FLAG_WP != 0 {
            FaultKind::WriteProtect
        } else {
            FaultKind::Missing {
                write: msg.flags & UFFD_PAGEFAULT_FLAG_WRITE != 0,
            }
        };
        Ok(Some(Fault {
            addr: msg.address as usize,
            kind,
        }))
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Whether an error says the address space behind a descriptor is gone (its
/// process exited): ioctls then fail with ESRCH.
pub fn space_gone(error: &PagerError) -> bool {
    matches!(error, PagerError::Uffd { source, .. } if source.raw_os_error() == Some(libc::ESRCH))
}
