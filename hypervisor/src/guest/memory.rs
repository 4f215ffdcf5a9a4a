//! Host mappings that back guest memory.
//!
//! A VM has three regions (see `abi`): its private system pages, the image
//! shared read-only by every VM, and its RAM. RAM and system pages are
//! slots of memfd mappings that the cell's front and the VM's holder share
//! ([`HolderSlots`]); the pager (in the parent process) holds the RAM too
//! and alone frees it. vCPU stacks are anonymous mappings of the holder. All
//! are MAP_NORESERVE: nothing is allocated until touched.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;

use paging_policy::GuestMemory;

/// Bytes of a chunk of [`PackedPages`].
pub const PACK_CHUNK: usize = 64;

/// What ranges of a [`Mapping`] held, less their chunks of zeros: a
/// sleeping VM's counters, ring indices and credits in a few hundred bytes
/// of the front's heap instead of pages of shared memory.
#[derive(Debug)]
pub struct PackedPages {
    /// Offset in the mapping and bytes of every chunk not all zeros.
    chunks: Vec<(u64, [u8; PACK_CHUNK])>,
}

impl PackedPages {
    /// A plain-data value at `offset`, as the mapping held it (`T`: any
    /// bit pattern valid, as for [`Mapping::read_volatile`]).
    pub fn read<T: Copy>(&self, offset: u64) -> T {
        let size = std::mem::size_of::<T>() as u64;
        let mut bytes = vec![0u8; size as usize];
        for (at, chunk) in &self.chunks {
            let (from, to) = (offset.max(*at), (offset + size).min(at + PACK_CHUNK as u64));
            if from < to {
                bytes[(from - offset) as usize..(to - offset) as usize]
                    .copy_from_slice(&chunk[(from - at) as usize..(to - at) as usize]);
            }
        }
        // SAFETY: `size` bytes, and T is plain data.
        unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
    }
}

/// What dropping a [`Mapping`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// A mapping of its own: unmapped.
    Unmap,
    /// A slot of an [`Arena`]: its pages go back to the kernel.
    DontNeed,
    /// A slot of shared memory another process frees (guest RAM: the
    /// pager, when the VM is unregistered).
    Pager,
    /// A slot of shared memory: its pages go back (MADV_DONTNEED would only
    /// unmap them).
    Remove,
}

/// Host memory: a mapping of its own, a slot of an [`Arena`], or a VM's
/// slot of [`HolderSlots`].
#[derive(Debug)]
pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
    release: Release,
}

