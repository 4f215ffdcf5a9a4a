//! The swap device: one file or block device opened with O_DIRECT, with an
//! optional disk model whose service times are added to the real I/O.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::disk::{DiskModel, DiskUsage};

/// Granularity of swap-file reservations: few `fallocate` calls per boot.
pub const RESERVE_STEP: u64 = 256 << 20;
use crate::error::PagerError;

/// Alignment of O_DIRECT buffers (covers 4 KiB logical sectors).
const ALIGN: usize = 4096;

/// A zeroed, page-aligned buffer for O_DIRECT transfers.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is exclusively owned heap memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to the alignment).
    pub fn new(len: usize) -> AlignedBuf {
        let len = len.max(ALIGN).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(len, ALIGN).expect("valid layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }

    /// Grows to at least `len` bytes (contents are not preserved).
    pub fn reserve(&mut self, len: usize) {
        if len > self.len {
            *self = AlignedBuf::new(len.next_power_of_two());
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: owned allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: owned allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe {
            dealloc(
                self.ptr,
                Layout::from_size_align(self.len, ALIGN).expect("valid layout"),
            )
        };
    }
}

/// Creates a swap file at `path`: O_DIRECT, mode 0600, never following a
/// symlink nor opening an existing file. Unless `keep`, the file ends up
/// without a name: an O_TMPFILE in `path`'s directory, or (on a filesystem
/// without O_TMPFILE) the exclusive create unlinked at once.
fn create_swap_file(path: &Path, keep: bool) -> io::Result<File> {
    if !keep {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let tmp = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE | libc::O_DIRECT)
            .open(dir);
        match tmp {
            Ok(file) => return Ok(file),
            // Unsupported here (EOPNOTSUPP, EISDIR on old kernels, EINVAL
            // with O_DIRECT): fall back to create + unlink.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)
                ) => {}
            Err(e) => return Err(e),
        }
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW)
        .open(path)?;
    if !keep {
        std::fs::remove_file(path)?;
    }
    Ok(file)
}

/// The direct I/O alignment the kernel reports for `file` (statx
/// STATX_DIOALIGN, Linux 6.1+), else a page, which every device accepts.
fn dio_alignment(file: &File) -> u64 {
    // SAFETY: statx fills the zeroed struct; the path is empty and
    // AT_EMPTY_PATH makes it describe the descriptor.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let r = unsafe {
        libc::statx(
            std::os::fd::AsRawFd::as_raw_fd(file),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut st,
        )
    };
    let align = st.stx_dio_offset_align as u64;
    if r == 0 && st.stx_mask & libc::STATX_DIOALIGN != 0 && align.is_power_of_two() {
        align.max(st.stx_dio_mem_align as u64).min(ALIGN as u64)
    } else {
        ALIGN as u64
    }
}

/// The opened swap device.
pub struct SwapDevice {
    file: File,
    path: PathBuf,
    is_blockdev: bool,
    capacity: u64,
    /// Alignment of direct I/O on it: offsets and lengths are multiples.
    sector: u64,
    /// Bytes from the start of a swap file whose blocks are allocated.
    reserved: Mutex<u64>,
    model: Mutex<DiskModel>,
    /// Whether the model's service times are charged (see `set_modeled`).
    modeled: AtomicBool,
    epoch: Instant,
}

