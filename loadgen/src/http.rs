//! HTTP/1.1 requests and an incremental response parser (status line,
//! headers, and a body framed by Content-Length, chunked encoding, or the
//! connection's close).

use memchr::memmem;
use thiserror::Error;

/// Largest response header block accepted.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Longest chunk-size line (with extensions) accepted.
const MAX_CHUNK_LINE: usize = 1024;

/// Write a GET request for `uri` to `out` (cleared first). `close` asks the
/// server to close the connection after this reply.
pub fn write_request(out: &mut Vec<u8>, uri: &str, host: &str, close: bool) {
    out.clear();
    out.extend_from_slice(b"GET ");
    out.extend_from_slice(uri.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nUser-Agent: zipfperf/0.1\r\nHost: ");
    out.extend_from_slice(host.as_bytes());
    if close {
        out.extend_from_slice(b"\r\nConnection: close");
    }
    out.extend_from_slice(b"\r\n\r\n");
}

/// A reply that does not parse as HTTP/1.x.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ParseError {
    /// The reply does not start with `HTTP/1.x NNN`.
    #[error("malformed status line")]
    StatusLine,
    /// A header line without a colon, or a header block over the limit.
    #[error("malformed header")]
    Header,
    /// Content-Length is not a number (or appears twice with different values).
    #[error("bad Content-Length")]
    ContentLength,
    /// A chunk-size line or chunk terminator is malformed.
    #[error("bad chunked encoding")]
    Chunk,
    /// The connection closed before the reply was complete.
    #[error("connection closed mid-reply")]
    Truncated,
}

/// A complete reply's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Bytes of status line and headers, including the blank line.
    pub header_bytes: u64,
    /// Bytes of content (chunk payloads only, for chunked bodies).
    pub content_bytes: u64,
    /// Bytes of chunk framing and trailers.
    pub footer_bytes: u64,
    /// Whether the connection may carry another request.
    pub keep_alive: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Collecting the header block.
    Head,
    /// `n` content bytes left.
    Body(u64),
    /// Collecting a chunk-size line.
    ChunkLine,
    /// `n` bytes of chunk payload left.
    ChunkData(u64),
    /// Expecting the CRLF after a chunk's payload (`n` bytes of it left).
    ChunkEnd(u8),
    /// Collecting trailer lines up to the empty line.
    Trailer,
    /// Body runs until the server closes.
    UntilClose,
}

/// Incremental parser for one response at a time; `reset` before the next.
#[derive(Debug)]
pub struct ResponseParser {
    state: State,
    line: Vec<u8>,
    reply: Reply,
}

impl Default for ResponseParser {
    fn default() -> Self {
        Self::new()
    }
}

fn trim(s: &[u8]) -> &[u8] {
    let start = s
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(s.len());
    let end = s
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &s[start..end]
}

fn parse_u64(s: &[u8], radix: u32) -> Option<u64> {
    let s = std::str::from_utf8(s).ok()?;
    if s.is_empty() {
        return None;
    }
    u64::from_str_radix(s, radix).ok()
}

impl ResponseParser {
    /// A parser waiting for a status line.
    pub fn new() -> Self {
        ResponseParser {
            state: State::Head,
            line: Vec::with_capacity(512),
            reply: Reply {
                status: 0,
                header_bytes: 0,
                content_bytes: 0,
                footer_bytes: 0,
                keep_alive: false,
            },
        }
    }

    /// Forget the current response; ready for the next one.
    pub fn reset(&mut self) {
        self.state = State::Head;
        self.line.clear();
        self.reply = Reply {
            status: 0,
            header_bytes: 0,
            content_bytes: 0,
            footer_bytes: 0,
            keep_alive: false,
        };
    }