// SAFETY: the mapping is plain memory; concurrent access from the guest and
// from host threads goes through volatile or atomic accesses.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of zeroed private (or shared) anonymous memory.
    pub fn anonymous(len: usize, shared: bool) -> io::Result<Self> {
        let visibility = if shared {
            libc::MAP_SHARED
        } else {
            libc::MAP_PRIVATE
        };
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        Self::map(len, prot, visibility | libc::MAP_ANONYMOUS, -1)
    }

    /// Maps the first `len` bytes of file `fd`: shared and read-only, or
    /// (`private`) a copy-on-write mapping that may be written, whose
    /// writes no other mapping sees.
    pub fn of_file(fd: std::os::fd::BorrowedFd<'_>, len: usize, private: bool) -> io::Result<Self> {
        use std::os::fd::AsRawFd;
        let (prot, visibility) = if private {
            (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE)
        } else {
            (libc::PROT_READ, libc::MAP_SHARED)
        };
        Self::map(len, prot, visibility, fd.as_raw_fd())
    }

    /// A fresh mapping of `len` bytes (of `fd`, or anonymous with -1),
    /// unmapped on drop.
    fn map(len: usize, prot: libc::c_int, flags: libc::c_int, fd: libc::c_int) -> io::Result<Self> {
        // SAFETY: a fresh mapping (of a file we hold, or anonymous) aliases
        // nothing we write.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                flags | libc::MAP_NORESERVE,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            base: NonNull::new(ptr.cast()).expect("mmap returned null"),
            len,
            release: Release::Unmap,
        })
    }

    /// Host address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Applies `op` (a system call on an address and a length, 0 on
    /// success) to every range of this mapping outside `kept` ((offset,
    /// len) ranges, sorted).
    fn outside(
        &self,
        kept: &[(u64, u64)],
        op: impl Fn(*mut libc::c_void, usize) -> libc::c_int,
    ) -> io::Result<()> {
        let ends = std::iter::once(0).chain(kept.iter().map(|&(start, len)| start + len));
        let starts = kept
            .iter()
            .map(|&(start, _)| start)
            .chain([self.len as u64]);
        for (start, end) in ends.zip(starts).filter(|(start, end)| start < end) {
            if op(self.at(start).cast(), (end - start) as usize) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// Makes every byte outside `used` ((offset, len) ranges, sorted)
    /// inaccessible: a guest touching it gets a fault, not fresh memory.
    pub fn protect_unused(&self, used: &[(u64, u64)]) -> io::Result<()> {
        // SAFETY: page-aligned ranges inside this mapping, which no one
        // reads or writes (the guest may not, the monitor does not).
        self.outside(used, |at, len| unsafe {
            libc::mprotect(at, len, libc::PROT_NONE)
        })
    }

    /// Keeps what `kept` ((offset, len) ranges, [`PACK_CHUNK`]-aligned)
    /// holds in a [`PackedPages`], then frees the shared memory behind the
    /// whole mapping: it reads as zeros again, in every process that maps
    /// it. For memory no one uses meanwhile (a hibernated VM's); put it
    /// back with [`Self::unpack`] before anyone does.
    pub fn pack_and_discard(&self, kept: &[(u64, u64)]) -> io::Result<PackedPages> {
        let mut chunks = Vec::new();
        for &(start, len) in kept {
            for at in (start..start + len).step_by(PACK_CHUNK) {
                let mut chunk = [0u8; PACK_CHUNK];
                // SAFETY: in bounds (`at` checks), and no one writes it
                // meanwhile.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.at(at), chunk.as_mut_ptr(), PACK_CHUNK)
                };
                if chunk != [0u8; PACK_CHUNK] {
                    chunks.push((at, chunk));
                }
            }
        }
        // SAFETY: the whole of this shared mapping, which no vCPU and no
        // host thread touches meanwhile.
        self.outside(&[], |at, len| unsafe {
            libc::madvise(at, len, libc::MADV_REMOVE)
        })?;
        Ok(PackedPages { chunks })
    }

    /// Writes a pack back where [`Self::pack_and_discard`] took it from.
    pub fn unpack(&self, pack: &PackedPages) {
        for (at, chunk) in &pack.chunks {
            assert!(*at as usize + PACK_CHUNK <= self.len);
            // SAFETY: bounds checked; the destination is ours.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.at(*at), PACK_CHUNK) };
        }
    }

    /// Host address of byte `offset`; panics outside the mapping.
    pub fn at(&self, offset: u64) -> *mut u8 {
        assert!(
            offset < self.len as u64,
            "offset {offset:#x} outside a {:#x}-byte mapping",
            self.len
        );
        // SAFETY: bounds checked above.
        unsafe { self.base.as_ptr().add(offset as usize) }
    }

    /// Copies `bytes` to `offset`.
    #[cfg(test)]
    pub fn write_bytes(&self, offset: u64, bytes: &[u8]) {
        assert!(offset as usize + bytes.len() <= self.len);
        // SAFETY: bounds checked; the destination is ours.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.at(offset), bytes.len()) }
    }

    /// Writes a plain-data value at `offset`.
    pub fn write_obj<T: Copy>(&self, offset: u64, value: T) {
        assert!(offset as usize + std::mem::size_of::<T>() <= self.len);
        // SAFETY: bounds checked; T is plain data.
        unsafe { std::ptr::write_unaligned(self.at(offset).cast::<T>(), value) }
    }

    /// Reads a plain-data value at `offset` that the guest may be writing.
    pub fn read_volatile<T: Copy>(&self, offset: u64) -> T {
        assert!(offset as usize + std::mem::size_of::<T>() <= self.len);
        assert_eq!(
            offset as usize % std::mem::align_of::<T>(),
            0,
            "unaligned volatile read"
        );
        // SAFETY: bounds and alignment checked.
        unsafe { std::ptr::read_volatile(self.at(offset).cast::<T>()) }
    }

    /// A 32-bit word shared with the guest, at a 4-byte aligned `offset`.
    pub fn atomic_u32(&self, offset: u64) -> &AtomicU32 {
        assert!(offset as usize + 4 <= self.len && offset.is_multiple_of(4));
        // SAFETY: in bounds, aligned, and the mapping outlives the reference.
        unsafe { AtomicU32::from_ptr(self.at(offset).cast::<u32>()) }
    }

    /// Bytes of the mapping that are resident in host memory.
    pub fn resident_bytes(&self) -> u64 {
        let page = 4096usize;
        let mut vec = vec![0u8; self.len.div_ceil(page)];
        // SAFETY: the range is our mapping and vec has one byte per page.
        let rc = unsafe { libc::mincore(self.as_ptr().cast(), self.len, vec.as_mut_ptr()) };
        if rc != 0 {
            return 0;
        }
        vec.iter().filter(|b| *b & 1 == 1).count() as u64 * page as u64
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own the mapping, or this slot of an arena.
        unsafe {
            match self.release {
                Release::Unmap => libc::munmap(self.base.as_ptr().cast(), self.len),
                Release::DontNeed => {
                    libc::madvise(self.base.as_ptr().cast(), self.len, libc::MADV_DONTNEED)
                }
                Release::Remove => {
                    libc::madvise(self.base.as_ptr().cast(), self.len, libc::MADV_REMOVE)
                }
                Release::Pager => 0,
            };
        }
    }
}

