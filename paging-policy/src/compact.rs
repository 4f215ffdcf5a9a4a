//! Compact swap, for hosts that hold far more VMs than their disk could back
//! whole (scale to zero, `--idle-after`): what the pager stores for a block
//! it evicts.
//!
//! * The image's **template** is the memory of the first VM the pager
//!   hibernates: every VM runs the same image, so a served VM's memory is
//!   the template's apart from what it wrote of its own (Potemkin's delta
//!   virtualization). The template is kept once, in the pager's memory.
//! * A block equal to its template block (zero before there is a template)
//!   stores nothing.
//! * Any other block is stored as its difference from the template block
//!   (XOR), in a record of whole device sectors: as the runs of its 16-byte
//!   chunks that are not zero when those fit in one sector or take fewer
//!   sectors than LZ4 (a clone's few words of its own decode at memcpy
//!   speed, where LZ4 took ~8 us a 32 KiB block on a wake's path), else
//!   compressed with LZ4; a record that would not shrink is stored raw.
//! * The records of one eviction are packed into one extent and written at
//!   once; a wake's prefetch reads adjacent records with one request.
//!
//! The ledger still places blocks at logical locations (a VM's region, or
//! its log): this store maps each logical location to its record, so the
//! ledger's layouts, busy marks and accounting are unchanged, and the disk
//! holds only the records. A guest gains nothing from making its blocks
//! differ from the template (a hostile template only makes its clones'
//! records larger): a block's record always decodes to exactly its bytes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use serde_json::{json, Value};

use crate::error::PagerError;
use crate::policy::{BlockId, VmId};
use crate::space::LogSpace;
use crate::swap::{AlignedBuf, SwapDevice};

/// Growth step of the records' part of the swap file: small, so the file
/// follows what the records use (a 256 MiB step would be 256 KiB per VM at
/// 1,000 VMs).
const GROW_STEP: u64 = 4 << 20;

/// Where a block's copy is, and how to decode it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    /// Byte offset on the device (unused when `len` is 0).
    offset: u64,
    /// Bytes stored; 0 = nothing stored (the template block, or zeros).
    len: u32,
    /// How the bytes are held.
    encoding: Encoding,
    /// XORed with the template block (else stored as it is).
    delta: bool,
}

/// One block to store: its VM and index, the logical location the ledger
/// gave it, and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Put<'a> {
    /// VM of the block.
    pub vm: VmId,
    /// Block index in the VM's RAM.
    pub block: BlockId,
    /// Logical location (the ledger's).
    pub loc: u64,
    /// The block's bytes.
    pub data: &'a [u8],
}

/// One block to read back: its index and logical location, and where its
/// bytes go.
#[derive(Debug)]
pub struct Get<'a> {
    /// Block index in the VM's RAM.
    pub block: BlockId,
    /// Logical location (the ledger's).
    pub loc: u64,
    /// Receives the block's bytes.
    pub data: &'a mut [u8],
}

/// The template being captured: the first hibernated VM's blocks, as its
/// hibernation evicts them.
struct Capture {
    vm: VmId,
    image: Vec<u8>,
}

/// The sealed template.
struct Template {
    /// The VM it was captured from.
    vm: VmId,
    image: Vec<u8>,
    /// LZ4 ratio of its non-zero blocks on their own (no delta): how
    /// compressible the image's memory is, reported so that no figure hides
    /// a trivially compressible guest.
    lz4_ratio: f64,
}

/// Records and the free space of the device.
struct Records {
    by_loc: HashMap<u64, Record>,
    free: LogSpace,
    /// End of the device's part records may use (allocated on the file).
    limit: u64,
    /// Bytes of the device the records hold (whole sectors).
    stored: u64,
}

/// Per-thread buffers of the store. Records are packed in a plain vector,
/// sized by what they take, then copied to the aligned buffer of the write:
/// an aligned buffer for the worst case (every block incompressible) would
/// be touched whole at each allocation.
pub struct CompactScratch {
    delta: Vec<u8>,
    records: Vec<u8>,
    packed: AlignedBuf,
    read: AlignedBuf,
    /// What the last [`CompactSwap::fetch`] read: per block, its record and
    /// where its bytes are in `read` (`None`: a block it was not asked for).
    fetched: Vec<Option<(Record, usize)>>,
}

