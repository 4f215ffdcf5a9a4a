//! Request traces: what densevm records (`--record-trace`) and pagesim
//! replays.
//!
//! Format (little-endian):
//!
//! | bytes | content |
//! |---|---|
//! | 8 | magic `SBTRACE1` |
//! | 4 | header length H (u32) |
//! | H | header as JSON: `{"block_bytes","vm_ram_bytes","vms","request_ranges":[[offset,len],...]}` |
//! | 4 each | one VM id (u32) per request, in arrival order, until end of file |
//!
//! Every request of a VM touches the same RAM ranges (`request_ranges`): the
//! working-set range and the stack/bss pages of the web-server guest.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::PagerError;

/// Magic bytes at the start of a trace.
pub const MAGIC: &[u8; 8] = b"SBTRACE1";

/// Trace header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// Block size of the recording run (informational; pagesim may replay
    /// with another).
    pub block_bytes: u64,
    /// RAM size of every VM.
    pub vm_ram_bytes: u64,
    /// Number of VMs (ids are 0..vms).
    pub vms: u32,
    /// RAM (offset, length) ranges touched by every request.
    pub request_ranges: Vec<(u64, u64)>,
}

fn terr(path: &Path, e: impl std::fmt::Display) -> PagerError {
    PagerError::Trace {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Writes a trace.
pub struct TraceWriter {
    out: BufWriter<File>,
    path: PathBuf,
    vms: u32,
}

impl TraceWriter {
    /// Creates `path` and writes the header.
    pub fn create(path: impl AsRef<Path>, header: &TraceHeader) -> Result<TraceWriter, PagerError> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| terr(path, e))?;
        let mut out = BufWriter::with_capacity(1 << 16, file);
        let json = serde_json::to_vec(header).map_err(|e| terr(path, e))?;
        out.write_all(MAGIC)
            .and_then(|_| out.write_all(&(json.len() as u32).to_le_bytes()))
            .and_then(|_| out.write_all(&json))
            .map_err(|e| terr(path, e))?;
        Ok(TraceWriter {
            out,
            path: path.to_path_buf(),
            vms: header.vms,
        })
    }

    /// Appends one request to `vm`.
    pub fn record(&mut self, vm: u32) -> Result<(), PagerError> {
        if vm >= self.vms {
            return Err(terr(
                &self.path,
                format!("VM {vm} out of range (header says {} VMs)", self.vms),
            ));
        }
        self.out
            .write_all(&vm.to_le_bytes())
            .map_err(|e| terr(&self.path, e))
    }

    /// Flushes and closes the trace.
    pub fn finish(mut self) -> Result<(), PagerError> {
        self.out.flush().map_err(|e| terr(&self.path, e))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(|e| terr(&self.path, e))
    }
}

/// Reads a trace.
pub struct TraceReader {
    input: BufReader<File>,
    path: PathBuf,
    /// The trace's header.
    pub header: TraceHeader,
}

impl TraceReader {
    /// Opens `path` and reads the header.
    pub fn open(path: impl AsRef<Path>) -> Result<TraceReader, PagerError> {
        let path = path.as_ref();
        let mut input =
            BufReader::with_capacity(1 << 16, File::open(path).map_err(|e| terr(path, e))?);
        let mut magic = [0u8; 8];
        let mut len = [0u8; 4];
        input
            .read_exact(&mut magic)
            .and_then(|_| input.read_exact(&mut len))
            .map_err(|_| terr(path, "not a trace (too short)"))?;
        if &magic != MAGIC {
            return Err(terr(path, "not a trace (bad magic)"));
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > 1 << 20 {
            return Err(terr(path, "header too large"));
        }
        let mut json = vec![0u8; len];
        input.read_exact(&mut json).map_err(|e| terr(path, e))?;
        let header: TraceHeader = serde_json::from_slice(&json).map_err(|e| terr(path, e))?;
        Ok(TraceReader {
            input,
            path: path.to_path_buf(),
            header,
        })
    }

    /// Next request's VM id; `None` at the end.
    pub fn next_vm(&mut self) -> Result<Option<u32>, PagerError> {
        let mut b = [0u8; 4];
        match self.input.read_exact(&mut b) {
            Ok(()) => {
                let vm = u32::from_le_bytes(b);
                if vm >= self.header.vms {
                    return Err(terr(
                        &self.path,
                        format!("record names VM {vm}, header has {}", self.header.vms),
                    ));
                }
                Ok(Some(vm))
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
            Err(e) => Err(terr(&self.path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        let path = std::env::temp_dir().join(format!("trace-test-{}.bin", std::process::id()));
        let h = TraceHeader {
            block_bytes: 32768,
            vm_ram_bytes: 4 << 20,
            vms: 3,
            request_ranges: vec![(0, 917504), ((4 << 20) - 65536, 65536)],
        };
        let mut w = TraceWriter::create(&path, &h).unwrap();
        for vm in [0, 2, 1, 2] {
            w.record(vm).unwrap();
        }
        assert!(w.record(3).is_err());
        w.finish().unwrap();
        let mut r = TraceReader::open(&path).unwrap();
        assert_eq!(r.header, h);
        let mut got = Vec::new();
        while let Some(vm) = r.next_vm().unwrap() {
            got.push(vm);
        }
        assert_eq!(got, vec![0, 2, 1, 2]);
        std::fs::remove_file(&path).unwrap();
    }
}