/// Equal-sized slots carved from large mappings, a chunk at a time.
///
/// Every VMA of the process is visited when a KVM VM registers its MMU
/// notifier; one mapping per VM for each kind of memory would make booting
/// N VMs quadratic. Slots are never reused: VM indices only grow.
#[derive(Debug)]
pub struct Arena {
    slot_bytes: usize,
    slots_per_chunk: usize,
    chunks: std::sync::Mutex<Vec<Option<Mapping>>>,
}

impl Arena {
    /// An arena of `slot_bytes` slots, mapped `slots_per_chunk` at a time.
    pub fn new(slot_bytes: usize, slots_per_chunk: usize) -> Self {
        Arena {
            slot_bytes,
            slots_per_chunk,
            chunks: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Slot `index`, zeroed on first use.
    pub fn slot(&self, index: usize) -> io::Result<Mapping> {
        let (chunk, within) = (index / self.slots_per_chunk, index % self.slots_per_chunk);
        let mut chunks = self.chunks.lock().expect("arena lock");
        if chunks.len() <= chunk {
            chunks.resize_with(chunk + 1, || None);
        }
        if chunks[chunk].is_none() {
            chunks[chunk] = Some(Mapping::anonymous(
                self.slot_bytes * self.slots_per_chunk,
                false,
            )?);
        }
        let base = chunks[chunk]
            .as_ref()
            .expect("chunk mapped")
            .at((within * self.slot_bytes) as u64);
        Ok(Mapping {
            base: NonNull::new(base).expect("non-null slot"),
            len: self.slot_bytes,
            release: Release::DontNeed,
        })
    }
}

/// Equal slots of memory that a cell's front and one of its holders both
/// map: one memfd mapping per holder, `slots_per_holder` slots each (VM
/// `first_id + i` in slot `i`).
///
/// The front maps every holder's part before it forks them; each holder
/// then unmaps the others' ([`HolderSlots::keep_only`]), so a page of a
/// holder's VMs is mapped in no other holder and a kernel walk over its
/// mappings meets only that holder's KVM notifiers. One mapping per holder
/// keeps the VMA count constant.
pub struct HolderSlots {
    memories: Vec<Option<GuestMemory>>,
    slot_bytes: usize,
    slots_per_holder: usize,
    release: Release,
}

impl HolderSlots {
    /// Guest RAM: room for `slots` VMs of `slot_bytes` each. Each part goes
    /// to the pager with a userfaultfd its holder registers; the pager alone
    /// frees it.
    pub fn guest_ram(
        slot_bytes: usize,
        slots: usize,
        slots_per_holder: usize,
    ) -> Result<Self, paging_policy::PagerError> {
        Self::new(slot_bytes, slots, slots_per_holder, Release::Pager)
    }

    /// System pages (rings, control page): never paged, written by the
    /// front and the guest; a VM's slot is freed when the front drops it.
    pub fn system(
        slot_bytes: usize,
        slots: usize,
        slots_per_holder: usize,
    ) -> Result<Self, paging_policy::PagerError> {
        Self::new(slot_bytes, slots, slots_per_holder, Release::Remove)
    }

    fn new(
        slot_bytes: usize,
        slots: usize,
        slots_per_holder: usize,
        release: Release,
    ) -> Result<Self, paging_policy::PagerError> {
        let slots_per_holder = slots_per_holder.max(1);
        let memories = (0..slots.div_ceil(slots_per_holder))
            .map(|h| {
                let held = slots_per_holder.min(slots - h * slots_per_holder);
                GuestMemory::unregistered(slot_bytes * held).map(Some)
            })
            .collect::<Result<_, _>>()?;
        Ok(HolderSlots {
            memories,
            slot_bytes,
            slots_per_holder,
            release,
        })
    }

    /// Holder `holder`'s part, if this process maps it.
    pub fn part(&self, holder: usize) -> Option<&GuestMemory> {
        self.memories.get(holder)?.as_ref()
    }

    /// Number of parts (holders).
    pub fn parts(&self) -> usize {
        self.memories.len()
    }

    /// Closes this process's memfd of every part, keeping the mappings (the
    /// front, once the pager has its copies).
    pub fn close_memfds(&mut self) {
        self.memories
            .iter_mut()
            .flatten()
            .for_each(GuestMemory::close_memfd);
    }

    /// Unmaps every part but `holder`'s (in a holder, just after the fork).
    pub fn keep_only(&mut self, holder: usize) {
        for (h, memory) in self.memories.iter_mut().enumerate() {
            if h != holder {
                memory.take();
            }
        }
    }

    /// Slot `index`; `None` past the end or in a part this process dropped.
    pub fn slot(&self, index: usize) -> Option<Mapping> {
        let memory = self.part(index / self.slots_per_holder)?;
        let offset = (index % self.slots_per_holder) * self.slot_bytes;
        // SAFETY: in bounds of the part (which holds `slots_per_holder`
        // slots, or the rest), which lives as long as the cell.
        let base = unsafe { memory.as_ptr().add(offset) };
        (offset + self.slot_bytes <= memory.len()).then(|| Mapping {
            base: NonNull::new(base).expect("non-null slot"),
            len: self.slot_bytes,
            release: self.release,
        })
    }

    /// The same slot, for a process that must leave its freeing to another
    /// (a holder: the front or the pager frees it).
    pub fn borrowed_slot(&self, index: usize) -> Option<Mapping> {
        let mut mapping = self.slot(index)?;
        mapping.release = Release::Pager;
        Some(mapping)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pack_keeps_what_the_kept_ranges_held_and_the_pages_are_freed() {
        let m = Mapping::anonymous(4 * 4096, true).unwrap();
        let across = 0x1000 + 3 * PACK_CHUNK as u64 + 60; // straddles two chunks
        m.write_obj(0x10, 0xdead_beef_u64);
        m.write_obj(across, 0x1122_3344_5566_7788_u64);
        m.write_obj(0x3000, 7_u64); // outside the kept ranges
        let pack = m.pack_and_discard(&[(0, 0x2000)]).unwrap();
        assert_eq!(pack.chunks.len(), 3, "only the chunks that are not zeros");
        assert_eq!(m.resident_bytes(), 0);
        assert_eq!(m.read_volatile::<u64>(0x10), 0);
        assert_eq!(pack.read::<u64>(0x10), 0xdead_beef);
        assert_eq!(pack.read::<u64>(across), 0x1122_3344_5566_7788);
        assert_eq!(pack.read::<u64>(0x3000), 0);
        m.unpack(&pack);
        assert_eq!(m.read_volatile::<u64>(0x10), 0xdead_beef);
        assert_eq!(m.read_volatile::<u32>(across), 0x5566_7788);
        assert_eq!(m.read_volatile::<u32>(across + 4), 0x1122_3344);
        assert_eq!(
            m.read_volatile::<u64>(0x3000),
            0,
            "what was not kept is gone"
        );
    }
}