impl CompactScratch {
    /// Buffers for blocks of `block` bytes.
    pub fn new(block: usize) -> CompactScratch {
        CompactScratch {
            delta: vec![0; block],
            records: Vec::new(),
            packed: AlignedBuf::new(block),
            read: AlignedBuf::new(block),
            fetched: Vec::new(),
        }
    }
}

/// The compact store of one pager.
pub struct CompactSwap {
    block: usize,
    /// Device sector: records are whole sectors (O_DIRECT alignment).
    sector: u64,
    records: Mutex<Records>,
    capture: Mutex<Option<Capture>>,
    template: OnceLock<Template>,
    blocks_in: AtomicU64,
    blocks_same: AtomicU64,
    bytes_in: AtomicU64,
    compress_ns: AtomicU64,
    blocks_out: AtomicU64,
    decompress_ns: AtomicU64,
}

/// How a record holds its block (or the block's difference from the
/// template block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// The bytes themselves.
    Raw,
    /// LZ4-compressed.
    Lz4,
    /// The runs of chunks that are not zero ([`sparse_encode`]).
    Sparse,
}

/// Granularity of [`Encoding::Sparse`]; a block is a whole number of them.
const CHUNK: usize = 16;
/// A sparse run's header: its first chunk and its chunk count (u32 each, LE).
const RUN_HEADER: usize = 8;

/// The runs of `data`'s chunks that are not zero, as (first, count).
fn nonzero_runs(data: &[u8]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let zero = |c: &[u8]| u128::from_ne_bytes(c.try_into().expect("one chunk")) == 0;
    let chunks = data.len() / CHUNK;
    let mut next = 0;
    std::iter::from_fn(move || {
        while next < chunks && zero(&data[next * CHUNK..][..CHUNK]) {
            next += 1;
        }
        let first = next;
        while next < chunks && !zero(&data[next * CHUNK..][..CHUNK]) {
            next += 1;
        }
        (next > first).then_some((first, next - first))
    })
}

/// Bytes [`sparse_encode`] takes for `data`.
fn sparse_len(data: &[u8]) -> usize {
    nonzero_runs(data)
        .map(|(_, n)| RUN_HEADER + n * CHUNK)
        .sum()
}

/// Writes `data`'s non-zero runs into `out` (exactly [`sparse_len`] bytes).
fn sparse_encode(data: &[u8], out: &mut [u8]) {
    let mut at = 0;
    for (first, n) in nonzero_runs(data) {
        out[at..at + 4].copy_from_slice(&(first as u32).to_le_bytes());
        out[at + 4..at + 8].copy_from_slice(&(n as u32).to_le_bytes());
        out[at + 8..][..n * CHUNK].copy_from_slice(&data[first * CHUNK..][..n * CHUNK]);
        at += RUN_HEADER + n * CHUNK;
    }
}

/// XORs the runs of a sparse record into `out`; a run outside the block is
/// an error (the record is corrupt).
fn sparse_apply(record: &[u8], out: &mut [u8]) -> Result<(), String> {
    let mut rest = record;
    while !rest.is_empty() {
        let word = |at: usize| {
            rest.get(at..at + 4)
                .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")) as usize)
        };
        let (Some(first), Some(n)) = (word(0), word(4)) else {
            return Err("sparse run header cut short".into());
        };
        let bytes = n * CHUNK;
        let run = rest
            .get(RUN_HEADER..RUN_HEADER + bytes)
            .ok_or("sparse run cut short")?;
        let target = out
            .get_mut(first * CHUNK..)
            .and_then(|o| o.get_mut(..bytes))
            .ok_or("sparse run outside the block")?;
        xor_in_place(target, run);
        rest = &rest[RUN_HEADER + bytes..];
    }
    Ok(())
}

