//! Newline-delimited framing over nonblocking streams: the control API's
//! clients, and the links between the parent and its cells.

use std::io::{self, ErrorKind, Read, Write};

/// Runs a nonblocking I/O call: retried on EINTR, `Ok(None)` when it would block.
pub fn nonblocking<T>(mut op: impl FnMut() -> io::Result<T>) -> io::Result<Option<T>> {
    loop {
        match op() {
            Ok(value) => return Ok(Some(value)),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

/// Whether a failed read or write means the peer went away (reset, broken
/// pipe) rather than a fault of this side.
pub fn peer_gone(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe)
}

/// Why a framed stream cannot be used any more.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The peer closed its end.
    #[error("closed by the peer")]
    Closed,
    /// A line grew past the limit without a newline.
    #[error("line longer than {0} bytes")]
    TooLong(usize),
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Whether a bounded read left lines to handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum More {
    /// Everything the stream had was read and split.
    No,
    /// The line limit was reached; more input may be buffered or unread.
    Lines,
}

/// Capacity a drained buffer keeps: one that held a large line or reply
/// (a cell's per-VM stats, a `list` of thousands of VMs) gives the rest
/// back, so a long-lived stream costs what it holds now, not the most it
/// ever held.
const KEEP_CAPACITY: usize = 64 << 10;

/// Empties `buffer`, keeping at most [`KEEP_CAPACITY`] of its capacity.
fn drain_all(buffer: &mut Vec<u8>) {
    buffer.clear();
    buffer.shrink_to(KEEP_CAPACITY);
}

/// A nonblocking stream with line-buffered input and buffered output.
#[derive(Debug)]
pub struct LineStream<S> {
    /// The stream itself (registered with the event loop by its owner).
    pub stream: S,
    input: Vec<u8>,
    /// Bytes of `input` already searched for a newline.
    scanned: usize,
    output: Vec<u8>,
    written: usize,
    max_line: usize,
}

impl<S: Read + Write> LineStream<S> {
    /// Frames `stream`, refusing lines longer than `max_line` bytes.
    pub fn new(stream: S, max_line: usize) -> Self {
        LineStream {
            stream,
            input: Vec::new(),
            scanned: 0,
            output: Vec::new(),
            written: 0,
            max_line,
        }
    }

    /// Reads what the stream has now and appends every complete line (without
    /// its newline) to `lines`. Lines already read are kept when it fails.
    pub fn read_lines(&mut self, lines: &mut Vec<Vec<u8>>) -> Result<(), FrameError> {
        self.read_lines_upto(lines, usize::MAX).map(|_| ())
    }

    /// Like `read_lines`, but appends at most `max` lines. `Ok(More::Lines)`
    /// means it stopped at `max` with input still buffered or unread: the
    /// caller must call again without waiting for readiness (an edge-triggered
    /// poll will not report data already there). A peer that writes faster
    /// than its lines are handled thus cannot hold its reader in this call.
    pub fn read_lines_upto(
        &mut self,
        lines: &mut Vec<Vec<u8>>,
        max: usize,
    ) -> Result<More, FrameError> {
        let mut room = max;
        let mut chunk = [0u8; 16 << 10];
        loop {
            room -= self.split_lines(lines, room);
            if room == 0 {
                return Ok(More::Lines);
            }
            // Checked per chunk, so a client streaming a line without end is
            // cut off at the limit, not when it stops sending.
            if self.input.len() > self.max_line {
                return Err(FrameError::TooLong(self.max_line));
            }
            let n = match nonblocking(|| self.stream.read(&mut chunk))? {
                None => return Ok(More::No),
                Some(0) => return Err(FrameError::Closed),
                Some(n) => n,
            };
            self.input.extend_from_slice(&chunk[..n]);
        }
    }

    /// Moves up to `max` complete lines from the input to `lines`; returns how many.
    fn split_lines(&mut self, lines: &mut Vec<Vec<u8>>, max: usize) -> usize {
        let (mut start, mut taken) = (0, 0);
        while taken < max {
            let Some(pos) = self.input[self.scanned..].iter().position(|b| *b == b'\n') else {
                self.scanned = self.input.len();
                break;
            };
            let end = self.scanned + pos;
            lines.push(self.input[start..end].to_vec());
            taken += 1;
            start = end + 1;
            self.scanned = start;
        }
        // One shift per call, not one per line.
        if start == self.input.len() {
            drain_all(&mut self.input);
        } else {
            self.input.drain(..start);
        }
        self.scanned -= start;
        taken
    }

    /// Queues one line (a newline is added).
    pub fn queue(&mut self, line: &[u8]) {
        self.output.extend_from_slice(line);
        self.output.push(b'\n');
    }

    /// Writes as much queued output as the stream takes now; true once all is out.
    pub fn flush(&mut self) -> io::Result<bool> {
        while self.written < self.output.len() {
            match nonblocking(|| self.stream.write(&self.output[self.written..]))? {
                Some(0) => return Err(io::Error::from(ErrorKind::WriteZero)),
                Some(n) => self.written += n,
                None => break,
            }
        }
        if self.written == self.output.len() {
            drain_all(&mut self.output);
            self.written = 0;
            return Ok(true);
        }
        Ok(false)
    }

    /// Bytes queued and not yet written.
    pub fn unsent(&self) -> usize {
        self.output.len() - self.written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair() -> (LineStream<UnixStream>, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (LineStream::new(a, 64), b)
    }

    #[test]
    fn splits_lines_across_reads() {
        let (mut framed, mut peer) = pair();
        let mut lines = Vec::new();
        peer.write_all(b"one\ntw").unwrap();
        framed.read_lines(&mut lines).unwrap();
        peer.write_all(b"o\nthree\n").unwrap();
        framed.read_lines(&mut lines).unwrap();
        assert_eq!(
            lines,
            vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]
        );
    }

    #[test]
    fn a_bounded_read_stops_at_its_limit_and_resumes_without_new_input() {
        let (mut framed, mut peer) = pair();
        peer.write_all(b"a\nb\nc\nd\ne").unwrap();
        let mut lines = Vec::new();
        assert_eq!(framed.read_lines_upto(&mut lines, 2).unwrap(), More::Lines);
        assert_eq!(lines, vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(framed.read_lines_upto(&mut lines, 2).unwrap(), More::Lines);
        assert_eq!(framed.read_lines_upto(&mut lines, 2).unwrap(), More::No);
        peer.write_all(b"\n").unwrap();
        assert_eq!(framed.read_lines_upto(&mut lines, 2).unwrap(), More::No);
        let want: Vec<Vec<u8>> = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|l| l.as_bytes().to_vec())
            .collect();
        assert_eq!(lines, want);
    }

    #[test]
    fn a_line_without_end_is_refused_at_the_limit() {
        let (mut framed, mut peer) = pair();
        peer.write_all(&[b'x'; 100]).unwrap();
        assert!(matches!(
            framed.read_lines(&mut Vec::new()),
            Err(FrameError::TooLong(64))
        ));
    }

    #[test]
    fn reports_the_peer_closing_after_its_last_line() {
        let (mut framed, mut peer) = pair();
        peer.write_all(b"last\n").unwrap();
        drop(peer);
        let mut lines = Vec::new();
        assert!(matches!(
            framed.read_lines(&mut lines),
            Err(FrameError::Closed)
        ));
        assert_eq!(lines, vec![b"last".to_vec()]);
    }

    #[test]
    fn drained_buffers_give_back_what_a_large_line_took() {
        let (a, mut peer) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut framed = LineStream::new(a, 8 << 20);
        let reader = std::thread::spawn(move || {
            let line = [vec![b'x'; 4 << 20], vec![b'\n']].concat();
            peer.write_all(&line).unwrap();
            let mut echoed = vec![0u8; line.len()];
            std::io::Read::read_exact(&mut peer, &mut echoed).unwrap();
            echoed.len()
        });
        let mut lines = Vec::new();
        while lines.is_empty() {
            framed.read_lines(&mut lines).unwrap();
        }
        assert!(framed.input.capacity() <= KEEP_CAPACITY);
        framed.queue(&lines[0]);
        while !framed.flush().unwrap() {}
        assert!(framed.output.capacity() <= KEEP_CAPACITY);
        assert_eq!(reader.join().unwrap(), (4 << 20) + 1);
    }

    #[test]
    fn queued_output_is_flushed() {
        let (mut framed, peer) = pair();
        framed.queue(b"reply");
        assert!(framed.flush().unwrap());
        assert_eq!(framed.unsent(), 0);
        let mut got = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(peer), &mut got).unwrap();
        assert_eq!(got, "reply\n");
    }
}
