//! Guest RAM that the pager can serve from another process: a memfd mapped
//! shared, registered whole with a userfaultfd of the process that maps it.
//!
//! A densevm cell maps one for all its VMs; each holder (the child process
//! that owns some of them) keeps only its part of the mapping
//! ([`GuestMemory::narrow`]), registers it and hands its userfaultfd to the
//! pager, which has the cell's memfd once for every part (sent with
//! SCM_RIGHTS). The pager installs blocks through the userfaultfd, reads
//! victims with `pread` on the memfd and frees them with
//! `fallocate(PUNCH_HOLE)`, which also unmaps them from the holder. Tests
//! use it in one process, with threads as vCPUs.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::PagerError;
use crate::uffd::Uffd;

/// Identifies an attached [`GuestMemory`] within the pager.
pub type SpaceId = u32;

/// Seals every guest-RAM memfd carries from its creation: its size can
/// neither shrink nor grow, and no seal can be added (F_SEAL_WRITE would
/// stop the pager installing blocks).
pub const GUEST_RAM_SEALS: libc::c_int =
    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Highest address a mapping of a user process can end at (x86-64 with
/// 5-level paging; 4-level ends lower, 2^47).
const USER_ADDRESS_END: usize = 1 << 56;

fn refused(reason: String) -> PagerError {
    PagerError::BadSpace { reason }
}

/// Checks that `memfd` is guest memory the pager can rely on: a memfd (a
/// regular file) of at least `len` bytes, sealed against shrinking
/// (`F_SEAL_SHRINK`, as [`GuestMemory`] seals it). An unsealed memfd could
/// be cut short by the process that shares it, under the pager's reads.
pub fn check_sealed(memfd: BorrowedFd<'_>, len: usize) -> Result<(), PagerError> {
    // SAFETY: fstat into a zeroed struct on a descriptor we borrow.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(memfd.as_raw_fd(), &mut st) } != 0 {
        return Err(refused(format!(
            "memfd: fstat failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(refused("memfd is not a memory file".into()));
    }
    if (st.st_size as u64) < len as u64 {
        return Err(refused(format!(
            "memfd holds {} bytes, the mapping is {len}",
            st.st_size
        )));
    }
    // SAFETY: F_GET_SEALS reads flags of a descriptor we borrow.
    let seals = unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(refused(
            "memfd is not sealed against shrinking (create it with MFD_ALLOW_SEALING and add F_SEAL_SHRINK)"
                .into(),
        ));
    }
    Ok(())
}

/// Whether `fd` is a userfaultfd.
pub(crate) fn is_userfaultfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:[userfaultfd]")
}

/// Checks everything a cell hands over for one space before the pager
/// touches it (the pager runs it in [`crate::Pager::attach_space`]): a
/// page-aligned, non-empty mapping inside a user address space, a
/// userfaultfd, and a memfd that [`check_sealed`] accepts as long as the
/// mapping's end. Every refusal is a [`PagerError::BadSpace`], one line.
pub fn check_handoff(handoff: &SpaceHandoff) -> Result<(), PagerError> {
    let (base, len, at) = (handoff.base, handoff.len, handoff.memfd_offset);
    if base == 0 || !base.is_multiple_of(4096) || len == 0 || !len.is_multiple_of(4096) {
        return Err(refused(format!(
            "mapping {base:#x}+{len:#x} is not a non-empty run of whole pages"
        )));
    }
    let Some(end) = at.checked_add(len).filter(|_| at.is_multiple_of(4096)) else {
        return Err(refused(format!(
            "memfd offset {at:#x} is not whole pages, or ends past any memfd"
        )));
    };
    if base
        .checked_add(len)
        .is_none_or(|end| end > USER_ADDRESS_END)
    {
        return Err(refused(format!(
            "mapping {base:#x}+{len:#x} ends past the user address space"
        )));
    }
    if !is_userfaultfd(handoff.uffd.as_fd()) {
        return Err(refused("its uffd descriptor is not a userfaultfd".into()));
    }
    check_sealed(handoff.memfd.as_fd(), end)
}

/// What the pager needs of a [`GuestMemory`], possibly in another process.
#[derive(Debug)]
pub struct SpaceHandoff {
    /// The userfaultfd the memory is registered with.
    pub uffd: OwnedFd,
    /// The memfd behind the mapping, which the spaces cut from one memfd
    /// share (a densevm cell's holders).
    pub memfd: Arc<OwnedFd>,
    /// Offset in the memfd of the mapping's first byte.
    pub memfd_offset: usize,
    /// Address of the mapping in the process that holds it.
    pub base: usize,
    /// Length of the mapping (and of the memfd).
    pub len: usize,
}

/// Guest RAM: one memfd mapped MAP_SHARED, registered with this process's
/// userfaultfd in missing and write-protect modes. Unmapped on drop.
#[derive(Debug)]
pub struct GuestMemory {
    /// `None` once [`GuestMemory::close_memfd`] closed this process's copy.
    memfd: Option<OwnedFd>,
    /// `None` once [`GuestMemory::hand_over`] gave it to the pager.
    uffd: Mutex<Option<Uffd>>,
    base: NonNull<u8>,
    len: usize,
    /// Offset in the memfd of `base` (not 0 once [`GuestMemory::narrow`]ed).
    memfd_offset: usize,
}

// SAFETY: plain shared memory; guests and the pager synchronise through
// userfaultfd and the ledger, not through this handle.
unsafe impl Send for GuestMemory {}
// SAFETY: as above.
unsafe impl Sync for GuestMemory {}

fn io_error(op: &'static str) -> impl Fn(std::io::Error) -> PagerError {
    move |source| PagerError::Mm { op, source }
}

fn handed_over() -> PagerError {
    PagerError::Mm {
        op: "userfaultfd",
        source: std::io::Error::other("not registered, or already handed over to the pager"),
    }
}

fn mm_error(op: &'static str) -> PagerError {
    PagerError::Mm {
        op,
        source: std::io::Error::last_os_error(),
    }
}

impl GuestMemory {
    /// Creates `len` bytes (a non-zero multiple of 4 KiB) of guest memory,
    /// none of it populated, registered with a userfaultfd of this process.
    pub fn new(len: usize) -> Result<GuestMemory, PagerError> {
        let memory = GuestMemory::unregistered(len)?;
        memory.register()?;
        Ok(memory)
    }

    /// Like [`GuestMemory::new`], but registered with no userfaultfd yet: a
    /// process that maps it and forks registers it in the child that runs
    /// the vCPUs ([`GuestMemory::register`]), since a registration does not
    /// pass to a child.
    pub fn unregistered(len: usize) -> Result<GuestMemory, PagerError> {
        if len == 0 || !len.is_multiple_of(4096) {
            return Err(PagerError::Mm {
                op: "guest memory",
                source: std::io::Error::other(format!(
                    "length {len} is not a non-zero multiple of 4 KiB"
                )),
            });
        }
        // SAFETY: plain syscall; the name is a NUL-terminated literal.
        let fd = unsafe {
            libc::memfd_create(
                c"densevm-guest-ram".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(mm_error("memfd_create"));
        }
        // SAFETY: a fresh descriptor we now own.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sizing our own memfd.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(mm_error("ftruncate(memfd)"));
        }
        // Its size is final: a holder that shrank it would make the pager's
        // reads of victims fail (and the guests' accesses SIGBUS), and the
        // pager refuses a memfd that could be ([`check_sealed`]).
        // SAFETY: sealing our own memfd.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, GUEST_RAM_SEALS) } != 0 {
            return Err(mm_error("fcntl(F_ADD_SEALS)"));
        }
        // SAFETY: a fresh shared mapping of our memfd aliases nothing of ours.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(mm_error("mmap(memfd)"));
        }
        let base = NonNull::new(ptr.cast::<u8>()).expect("mmap returned null");
        // Huge pages would turn one block's eviction into splitting a 2 MiB page.
        // SAFETY: advice on our own mapping.
        unsafe { libc::madvise(ptr, len, libc::MADV_NOHUGEPAGE) };
        Ok(GuestMemory {
            memfd: Some(memfd),
            uffd: Mutex::new(None),
            base,
            len,
            memfd_offset: 0,
        })
    }

    /// Keeps only bytes `offset..offset + len` of the mapping mapped (whole
    /// pages, inside it) and unmaps the rest: a process that serves one part
    /// of a memory shared by parts (a densevm holder, after its fork) maps
    /// nothing of the others. Before registering: refused once a
    /// userfaultfd is registered over the whole.
    pub fn narrow(&mut self, offset: usize, len: usize) -> Result<(), PagerError> {
        let fits = offset.is_multiple_of(4096)
            && len.is_multiple_of(4096)
            && len > 0
            && offset.checked_add(len).is_some_and(|end| end <= self.len);
        if !fits || self.uffd.lock().expect("uffd").is_some() {
            return Err(PagerError::Mm {
                op: "narrow guest memory",
                source: std::io::Error::other(format!(
                    "{offset:#x}+{len:#x} is not whole pages inside {:#x} bytes, or the memory is registered",
                    self.len
                )),
            });
        }
        let end = offset + len;
        for (from, to) in [(0, offset), (end, self.len)] {
            // SAFETY: a range of our own mapping that nothing of ours uses:
            // it is not this process's part.
            if from < to
                && unsafe { libc::munmap(self.base.as_ptr().add(from).cast(), to - from) } != 0
            {
                return Err(mm_error("munmap(other parts)"));
            }
        }
        // SAFETY: `offset` is inside the mapping.
        self.base = NonNull::new(unsafe { self.base.as_ptr().add(offset) }).expect("non-null");
        self.len = len;
        self.memfd_offset += offset;
        Ok(())
    }

    /// Registers the whole mapping with a new userfaultfd of the calling
    /// process, in missing and write-protect modes, replacing (and closing)
    /// any earlier one.
    pub fn register(&self) -> Result<(), PagerError> {
        let uffd = Uffd::new()?;
        uffd.register(self.base.as_ptr() as usize, self.len)?;
        *self.uffd.lock().expect("uffd") = Some(uffd);
        Ok(())
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The memfd behind the mapping, until [`GuestMemory::close_memfd`].
    pub fn memfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.memfd.as_ref().map(|fd| fd.as_fd())
    }

    /// Closes this process's descriptor of the memfd and keeps the mapping:
    /// a process that has handed the memory to the pager and only maps it
    /// then holds no descriptor for it. Handoffs are refused afterwards;
    /// [`GuestMemory::take_uffd`] still works.
    pub fn close_memfd(&mut self) {
        self.memfd = None;
    }

    /// Never: guest memory has at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Duplicates of the descriptors and the mapping's address, for the pager.
    /// This process keeps its userfaultfd (one process, threads as vCPUs).
    pub fn handoff(&self) -> Result<SpaceHandoff, PagerError> {
        let uffd = self.uffd.lock().expect("uffd");
        let uffd = uffd.as_ref().ok_or_else(handed_over)?;
        let uffd = uffd.try_clone().map_err(io_error("dup(userfaultfd)"))?;
        self.handoff_with(uffd, self.dup_memfd()?)
    }

    /// Like [`GuestMemory::handoff`], but this process gives its userfaultfd
    /// away: the pager's copy is the only one. Should the pager go away, the
    /// registration ends and faults in flight complete, where they would
    /// otherwise wait forever; KVM's teardown of a VM waits for its
    /// asynchronous page faults, so a process that kept the descriptor could
    /// never finish exiting (seen: cells stuck in `kvm_destroy_vm`, their
    /// listeners bound until reboot).
    pub fn hand_over(&self) -> Result<SpaceHandoff, PagerError> {
        let memfd = self.dup_memfd()?;
        self.handoff_with(self.take_uffd()?, memfd)
    }

    /// The userfaultfd alone, given away as [`GuestMemory::hand_over`] gives
    /// it: for a process whose pager already has the memfd (a restarted
    /// densevm holder).
    pub fn take_uffd(&self) -> Result<OwnedFd, PagerError> {
        let uffd = self.uffd.lock().expect("uffd").take();
        Ok(uffd.ok_or_else(handed_over)?.into_fd())
    }

    fn handoff_with(&self, uffd: OwnedFd, memfd: OwnedFd) -> Result<SpaceHandoff, PagerError> {
        Ok(SpaceHandoff {
            uffd,
            memfd: Arc::new(memfd),
            memfd_offset: self.memfd_offset,
            base: self.base.as_ptr() as usize,
            len: self.len,
        })
    }

    fn dup_memfd(&self) -> Result<OwnedFd, PagerError> {
        let memfd = self.memfd.as_ref().ok_or_else(|| PagerError::Mm {
            op: "dup(memfd)",
            source: std::io::Error::other("this process closed its memfd"),
        })?;
        memfd.try_clone().map_err(io_error("dup(memfd)"))
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping; nothing refers to it once the owner drops it.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_a_length_that_is_not_whole_pages() {
        for len in [0, 100, 4097] {
            let error = GuestMemory::new(len).unwrap_err().to_string();
            assert!(error.contains("multiple of 4 KiB"), "{error}");
        }
    }

    #[test]
    fn hands_over_the_mapping_it_made() {
        let memory = GuestMemory::new(64 << 10).unwrap();
        let handoff = memory.handoff().unwrap();
        assert_eq!(
            (handoff.base, handoff.len),
            (memory.as_ptr() as usize, 64 << 10)
        );
        // SAFETY: fstat on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(
            unsafe { libc::fstat(std::os::fd::AsRawFd::as_raw_fd(&handoff.memfd), &mut st) },
            0
        );
        assert_eq!(st.st_size, 64 << 10);
    }

    #[test]
    fn a_fault_completes_once_the_pager_closes_the_handed_over_descriptor() {
        let memory = std::sync::Arc::new(GuestMemory::new(64 << 10).unwrap());
        let handoff = memory.hand_over().unwrap();
        assert!(
            memory.handoff().is_err(),
            "this process kept no userfaultfd"
        );
        let (done, finished) = std::sync::mpsc::channel();
        let toucher = std::sync::Arc::clone(&memory);
        std::thread::spawn(move || {
            // SAFETY: inside the mapping; nobody serves the fault until the
            // registration ends.
            let byte = unsafe { std::ptr::read_volatile(toucher.as_ptr().add(4096)) };
            let _ = done.send(byte);
        });
        let waited = std::time::Duration::from_millis(200);
        assert!(
            finished.recv_timeout(waited).is_err(),
            "the fault waits for the pager"
        );
        drop(handoff);
        let byte = finished.recv_timeout(std::time::Duration::from_secs(10));
        assert_eq!(byte, Ok(0), "the pager went away: the fault completes");
    }

    #[test]
    fn a_process_that_closed_its_memfd_keeps_the_mapping_and_gives_only_its_uffd() {
        // Not registered yet, so that this thread may touch it unserved.
        let mut memory = GuestMemory::unregistered(64 << 10).unwrap();
        // SAFETY: inside the mapping, which outlives the accesses.
        unsafe { std::ptr::write_volatile(memory.as_ptr(), 7u8) }
        memory.close_memfd();
        assert!(memory.memfd().is_none());
        // SAFETY: as above.
        assert_eq!(unsafe { std::ptr::read_volatile(memory.as_ptr()) }, 7);
        memory.register().unwrap();
        let mut handed = memory.hand_over().unwrap_err().to_string();
        assert!(handed.contains("closed its memfd"), "{handed}");
        // Refused before it took the userfaultfd: that one is still given.
        let uffd = memory.take_uffd().unwrap();
        assert!(crate::guest_memory::is_userfaultfd(uffd.as_fd()));
        handed = memory.take_uffd().unwrap_err().to_string();
        assert!(handed.contains("handed over"), "{handed}");
    }
}
