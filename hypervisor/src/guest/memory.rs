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
/// map: one memfd for the cell, mapped once, `slots_per_holder` slots a
/// holder (VM `first_id + i` in slot `i`).
///
/// The front maps the whole memfd before it forks the holders; each holder
/// then keeps only its part of the mapping ([`HolderSlots::keep_only`]), so
/// a page of a holder's VMs is mapped in no other holder and a kernel walk
/// over its mappings meets only that holder's KVM notifiers. One mapping
/// keeps the VMA count constant, and one memfd the pager's descriptors: a
/// cell whose VMs all sleep holds two mappings and the parent one memfd,
/// however many holders it has.
pub struct HolderSlots {
    /// The whole memfd in the front; a holder's part in a holder.
    memory: GuestMemory,
    /// The part this process kept ([`HolderSlots::keep_only`]): `None` in
    /// the front, which maps them all.
    kept: Option<usize>,
    slots: usize,
    slot_bytes: usize,
    slots_per_holder: usize,
    release: Release,
}

/// Where holder part `h` of a [`HolderSlots`] lies, in the front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Its address (the same in its holder, which inherits the mapping).
    pub base: usize,
    /// Its length: its slots' bytes.
    pub len: usize,
    /// Its offset in the memfd.
    pub memfd_offset: usize,
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
        Ok(HolderSlots {
            memory: GuestMemory::unregistered(slot_bytes * slots)?,
            kept: None,
            slots,
            slot_bytes,
            slots_per_holder: slots_per_holder.max(1),
            release,
        })
    }

    /// Number of parts (holders).
    pub fn parts(&self) -> usize {
        self.slots.div_ceil(self.slots_per_holder)
    }

    /// Holder `h`'s part; `None` past the last, or in a holder (which maps
    /// only its own: [`HolderSlots::memory`]).
    pub fn part(&self, h: usize) -> Option<Part> {
        let first = h.checked_mul(self.slots_per_holder)?;
        if self.kept.is_some() || first >= self.slots {
            return None;
        }
        let held = self.slots_per_holder.min(self.slots - first);
        let memfd_offset = first * self.slot_bytes;
        Some(Part {
            base: self.memory.as_ptr() as usize + memfd_offset,
            len: held * self.slot_bytes,
            memfd_offset,
        })
    }

    /// The memory this process maps: all of it in the front, its own part
    /// in a holder.
    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// Closes this process's memfd, keeping the mapping (the front, once
    /// the pager has its copy).
    pub fn close_memfd(&mut self) {
        self.memory.close_memfd();
    }

    /// Unmaps every part but `holder`'s and closes the memfd, through which
    /// the others could be mapped again (in a holder, just after the fork).
    pub fn keep_only(&mut self, holder: usize) -> Result<(), paging_policy::PagerError> {
        let part = self
            .part(holder)
            .ok_or_else(|| paging_policy::PagerError::Mm {
                op: "keep a holder's part",
                source: io::Error::other(format!("no part {holder}")),
            })?;
        self.memory.narrow(part.memfd_offset, part.len)?;
        self.memory.close_memfd();
        self.kept = Some(holder);
        Ok(())
    }

    /// Slot `index`; `None` past the end or outside this process's part.
    pub fn slot(&self, index: usize) -> Option<Mapping> {
        let first_slot = self.kept.map_or(0, |h| h * self.slots_per_holder);
        let offset = index.checked_sub(first_slot)? * self.slot_bytes;
        if index >= self.slots || offset + self.slot_bytes > self.memory.len() {
            return None;
        }
        // SAFETY: in bounds of the mapping, which lives as long as the cell.
        let base = unsafe { self.memory.as_ptr().add(offset) };
        Some(Mapping {
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
    fn a_holder_keeps_only_its_part_of_the_cells_one_memory() {
        let slot = 2 * 4096;
        // Parts of two slots: 0-1, 2-3 and 4.
        let mut slots = HolderSlots::guest_ram(slot, 5, 2).unwrap();
        assert_eq!(slots.parts(), 3);
        let parts: Vec<Part> = (0..3).map(|h| slots.part(h).unwrap()).collect();
        assert!(slots.part(3).is_none());
        assert_eq!(
            parts
                .iter()
                .map(|p| (p.memfd_offset, p.len))
                .collect::<Vec<_>>(),
            [(0, 2 * slot), (2 * slot, 2 * slot), (4 * slot, slot)]
        );
        assert_eq!(parts[1].base, parts[0].base + 2 * slot, "one mapping");
        slots.slot(3).unwrap().write_obj(8, 0x7a_u64);
        slots.keep_only(1).unwrap();
        assert!(slots.memory().memfd().is_none(), "a holder keeps no memfd");
        assert_eq!(slots.memory().as_ptr() as usize, parts[1].base);
        assert_eq!(slots.memory().len(), 2 * slot);
        assert_eq!(slots.slot(3).unwrap().read_volatile::<u64>(8), 0x7a);
        assert!(slots.slot(2).is_some());
        for other in [0, 1, 4, 5] {
            assert!(
                slots.slot(other).is_none(),
                "slot {other} is another holder's"
            );
        }
        assert!(slots.part(1).is_none() && slots.keep_only(0).is_err());
    }

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