fn xor_into(out: &mut [u8], a: &[u8], b: &[u8]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x ^ y;
    }
}

fn xor_in_place(out: &mut [u8], b: &[u8]) {
    for (o, y) in out.iter_mut().zip(b) {
        *o ^= y;
    }
}

impl CompactSwap {
    /// A store for blocks of `block` bytes on a device whose direct I/O is
    /// aligned to `sector` bytes.
    pub fn new(block: usize, sector: u64) -> CompactSwap {
        CompactSwap {
            block,
            sector,
            records: Mutex::new(Records {
                by_loc: HashMap::new(),
                free: LogSpace::default(),
                limit: 0,
                stored: 0,
            }),
            capture: Mutex::new(None),
            template: OnceLock::new(),
            blocks_in: AtomicU64::new(0),
            blocks_same: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            compress_ns: AtomicU64::new(0),
            blocks_out: AtomicU64::new(0),
            decompress_ns: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes of the device holding records.
    pub fn stored_bytes(&self) -> u64 {
        self.lock().stored
    }

    /// `vm` is about to be hibernated: with no template yet and none being
    /// captured, its blocks become the template as they are evicted.
    pub fn begin_capture(&self, vm: VmId, ram_bytes: usize) {
        if self.template.get().is_some() {
            return;
        }
        let mut capture = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        if capture.is_none() {
            *capture = Some(Capture {
                vm,
                image: vec![0; ram_bytes],
            });
        }
    }

    /// `vm`'s hibernation is over: if its blocks were being captured, they
    /// are the template from now on.
    pub fn end_capture(&self, vm: VmId) {
        let mut capture = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        if capture.as_ref().is_none_or(|c| c.vm != vm) {
            return;
        }
        let image = capture.take().expect("checked").image;
        // Over the blocks with content: untouched RAM (zeros) would make
        // any guest look compressible.
        let (mut raw, mut packed) = (0usize, 0usize);
        for block in image
            .chunks(self.block)
            .filter(|b| b.iter().any(|&x| x != 0))
        {
            raw += block.len();
            packed += lz4_flex::block::compress(block).len().min(block.len());
        }
        let lz4_ratio = raw as f64 / packed.max(1) as f64;
        let _ = self.template.set(Template {
            vm,
            image,
            lz4_ratio,
        });
    }

    /// The VM the template was captured from, once it is sealed.
    pub fn template_vm(&self) -> Option<VmId> {
        self.template.get().map(|t| t.vm)
    }

    /// Block `block` of the sealed template (zeros past what it captured).
    pub fn template_block(&self, block: BlockId) -> Option<&[u8]> {
        let at = block as usize * self.block;
        self.template.get()?.image.get(at..at + self.block)
    }

    /// Stores `puts` (each replacing any earlier copy at its location);
    /// returns seconds of device I/O.
    pub fn write(
        &self,
        dev: &SwapDevice,
        puts: &[Put<'_>],
        s: &mut CompactScratch,
    ) -> Result<f64, PagerError> {
        let bs = self.block;
        let sector = self.sector as usize;
        self.copy_into_capture(puts);
        let template = self.template.get();
        let t0 = Instant::now();
        let most = lz4_flex::block::get_maximum_output_size(bs);
        s.records.clear();
        let mut made = Vec::with_capacity(puts.len());
        for p in puts {
            let base = template.map(|t| &t.image[p.block as usize * bs..][..bs]);
            let delta: &[u8] = match base {
                Some(base) => {
                    xor_into(&mut s.delta, p.data, base);
                    &s.delta
                }
                None => p.data,
            };
            let at = s.records.len();
            let mut record = Record {
                offset: at as u64,
                len: 0,
                encoding: Encoding::Raw,
                delta: base.is_some(),
            };
            let sparse = sparse_len(delta);
            if sparse > 0 {
                // One sector is the least a record takes: no need to try LZ4.
                let lz4 = (sparse > sector).then(|| {
                    s.records.resize(at + most, 0);
                    lz4_flex::block::compress_into(delta, &mut s.records[at..]).ok()
                });
                let sectors = |n: usize| n.div_ceil(sector);
                let shrinks = |n: usize| n + sector <= bs;
                let lz4 = lz4.flatten().filter(|&n| shrinks(n));
                let (len, encoding) =
                    if shrinks(sparse) && lz4.is_none_or(|n| sectors(sparse) <= sectors(n)) {
                        s.records.resize(at + sparse, 0);
                        sparse_encode(delta, &mut s.records[at..]);
                        (sparse, Encoding::Sparse)
                    } else if let Some(n) = lz4 {
                        (n, Encoding::Lz4)
                    } else {
                        s.records.resize(at + bs, 0);
                        s.records[at..at + bs].copy_from_slice(delta);
                        (bs, Encoding::Raw)
                    };
                record.len = len as u32;
                record.encoding = encoding;
                s.records.resize(at + len.next_multiple_of(sector), 0);
            }
            made.push(record);
        }
        self.compress_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.blocks_in
            .fetch_add(puts.len() as u64, Ordering::Relaxed);
        self.bytes_in
            .fetch_add((puts.len() * bs) as u64, Ordering::Relaxed);
        self.blocks_same.fetch_add(
            made.iter().filter(|r| r.len == 0).count() as u64,
            Ordering::Relaxed,
        );
        let at = s.records.len();
        s.packed.reserve(at);
        s.packed.as_mut_slice()[..at].copy_from_slice(&s.records);
        let mut io = 0.0;
        if at > 0 {
            let extent = self.allocate(dev, at as u64)?;
            match extent {
                Some(start) => {
                    let written = dev.write(start, &s.packed.as_slice()[..at]);
                    if written.is_err() {
                        self.lock().free.free(start, at as u64);
                    }
                    io += written?;
                    for r in made.iter_mut().filter(|r| r.len > 0) {
                        r.offset += start;
                    }
                }
                None => io += self.write_each(dev, &mut made, s)?,
            }
        }
        let mut records = self.lock();
        for (p, r) in puts.iter().zip(made) {
            if r.len > 0 {
                records.stored += self.sectors(r.len);
            }
            if let Some(old) = records.by_loc.insert(p.loc, r) {
                Self::free_record(&mut records, old, self.sector);
            }
        }
        Ok(io)
    }

    /// The blocks of the VM being captured go into the template image.
    fn copy_into_capture(&self, puts: &[Put<'_>]) {
        let mut capture = self.capture.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = capture.as_mut() {
            for p in puts.iter().filter(|p| p.vm == c.vm) {
                let at = p.block as usize * self.block;
                if let Some(dst) = c.image.get_mut(at..at + self.block) {
                    dst.copy_from_slice(p.data);
                }
            }
        }
    }

    /// Writes the records one by one where one extent for all of them could
    /// not be found (fragmented free space, the device full to its end).
    fn write_each(
        &self,
        dev: &SwapDevice,
        made: &mut [Record],
        s: &CompactScratch,
    ) -> Result<f64, PagerError> {
        let mut io = 0.0;
        let mut placed: Vec<(u64, u64)> = Vec::new();
        let mut failed = None;
        for r in made.iter_mut().filter(|r| r.len > 0) {
            let len = self.sectors(r.len);
            let at = match self.allocate(dev, len) {
                Ok(Some(at)) => at,
                Ok(None) => {
                    failed = Some(PagerError::SwapFull {
                        needed: len,
                        capacity: dev.capacity(),
                    });
                    break;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            placed.push((at, len));
            match dev.write(
                at,
                &s.packed.as_slice()[r.offset as usize..][..len as usize],
            ) {
                Ok(t) => io += t,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            r.offset = at;
        }
        if let Some(e) = failed {
            let mut records = self.lock();
            for (at, len) in placed {
                records.free.free(at, len);
            }
            return Err(e);
        }
        Ok(io)
    }

    fn sectors(&self, len: u32) -> u64 {
        (len as u64).next_multiple_of(self.sector)
    }

    fn free_record(records: &mut Records, r: Record, sector: u64) {
        if r.len > 0 {
            let len = (r.len as u64).next_multiple_of(sector);
            records.free.free(r.offset, len);
            records.stored -= len;
        }
    }

    /// One extent of `len` bytes: from the free space, else by growing the
    /// records' part of the file; `None` when only scattered space is left.
    fn allocate(&self, dev: &SwapDevice, len: u64) -> Result<Option<u64>, PagerError> {
        let mut records = self.lock();
        if let Some(at) = records.free.alloc(len) {
            return Ok(Some(at));
        }
        let limit = records.limit;
        if limit + len > dev.capacity() {
            return Ok(None);
        }
        let grown = (limit + len)
            .next_multiple_of(GROW_STEP)
            .min(dev.capacity());
        dev.reserve(grown, GROW_STEP)?;
        records.free.free(limit, grown - limit);
        records.limit = grown;
        Ok(records.free.alloc(len))
    }

    /// Forgets the copies at `locs` (a destroyed VM's, or copies the log
    /// layout replaced).
    pub fn forget(&self, locs: &[u64]) {
        let mut records = self.lock();
        for loc in locs {
            if let Some(r) = records.by_loc.remove(loc) {
                Self::free_record(&mut records, r, self.sector);
            }
        }
    }

    /// Reads the stored copies at `locs` (the ledger's locations; `None`
    /// for a block not asked for) into `s`, one request per extent of
    /// records adjacent on the device, for [`Self::decode_fetched`] to
    /// decode block by block: a wake installs its first blocks without
    /// waiting for all of them to be decoded. Returns the seconds of I/O.
    pub fn fetch(
        &self,
        dev: &SwapDevice,
        locs: impl Iterator<Item = Option<u64>>,
        s: &mut CompactScratch,
    ) -> Result<f64, PagerError> {
        s.fetched.clear();
        {
            let records = self.lock();
            for loc in locs {
                let found = match loc {
                    None => None,
                    Some(loc) => Some(records.by_loc.get(&loc).copied().ok_or(
                        PagerError::SwapIo {
                            op: "read",
                            offset: loc,
                            len: self.block as u64,
                            source: std::io::Error::other("no record of this copy"),
                        },
                    )?),
                };
                s.fetched.push(found.map(|r| (r, 0)));
            }
        }
        let mut stored: Vec<(Record, usize)> = s
            .fetched
            .iter()
            .enumerate()
            .filter_map(|(i, f)| f.filter(|(r, _)| r.len > 0).map(|(r, _)| (r, i)))
            .collect();
        stored.sort_unstable_by_key(|(r, _)| r.offset);
        // Extents of records adjacent on the device, read back to back into
        // `read`; `at` is where the last one's bytes begin there.
        let mut extents: Vec<(u64, u64)> = Vec::new();
        let mut at = 0u64;
        for (r, i) in stored {
            let len = self.sectors(r.len);
            match extents.last_mut() {
                Some((_, end)) if *end == r.offset => *end += len,
                last => {
                    at += last.map_or(0, |(start, end)| *end - *start);
                    extents.push((r.offset, r.offset + len));
                }
            }
            let start = extents.last().expect("just pushed or grown").0;
            s.fetched[i] = Some((r, (at + r.offset - start) as usize));
        }
        let total: u64 = extents.iter().map(|(start, end)| end - start).sum();
        s.read.reserve(total as usize);
        let (mut io, mut at) = (0.0, 0usize);
        for (start, end) in extents {
            let len = (end - start) as usize;
            io += dev.read_scattered(start, &mut [&mut s.read.as_mut_slice()[at..][..len]])?;
            at += len;
        }
        Ok(io)
    }

    /// Decodes block `i` of the last [`Self::fetch`] into `g`.
    pub fn decode_fetched(
        &self,
        i: usize,
        s: &CompactScratch,
        g: &mut Get<'_>,
    ) -> Result<(), PagerError> {
        let (r, at) = s
            .fetched
            .get(i)
            .copied()
            .flatten()
            .ok_or(PagerError::SwapIo {
                op: "read",
                offset: g.loc,
                len: self.block as u64,
                source: std::io::Error::other("block was not fetched"),
            })?;
        let bytes = match r.len {
            0 => &[][..],
            len => &s.read.as_slice()[at..][..len as usize],
        };
        self.decode(r, bytes, g)
    }

    fn decode(&self, r: Record, bytes: &[u8], g: &mut Get<'_>) -> Result<(), PagerError> {
        let t0 = Instant::now();
        let corrupt = |why: String| PagerError::SwapIo {
            op: "read",
            offset: r.offset,
            len: r.len as u64,
            source: std::io::Error::other(why),
        };
        let base = match r.delta {
            true => {
                let template = self
                    .template
                    .get()
                    .ok_or_else(|| corrupt("delta without a template".into()))?;
                Some(&template.image[g.block as usize * self.block..][..self.block])
            }
            false => None,
        };
        if r.len == 0 || r.encoding == Encoding::Sparse {
            // The base, then what differs from it.
            match base {
                Some(base) => g.data.copy_from_slice(base),
                None => g.data.fill(0),
            }
            sparse_apply(bytes, g.data).map_err(corrupt)?;
        } else {
            if r.encoding == Encoding::Lz4 {
                let n = lz4_flex::block::decompress_into(bytes, g.data)
                    .map_err(|e| corrupt(format!("LZ4: {e}")))?;
                if n != g.data.len() {
                    return Err(corrupt(format!("LZ4 gave {n} bytes of {}", g.data.len())));
                }
            } else {
                g.data.copy_from_slice(bytes);
            }
            if let Some(base) = base {
                xor_in_place(g.data, base);
            }
        }
        self.blocks_out.fetch_add(1, Ordering::Relaxed);
        self.decompress_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// What the store holds and what it cost, for the pager's stats.
    pub fn to_json(&self) -> Value {
        let (records, stored, limit) = {
            let r = self.lock();
            (r.by_loc.len(), r.stored, r.limit)
        };
        let blocks_in = self.blocks_in.load(Ordering::Relaxed);
        let blocks_out = self.blocks_out.load(Ordering::Relaxed);
        let per = |ns: u64, n: u64| {
            if n == 0 {
                0.0
            } else {
                ns as f64 / n as f64 / 1e3
            }
        };
        json!({
            "copies": records,
            "stored_bytes": stored,
            "file_bytes": limit,
            "blocks_written": blocks_in,
            "blocks_same_as_template": self.blocks_same.load(Ordering::Relaxed),
            "bytes_written_uncompressed": self.bytes_in.load(Ordering::Relaxed),
            "compress_us_per_block": per(self.compress_ns.load(Ordering::Relaxed), blocks_in),
            "blocks_read": blocks_out,
            "decompress_us_per_block": per(self.decompress_ns.load(Ordering::Relaxed), blocks_out),
            "template_bytes": self.template.get().map_or(0, |t| t.image.len()),
            "template_lz4_ratio": self.template.get().map(|t| t.lz4_ratio),
            "sector_bytes": self.sector,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::DiskSpec;

    const BS: usize = 32 << 10;

    fn device(name: &str, capacity: u64) -> SwapDevice {
        let path =
            std::env::temp_dir().join(format!("compact-test-{name}-{}.img", std::process::id()));
        let model = DiskSpec::parse("none").expect("none").build(capacity);
        SwapDevice::open(&path, capacity, false, model).expect("open")
    }

    /// Server-like content: text lines, zero runs and noise, ~2-3x by LZ4.
    fn content(seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        let mut out = vec![0u8; BS];
        for (i, line) in out.chunks_mut(64).enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match (x >> 60) % 3 {
                0 => line
                    .iter_mut()
                    .enumerate()
                    .for_each(|(k, b)| *b = b'a' + ((i + k) % 26) as u8),
                1 => {}
                _ => line
                    .iter_mut()
                    .enumerate()
                    .for_each(|(k, b)| *b = (x >> (k % 8 * 8)) as u8 ^ k as u8),
            }
        }
        out
    }

    fn read_back(c: &CompactSwap, dev: &SwapDevice, block: BlockId, loc: u64) -> Vec<u8> {
        let mut data = vec![0xAAu8; BS];
        let mut s = CompactScratch::new(BS);
        c.fetch(dev, [Some(loc)].into_iter(), &mut s)
            .expect("fetch");
        let mut get = Get {
            block,
            loc,
            data: &mut data,
        };
        c.decode_fetched(0, &s, &mut get).expect("decode");
        data
    }

    /// Every block reads back exactly as written, before and after the
    /// template is sealed; a clone's block that differs from the template
    /// in a word is a record of one sector, and one equal to it none.
    #[test]
    fn blocks_round_trip_and_a_clone_stores_only_its_difference() {
        let dev = device("round-trip", 64 << 20);
        let c = CompactSwap::new(BS, dev.sector());
        let mut s = CompactScratch::new(BS);
        let blocks: Vec<Vec<u8>> = (0..4).map(|b| content(b + 7)).collect();
        c.begin_capture(0, 4 * BS);
        let puts: Vec<Put<'_>> = (0..4)
            .map(|b| Put {
                vm: 0,
                block: b,
                loc: b as u64 * BS as u64,
                data: &blocks[b as usize],
            })
            .collect();
        c.write(&dev, &puts, &mut s).expect("write");
        let plain = c.stored_bytes();
        assert!(
            plain < 4 * BS as u64 * 2 / 3 && plain > 4 * BS as u64 / 4,
            "server-like content compresses 1.5-4x: {plain}"
        );
        c.end_capture(0);
        let ratio = c.to_json()["template_lz4_ratio"].as_f64().expect("sealed");
        assert!((1.5..4.0).contains(&ratio), "{ratio}");
        for b in 0..4u32 {
            assert_eq!(
                read_back(&c, &dev, b, b as u64 * BS as u64),
                blocks[b as usize]
            );
        }
        // Fetched together (one extent, and a block not asked for), then
        // decoded in any order: each exact.
        let locs = [Some(2 * BS as u64), None, Some(0), Some(3 * BS as u64)];
        c.fetch(&dev, locs.into_iter(), &mut s).expect("fetch");
        for i in [3, 0, 2] {
            let block = (locs[i].expect("asked") / BS as u64) as BlockId;
            let mut data = vec![0u8; BS];
            let mut get = Get {
                block,
                loc: locs[i].expect("asked"),
                data: &mut data,
            };
            c.decode_fetched(i, &s, &mut get).expect("decode");
            assert_eq!(data, blocks[block as usize], "fetched {i}");
        }
        let mut data = vec![0u8; BS];
        let mut not_asked = Get {
            block: 1,
            loc: BS as u64,
            data: &mut data,
        };
        let e = c.decode_fetched(1, &s, &mut not_asked).unwrap_err();
        assert!(e.to_string().contains("not fetched"), "{e}");
        // A clone (VM 1, its region after VM 0's): block 0 as the template's,
        // block 1 with one word of its own.
        let mut own = blocks[1].clone();
        own[100..108].copy_from_slice(&0xdead_beef_u64.to_le_bytes());
        let region = 4 * BS as u64;
        let before = c.stored_bytes();
        c.write(
            &dev,
            &[
                Put {
                    vm: 1,
                    block: 0,
                    loc: region,
                    data: &blocks[0],
                },
                Put {
                    vm: 1,
                    block: 1,
                    loc: region + BS as u64,
                    data: &own,
                },
            ],
            &mut s,
        )
        .expect("write");
        assert_eq!(
            c.stored_bytes() - before,
            dev.sector(),
            "one sector for one word"
        );
        assert_eq!(read_back(&c, &dev, 0, region), blocks[0]);
        assert_eq!(read_back(&c, &dev, 1, region + BS as u64), own);
        // Rewritten in place: the old record's space is freed.
        c.write(
            &dev,
            &[Put {
                vm: 1,
                block: 1,
                loc: region + BS as u64,
                data: &blocks[1],
            }],
            &mut s,
        )
        .expect("rewrite");
        assert_eq!(c.stored_bytes(), before);
        assert_eq!(read_back(&c, &dev, 1, region + BS as u64), blocks[1]);
        c.forget(&(0..4).map(|b| b as u64 * BS as u64).collect::<Vec<_>>());
        assert_eq!(c.stored_bytes(), 0);
        assert_eq!(
            read_back(&c, &dev, 1, region + BS as u64),
            blocks[1],
            "the template stays"
        );
    }

    /// Differences from the template at the block's edges, in the middle
    /// and spread over it read back exactly, each way the store holds them:
    /// a few words as runs in one sector, a change in every chunk by LZ4 or
    /// raw; a sparse record pointing outside its block is an error.
    #[test]
    fn differences_round_trip_in_whichever_encoding_is_smaller() {
        let dev = device("sparse", 64 << 20);
        let c = CompactSwap::new(BS, dev.sector());
        let mut s = CompactScratch::new(BS);
        let template = content(11);
        c.begin_capture(0, BS);
        let put = |vm: VmId, loc: u64, data: &[u8], s: &mut CompactScratch| {
            c.write(
                &dev,
                &[Put {
                    vm,
                    block: 0,
                    loc,
                    data,
                }],
                s,
            )
            .expect("write")
        };
        put(0, 0, &template, &mut s);
        c.end_capture(0);
        let mut edges = template.clone();
        edges[0] ^= 1;
        edges[BS - 1] ^= 0x80;
        edges[5000..5040].fill(0x5a);
        let mut spread = template.clone();
        for at in (3..BS).step_by(CHUNK) {
            spread[at] = spread[at].wrapping_add(1);
        }
        let noise: Vec<u8> = (0..BS).map(|_| rand::random()).collect();
        for (i, (data, encoding)) in [
            (&edges, Encoding::Sparse),
            (&spread, Encoding::Lz4),
            (&noise, Encoding::Raw),
        ]
        .into_iter()
        .enumerate()
        {
            let loc = (i as u64 + 1) * BS as u64;
            put(1, loc, data, &mut s);
            let record = c.lock().by_loc[&loc];
            assert_eq!(record.encoding, encoding, "case {i}");
            assert_eq!(&read_back(&c, &dev, 0, loc), data, "case {i}");
        }
        let sparse = c.lock().by_loc[&(BS as u64)];
        assert!(sparse.len as u64 <= dev.sector(), "{sparse:?}");
        let mut out = vec![0u8; BS];
        let mut bad = Vec::new();
        bad.extend_from_slice(&((BS / CHUNK) as u32).to_le_bytes());
        bad.extend_from_slice(&1u32.to_le_bytes());
        bad.extend_from_slice(&[1; CHUNK]);
        assert!(sparse_apply(&bad, &mut out).is_err());
        assert!(sparse_apply(&bad[..6], &mut out).is_err());
    }

    /// Noise does not shrink: stored raw, still exact; a copy the store has
    /// no record of is an error, not zeros.
    #[test]
    fn incompressible_blocks_are_stored_raw_and_unknown_copies_are_errors() {
        let dev = device("raw", 16 << 20);
        let c = CompactSwap::new(BS, dev.sector());
        let mut s = CompactScratch::new(BS);
        let noise: Vec<u8> = (0..BS).map(|_| rand::random()).collect();
        c.write(
            &dev,
            &[Put {
                vm: 3,
                block: 2,
                loc: 0,
                data: &noise,
            }],
            &mut s,
        )
        .expect("write");
        assert_eq!(c.stored_bytes(), BS as u64);
        assert_eq!(read_back(&c, &dev, 2, 0), noise);
        let e = c
            .fetch(&dev, [Some(BS as u64)].into_iter(), &mut s)
            .unwrap_err();
        assert!(e.to_string().contains("no record"), "{e}");
    }
}