impl SwapDevice {
    /// Opens the swap device with O_DIRECT. A block device at `path` is
    /// opened as it is (never created, never removed) and must hold
    /// `capacity`. Otherwise `path` must not exist: the file is created
    /// mode 0600 and exclusively (O_EXCL | O_NOFOLLOW: a file or a symlink
    /// planted at the name is refused, never followed or reused), sized
    /// sparse to `capacity` until [`Self::reserve`] allocates it. Unless
    /// `keep`, it has no name from the moment it is opened (an O_TMPFILE in
    /// the path's directory where the filesystem supports it, else unlinked
    /// right after the exclusive create), so nothing is left behind however
    /// the process ends, SIGKILL included.
    pub fn open(
        path: &Path,
        capacity: u64,
        keep: bool,
        model: DiskModel,
    ) -> Result<SwapDevice, PagerError> {
        let unwritable = |source| PagerError::SwapUnwritable {
            path: path.to_path_buf(),
            source,
        };
        let is_blockdev = match std::fs::metadata(path) {
            Ok(meta) if meta.file_type().is_block_device() => true,
            Ok(_) => return Err(PagerError::SwapExists(path.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(unwritable(e)),
        };
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) && !is_blockdev
        {
            return Err(PagerError::SwapExists(path.to_path_buf()));
        }
        let file = if is_blockdev {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .map_err(unwritable)?
        } else {
            create_swap_file(path, keep).map_err(|e| match e.raw_os_error() {
                Some(libc::EEXIST) | Some(libc::ELOOP) => {
                    PagerError::SwapExists(path.to_path_buf())
                }
                _ => unwritable(e),
            })?
        };
        if is_blockdev {
            let mut size: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64.
            let r = unsafe {
                libc::ioctl(
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    0x8008_1272,
                    &mut size,
                )
            };
            if r < 0 {
                return Err(unwritable(io::Error::last_os_error()));
            }
            if size < capacity {
                return Err(PagerError::BadSwapSize {
                    bytes: capacity,
                    reason: format!("block device {} holds only {size} bytes", path.display()),
                });
            }
        } else {
            // A fresh file: every read is of a block this run wrote, but a
            // smaller file would make reads past its end short.
            file.set_len(capacity).map_err(unwritable)?;
        }
        Ok(SwapDevice {
            sector: dio_alignment(&file),
            file,
            path: path.to_path_buf(),
            is_blockdev,
            capacity,
            reserved: Mutex::new(0),
            model: Mutex::new(model),
            modeled: AtomicBool::new(true),
            epoch: Instant::now(),
        })
    }

    /// Allocates the file's first `bytes` (at most its capacity, in steps of
    /// `step`: [`RESERVE_STEP`] for VMs' regions), so guests dirtying their
    /// RAM later cannot meet ENOSPC mid-run. Err when the filesystem has no
    /// room for them.
    pub fn reserve(&self, bytes: u64, step: u64) -> Result<(), PagerError> {
        let mut reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        if self.is_blockdev || bytes <= *reserved {
            return Ok(());
        }
        let upto = bytes.next_multiple_of(step).min(self.capacity);
        if upto <= *reserved {
            return Ok(());
        }
        // SAFETY: fallocate on our own descriptor; mode 0 keeps the size.
        let r = unsafe {
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&self.file),
                0,
                *reserved as libc::off_t,
                (upto - *reserved) as libc::off_t,
            )
        };
        if r < 0 {
            return Err(PagerError::SwapReserve {
                path: self.path.clone(),
                bytes: upto,
                source: io::Error::last_os_error(),
            });
        }
        *reserved = upto;
        Ok(())
    }

    /// Alignment of direct I/O on the device (offsets and lengths).
    pub fn sector(&self) -> u64 {
        self.sector
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Path of the device.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Charges (true, the default) or suspends (false) the disk model's
    /// service times. Suspended, requests take only the real device's time
    /// and leave the modeled drives untouched: a set-up phase whose outcome
    /// (what is resident, what is on swap) is wanted but not its duration.
    pub fn set_modeled(&self, on: bool) {
        self.modeled.store(on, Ordering::Relaxed);
    }

    /// Whether the disk model's service times are being charged.
    pub fn modeled(&self) -> bool {
        self.modeled.load(Ordering::Relaxed)
    }

    /// What the modeled drives have done so far.
    pub fn disk_usage(&self) -> DiskUsage {
        self.model.lock().unwrap_or_else(|e| e.into_inner()).usage()
    }

    /// Waits out the modeled completion of a request issued at `issued`
    /// (seconds since open) that already finished for real.
    fn model_wait(&self, issued: f64, offset: u64, len: u64, write: bool) {
        if !self.modeled() {
            return;
        }
        let done = {
            let mut m = self.model.lock().unwrap_or_else(|e| e.into_inner());
            if m.is_none() {
                return;
            }
            m.submit(issued, offset, len, write)
        };
        let now = self.epoch.elapsed().as_secs_f64();
        if done > now {
            std::thread::sleep(Duration::from_secs_f64(done - now));
        }
    }

    /// Reads consecutive bytes at `offset` into the buffers in turn (one
    /// request, scattered into memory); returns seconds spent.
    pub fn read_scattered(&self, offset: u64, bufs: &mut [&mut [u8]]) -> Result<f64, PagerError> {
        let t0 = self.epoch.elapsed().as_secs_f64();
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        let err = |source| PagerError::SwapIo {
            op: "read",
            offset,
            len: total,
            source,
        };
        let mut done = 0u64;
        let mut first = 0usize;
        let mut skip = 0usize;
        while first < bufs.len() {
            let iov: Vec<libc::iovec> = bufs[first..]
                .iter_mut()
                .take(1024)
                .enumerate()
                .map(|(k, b)| {
                    let s = if k == 0 { skip } else { 0 };
                    libc::iovec {
                        iov_base: b[s..].as_mut_ptr().cast(),
                        iov_len: b.len() - s,
                    }
                })
                .collect();
            // SAFETY: every iovec points into a live, exclusively borrowed
            // buffer of the stated length.
            let n = unsafe {
                libc::preadv(
                    std::os::fd::AsRawFd::as_raw_fd(&self.file),
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    (offset + done) as libc::off_t,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err(e));
            }
            if n == 0 {
                return Err(err(io::ErrorKind::UnexpectedEof.into()));
            }
            // Advance over what was read (a short read resumes mid-buffer).
            let mut n = n as usize;
            done += n as u64;
            while n > 0 {
                let left = bufs[first].len() - skip;
                if n >= left {
                    n -= left;
                    first += 1;
                    skip = 0;
                } else {
                    skip += n;
                    n = 0;
                }
            }
        }
        self.model_wait(t0, offset, total, false);
        Ok(self.epoch.elapsed().as_secs_f64() - t0)
    }

    /// Writes `buf` at `offset`; returns seconds spent. A full device is
    /// reported as [`PagerError::SwapFull`].
    pub fn write(&self, offset: u64, buf: &[u8]) -> Result<f64, PagerError> {
        let t0 = self.epoch.elapsed().as_secs_f64();
        let len = buf.len() as u64;
        if offset + len > self.capacity {
            return Err(PagerError::SwapFull {
                needed: offset + len - self.capacity,
                capacity: self.capacity,
            });
        }
        self.file.write_all_at(buf, offset).map_err(|source| {
            if source.raw_os_error() == Some(libc::ENOSPC) {
                PagerError::SwapFull {
                    needed: len,
                    capacity: self.capacity,
                }
            } else {
                PagerError::SwapIo {
                    op: "write",
                    offset,
                    len,
                    source,
                }
            }
        })?;
        self.model_wait(t0, offset, len, true);
        Ok(self.epoch.elapsed().as_secs_f64() - t0)
    }

    /// Removes the swap file if this run created it and it is not kept.
    pub fn remove_if_owned(&self) {
        // Nothing to do: a swap file not kept lost its name when it was
        // opened (see `open`), a kept one and a block device stay.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::DiskSpec;

    fn device(name: &str) -> SwapDevice {
        let path =
            std::env::temp_dir().join(format!("swap-test-{name}-{}.img", std::process::id()));
        let capacity = 1 << 20;
        let model = DiskSpec::parse("hdd").expect("hdd").build(capacity);
        SwapDevice::open(&path, capacity, false, model).expect("open")
    }

    fn modeled_busy(dev: &SwapDevice) -> f64 {
        dev.model.lock().expect("model").max_busy_seconds()
    }

    #[test]
    fn suspended_model_charges_nothing_and_resumes() {
        let dev = device("suspend");
        let buf = AlignedBuf::new(32 << 10);
        dev.set_modeled(false);
        assert!(!dev.modeled());
        dev.write(0, buf.as_slice()).expect("write");
        assert_eq!(
            modeled_busy(&dev),
            0.0,
            "a suspended model must not queue the request"
        );
        dev.set_modeled(true);
        dev.write(64 << 10, buf.as_slice()).expect("write");
        assert!(
            modeled_busy(&dev) > 0.0,
            "the resumed model charges the next request"
        );
    }

    fn open_at(path: &Path, keep: bool) -> Result<SwapDevice, PagerError> {
        let model = DiskSpec::parse("none").expect("none").build(1 << 20);
        SwapDevice::open(path, 1 << 20, keep, model)
    }

    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("swap-open-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("scratch dir");
        dir
    }

    /// Issue 39 item 2: not kept, the swap file has no name once opened
    /// (SIGKILL leaves nothing), and a file it made is 0600 to its process.
    #[test]
    fn swap_file_is_nameless_unless_kept_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch_dir("nameless");
        let path = dir.join("swap.img");
        let dev = open_at(&path, false).expect("open");
        assert!(
            !path.exists(),
            "an unkept swap file must be unlinked at open"
        );
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "no file left in the directory"
        );
        let buf = AlignedBuf::new(4096);
        dev.write(0, buf.as_slice())
            .expect("the nameless file is usable");
        let meta = dev.file.metadata().unwrap();
        assert_eq!(
            meta.permissions().mode() & 0o777 & !0o600,
            0,
            "at most 0600"
        );
        drop(dev);
        let kept = open_at(&path, true).expect("open kept");
        let mode = std::fs::metadata(&path)
            .expect("a kept file has its name")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "kept swap file is 0600, not {mode:o}");
        drop(kept);
        assert!(path.exists(), "kept");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An existing file or a symlink at the swap path is refused: never
    /// reused, never followed (O_EXCL | O_NOFOLLOW), never truncated.
    #[test]
    fn swap_path_that_exists_is_refused() {
        let dir = scratch_dir("exists");
        let target = dir.join("victim");
        std::fs::write(&target, b"precious").unwrap();
        let link = dir.join("swap.img");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for (path, keep) in [
            (&target, false),
            (&target, true),
            (&link, false),
            (&link, true),
        ] {
            let e = open_at(path, keep).err().expect("refused").to_string();
            assert!(e.contains("already exists") && !e.contains('\n'), "{e}");
        }
        let dangling = dir.join("dangling.img");
        std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
        assert!(open_at(&dangling, true).is_err());
        assert!(
            !dir.join("nowhere").exists(),
            "a dangling symlink is not followed"
        );
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
