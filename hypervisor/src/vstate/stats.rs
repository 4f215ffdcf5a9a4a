//! KVM's binary statistics of a vCPU (KVM_GET_STATS_FD).
//!
//! The stats fd must be opened before the vCPU enters KVM_RUN: the ioctl
//! takes the vCPU mutex, which a halted vCPU holds. Reading it afterwards
//! takes no lock.

use kvm_bindings::{kvm_stats_desc, kvm_stats_header};
use kvm_ioctls::VcpuFd;
use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

vmm_sys_util::ioctl_io_nr!(KVM_GET_STATS_FD, kvm_bindings::KVMIO, 0xce);

/// The counters of one vCPU, by name.
pub struct VcpuStats {
    file: File,
    data_offset: u64,
    /// (name, byte offset in the data block) of every single-valued stat.
    counters: Vec<(String, u64)>,
}

fn read_struct<T: Default + Copy>(file: &File, offset: u64) -> io::Result<T> {
    let mut value = T::default();
    // SAFETY: T is a plain C struct; we fill exactly its bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(
            (&mut value as *mut T).cast::<u8>(),
            std::mem::size_of::<T>(),
        )
    };
    file.read_exact_at(bytes, offset)?;
    Ok(value)
}

impl VcpuStats {
    /// Opens the statistics descriptor of `vcpu` (call before it first
    /// runs); [`VcpuStats::from_descriptor`] reads it, in any process.
    pub fn descriptor(vcpu: &VcpuFd) -> io::Result<OwnedFd> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new fd.
        let fd = unsafe { vmm_sys_util::ioctl::ioctl(vcpu, KVM_GET_STATS_FD()) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the fd was just returned to us.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The counters behind a descriptor from [`VcpuStats::descriptor`].
    pub fn from_descriptor(file: File) -> io::Result<Self> {
        let header: kvm_stats_header = read_struct(&file, 0)?;
        let desc_size = std::mem::size_of::<kvm_stats_desc>() as u64 + header.name_size as u64;
        let mut counters = Vec::new();
        for i in 0..header.num_desc as u64 {
            let at = header.desc_offset as u64 + i * desc_size;
            let mut fixed = [0u8; 16];
            file.read_exact_at(&mut fixed, at)?;
            let size = u16::from_le_bytes([fixed[6], fixed[7]]);
            let offset = u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]) as u64;
            let mut name = vec![0u8; header.name_size as usize];
            file.read_exact_at(&mut name, at + 16)?;
            let end = name.iter().position(|b| *b == 0).unwrap_or(name.len());
            if size == 1 {
                counters.push((String::from_utf8_lossy(&name[..end]).into_owned(), offset));
            }
        }
        Ok(VcpuStats {
            file,
            data_offset: header.data_offset as u64,
            counters,
        })
    }

    /// Current value of every single-valued statistic.
    pub fn read(&self) -> io::Result<serde_json::Map<String, serde_json::Value>> {
        let mut values = serde_json::Map::new();
        for (name, offset) in &self.counters {
            let mut raw = [0u8; 8];
            self.file
                .read_exact_at(&mut raw, self.data_offset + offset)?;
            values.insert(name.clone(), u64::from_le_bytes(raw).into());
        }
        Ok(values)
    }
}