    /// Parse the header block `h` (ending with the blank line).
    fn head(&mut self, h: &[u8]) -> Result<Option<Reply>, ParseError> {
        self.reply.header_bytes = h.len() as u64;
        let mut lines = h
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let status = lines.next().ok_or(ParseError::StatusLine)?;
        if status.len() < 12 || !status.starts_with(b"HTTP/1.") || status[8] != b' ' {
            return Err(ParseError::StatusLine);
        }
        let code = &status[9..12];
        if !code.iter().all(u8::is_ascii_digit) || status.get(12).is_some_and(|&b| b != b' ') {
            return Err(ParseError::StatusLine);
        }
        let code = code.iter().fold(0u16, |a, &d| a * 10 + u16::from(d - b'0'));
        let mut keep_alive = status[7] == b'1';
        let (mut length, mut chunked) = (None, false);
        for line in lines.filter(|l| !l.is_empty()) {
            let colon = memchr::memchr(b':', line).ok_or(ParseError::Header)?;
            let (name, value) = (&line[..colon], trim(&line[colon + 1..]));
            if name.eq_ignore_ascii_case(b"content-length") {
                let n = parse_u64(value, 10).ok_or(ParseError::ContentLength)?;
                if length.is_some_and(|l| l != n) {
                    return Err(ParseError::ContentLength);
                }
                length = Some(n);
            } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
                chunked =
                    value.len() >= 7 && value[value.len() - 7..].eq_ignore_ascii_case(b"chunked");
            } else if name.eq_ignore_ascii_case(b"connection") {
                if value.eq_ignore_ascii_case(b"close") {
                    keep_alive = false;
                } else if value.eq_ignore_ascii_case(b"keep-alive") {
                    keep_alive = true;
                }
            }
        }
        self.reply.status = code;
        self.reply.keep_alive = keep_alive;
        if (100..200).contains(&code) || code == 204 || code == 304 {
            return Ok(Some(self.reply));
        }
        self.state = if chunked {
            State::ChunkLine
        } else if let Some(n) = length {
            State::Body(n)
        } else {
            self.reply.keep_alive = false;
            State::UntilClose
        };
        Ok(if self.state == State::Body(0) {
            Some(self.reply)
        } else {
            None
        })
    }

    /// Feed received bytes. Returns how many were consumed and, when a reply
    /// completed, its figures (bytes after it belong to the next reply).
    pub fn feed(&mut self, data: &[u8]) -> Result<(usize, Option<Reply>), ParseError> {
        let mut pos = 0;
        while pos < data.len() {
            let rest = &data[pos..];
            match self.state {
                State::Head => {
                    // Reject non-HTTP bytes as soon as the first five arrive.
                    let seen = self.line.len();
                    if seen < 5 {
                        let k = (5 - seen).min(rest.len());
                        if rest[..k] != b"HTTP/"[seen..seen + k] {
                            return Err(ParseError::StatusLine);
                        }
                    }
                    let (end, done) = if self.line.is_empty() {
                        match memmem::find(rest, b"\r\n\r\n") {
                            Some(i) => {
                                let r = self.head(&rest[..i + 4])?;
                                (i + 4, r)
                            }
                            None => {
                                self.line.extend_from_slice(rest);
                                (rest.len(), None)
                            }
                        }
                    } else {
                        let from = self.line.len().saturating_sub(3);
                        self.line.extend_from_slice(rest);
                        match memmem::find(&self.line[from..], b"\r\n\r\n") {
                            Some(i) => {
                                let total = from + i + 4;
                                let used = total - (self.line.len() - rest.len());
                                let head = std::mem::take(&mut self.line);
                                let r = self.head(&head[..total]);
                                self.line = head;
                                self.line.clear();
                                (used, r?)
                            }
                            None => (rest.len(), None),
                        }
                    };
                    if self.state == State::Head && self.line.len() > MAX_HEADER_BYTES {
                        return Err(ParseError::Header);
                    }
                    pos += end;
                    if done.is_some() {
                        return Ok((pos, done));
                    }
                }
                State::Body(n) => {
                    let k = n.min(rest.len() as u64);
                    self.reply.content_bytes += k;
                    pos += k as usize;
                    self.state = State::Body(n - k);
                    if n == k {
                        return Ok((pos, Some(self.reply)));
                    }
                }
                State::UntilClose => {
                    self.reply.content_bytes += rest.len() as u64;
                    pos = data.len();
                }
                State::ChunkData(n) => {
                    let k = n.min(rest.len() as u64);
                    self.reply.content_bytes += k;
                    pos += k as usize;
                    self.state = if n == k {
                        State::ChunkEnd(2)
                    } else {
                        State::ChunkData(n - k)
                    };
                }
                State::ChunkEnd(left) => {
                    let want: &[u8] = if left == 2 { b"\r\n" } else { b"\n" };
                    let k = (left as usize).min(rest.len());
                    if rest[..k] != want[..k] {
                        return Err(ParseError::Chunk);
                    }
                    self.reply.footer_bytes += k as u64;
                    pos += k;
                    let left = left - k as u8;
                    self.state = if left == 0 {
                        State::ChunkLine
                    } else {
                        State::ChunkEnd(left)
                    };
                }
                State::ChunkLine | State::Trailer => {
                    let Some(nl) = memchr::memchr(b'\n', rest) else {
                        self.line.extend_from_slice(rest);
                        let limit = if self.state == State::Trailer {
                            MAX_HEADER_BYTES
                        } else {
                            MAX_CHUNK_LINE
                        };
                        if self.line.len() > limit {
                            return Err(ParseError::Chunk);
                        }
                        self.reply.footer_bytes += rest.len() as u64;
                        pos = data.len();
                        continue;
                    };
                    self.line.extend_from_slice(&rest[..nl]);
                    self.reply.footer_bytes += nl as u64 + 1;
                    pos += nl + 1;
                    let line = std::mem::take(&mut self.line);
                    let text = line.strip_suffix(b"\r").unwrap_or(&line);
                    if self.state == State::Trailer {
                        if text.is_empty() {
                            self.line = line;
                            self.line.clear();
                            return Ok((pos, Some(self.reply)));
                        }
                    } else {
                        let size = text
                            .split(|&b| b == b';')
                            .next()
                            .map(trim)
                            .unwrap_or_default();
                        let n = parse_u64(size, 16).ok_or(ParseError::Chunk)?;
                        self.state = if n == 0 {
                            State::Trailer
                        } else {
                            State::ChunkData(n)
                        };
                    }
                    self.line = line;
                    self.line.clear();
                }
            }
        }
        Ok((pos, None))
    }

    /// The connection reached end of file: completes a body that runs until
    /// close; otherwise, a reply under way is truncated. `Ok(None)`: no reply
    /// was under way.
    pub fn eof(&mut self) -> Result<Option<Reply>, ParseError> {
        match self.state {
            State::UntilClose => {
                self.state = State::Head;
                Ok(Some(self.reply))
            }
            State::Head if self.line.is_empty() => Ok(None),
            _ => Err(ParseError::Truncated),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `data` in pieces of `step` bytes; collect the replies.
    fn run(data: &[u8], step: usize) -> Result<Vec<Reply>, ParseError> {
        let mut p = ResponseParser::new();
        let mut out = Vec::new();
        for piece in data.chunks(step) {
            let mut off = 0;
            while off < piece.len() {
                let (used, r) = p.feed(&piece[off..])?;
                off += used;
                if let Some(r) = r {
                    out.push(r);
                    p.reset();
                }
            }
        }
        if let Some(r) = p.eof()? {
            out.push(r);
        }
        Ok(out)
    }

    const CL: &[u8] = b"HTTP/1.1 200 OK\r\nServer: x\r\nContent-Length: 5\r\n\r\nhello";
    const CHUNKED: &[u8] =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n";

    #[test]
    fn content_length_in_any_split() {
        for step in [1, 2, 3, 7, 1000] {
            let mut two = CL.to_vec();
            two.extend_from_slice(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            );
            let r = run(&two, step).unwrap();
            assert_eq!(r.len(), 2, "step {step}");
            assert_eq!(
                (
                    r[0].status,
                    r[0].header_bytes,
                    r[0].content_bytes,
                    r[0].keep_alive
                ),
                (200, 49, 5, true)
            );
            assert_eq!(
                (r[1].status, r[1].content_bytes, r[1].keep_alive),
                (404, 0, false)
            );
        }
    }

    #[test]
    fn chunked_body_and_trailer() {
        for step in [1, 4, 1000] {
            let r = run(CHUNKED, step).unwrap();
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].content_bytes, 11);
            assert_eq!(r[0].header_bytes, 47);
            assert_eq!(r[0].footer_bytes, (CHUNKED.len() - 47 - 11) as u64);
        }
    }

    #[test]
    fn body_until_close_for_http10() {
        let r = run(b"HTTP/1.0 200 OK\r\n\r\nabcdef", 3).unwrap();
        assert_eq!(
            (r[0].status, r[0].content_bytes, r[0].keep_alive),
            (200, 6, false)
        );
    }

    #[test]
    fn no_body_statuses() {
        let r = run(
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n",
            5,
        )
        .unwrap();
        assert_eq!((r[0].status, r[0].content_bytes), (304, 0));
    }

    #[test]
    fn malformed_replies_are_errors() {
        assert_eq!(run(b"garbage\r\n\r\n", 100), Err(ParseError::StatusLine));
        assert_eq!(
            run(b"HTTP/1.1 2x0 OK\r\n\r\n", 100),
            Err(ParseError::StatusLine)
        );
        assert_eq!(
            run(b"HTTP/1.1 200 OK\r\nnocolon\r\n\r\n", 100),
            Err(ParseError::Header)
        );
        assert_eq!(
            run(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", 100),
            Err(ParseError::ContentLength)
        );
        assert_eq!(
            run(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                100
            ),
            Err(ParseError::Chunk)
        );
        assert_eq!(
            run(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
                100
            ),
            Err(ParseError::Chunk)
        );
        let huge = [
            b"HTTP/1.1 200 OK\r\n".as_slice(),
            &vec![b'a'; MAX_HEADER_BYTES + 10],
        ]
        .concat();
        assert_eq!(run(&huge, 4096), Err(ParseError::Header));
    }

    #[test]
    fn short_replies_are_truncated() {
        assert_eq!(run(&CL[..CL.len() - 1], 10), Err(ParseError::Truncated));
        assert_eq!(
            run(b"HTTP/1.1 200 OK\r\nContent-Le", 10),
            Err(ParseError::Truncated)
        );
        assert_eq!(run(&CHUNKED[..60], 10), Err(ParseError::Truncated));
        assert_eq!(run(b"", 10), Ok(vec![]));
    }

    #[test]
    fn request_format() {
        let mut v = Vec::new();
        write_request(&mut v, "/a", "h", true);
        assert_eq!(
            v,
            b"GET /a HTTP/1.1\r\nUser-Agent: zipfperf/0.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        );
    }
}
