//! Loads the webguest ELF once into the image shared by every VM.

use crate::guest::abi::{IMAGE_BYTES, IMAGE_GPA, RAM_GPA};
use crate::guest::memory::Mapping;
use goblin::elf::{header::EM_X86_64, program_header::PT_LOAD, Elf};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Why a guest image could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read guest image {path}: {source}")]
    Read {
        /// The image path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not an x86-64 ELF executable with the webguest symbols.
    #[error("guest image {0} is not a webguest x86-64 ELF executable")]
    NotElf(PathBuf),
    /// A segment lies outside the regions the ABI allows.
    #[error("guest image {path}: segment at {vaddr:#x} (+{memsz:#x}) is outside the image and RAM regions, or initialises RAM")]
    BadSegment {
        /// The image path.
        path: PathBuf,
        /// Segment address.
        vaddr: u64,
        /// Segment size in memory.
        memsz: u64,
    },
    /// Mapping the shared image failed.
    #[error("cannot map the guest image: {0}")]
    Map(std::io::Error),
}

/// The loaded image.
#[derive(Debug)]
pub struct GuestImage {
    /// Text and rodata at [`IMAGE_GPA`], a read-only mapping of
    /// [`Self::memfd`] shared by every VM where KVM maps it read-only to
    /// guests ([`Self::private_copy`] otherwise).
    pub mapping: Mapping,
    /// The image's bytes, sealed against every change.
    pub memfd: OwnedFd,
    /// Bytes of `mapping` the VMs map (page-rounded extent of the image).
    pub mapped_bytes: u64,
    /// Entry point (guest-physical).
    pub entry: u64,
    /// RAM offset where the guest's bss ends.
    pub bss_end: u64,
    /// RAM offset of the connection buffers, which end bss; everything
    /// before them is state every request touches.
    pub rx_buffers: u64,
}

/// Seals of the image's memfd: no write, no resize, no further seal.
const IMAGE_SEALS: libc::c_int =
    libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

fn image_memfd() -> std::io::Result<OwnedFd> {
    // SAFETY: a plain syscall with a static name; the descriptor is ours.
    let fd = unsafe {
        libc::memfd_create(
            c"densevm-image".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just created, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl GuestImage {
    /// A copy-on-write mapping of the image for one VM, for hosts whose
    /// KVM cannot map memory read-only to a guest: what the guest writes
    /// lands in pages of its own, never in the image its neighbours run.
    pub fn private_copy(&self) -> std::io::Result<Mapping> {
        Mapping::of_file(self.memfd.as_fd(), self.mapped_bytes as usize, true)
    }
}

/// Loads the ELF at `path`.
pub fn load(path: &Path) -> Result<GuestImage, LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
        path: path.into(),
        source,
    })?;
    let elf = Elf::parse(&bytes).map_err(|_| LoadError::NotElf(path.into()))?;
    if !elf.is_64 || elf.header.e_machine != EM_X86_64 {
        return Err(LoadError::NotElf(path.into()));
    }
    let memfd = image_memfd().map_err(LoadError::Map)?;
    let file = std::fs::File::from(memfd);
    file.set_len(IMAGE_BYTES).map_err(LoadError::Map)?;
    let mut image_end = 0u64;
    let mut bss_end = 0u64;
    for ph in elf.program_headers.iter().filter(|ph| ph.p_type == PT_LOAD) {
        let bad = || LoadError::BadSegment {
            path: path.into(),
            vaddr: ph.p_vaddr,
            memsz: ph.p_memsz,
        };
        let end = ph.p_vaddr.checked_add(ph.p_memsz).ok_or_else(bad)?;
        if ph.p_vaddr >= IMAGE_GPA && end <= IMAGE_GPA + IMAGE_BYTES {
            let segment = ph
                .p_offset
                .checked_add(ph.p_filesz)
                .and_then(|end| bytes.get(ph.p_offset as usize..end as usize))
                .ok_or_else(bad)?;
            file.write_all_at(segment, ph.p_vaddr - IMAGE_GPA)
                .map_err(LoadError::Map)?;
            image_end = image_end.max(end - IMAGE_GPA);
        } else if ph.p_vaddr >= RAM_GPA && ph.p_filesz == 0 {
            bss_end = bss_end.max(end - RAM_GPA);
        } else {
            return Err(bad());
        }
    }
    let rx_buffers = elf
        .syms
        .iter()
        .find(|sym| elf.strtab.get_at(sym.st_name) == Some("rx_buffers"))
        .map(|sym| sym.st_value)
        .filter(|addr| *addr >= RAM_GPA && *addr - RAM_GPA < bss_end)
        .ok_or_else(|| LoadError::NotElf(path.into()))?
        - RAM_GPA;
    let entry = elf.entry;
    if entry < IMAGE_GPA || entry >= IMAGE_GPA + image_end {
        return Err(LoadError::NotElf(path.into()));
    }
    let memfd = OwnedFd::from(file);
    // SAFETY: sealing our own memfd, which no writable mapping shares.
    if unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&memfd),
            libc::F_ADD_SEALS,
            IMAGE_SEALS,
        )
    } != 0
    {
        return Err(LoadError::Map(std::io::Error::last_os_error()));
    }
    let mapping =
        Mapping::of_file(memfd.as_fd(), IMAGE_BYTES as usize, false).map_err(LoadError::Map)?;
    Ok(GuestImage {
        mapping,
        memfd,
        mapped_bytes: image_end.next_multiple_of(4096),
        entry,
        bss_end,
        rx_buffers,
    })
}
