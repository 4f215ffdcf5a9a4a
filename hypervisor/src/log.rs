//! One-line messages on stderr that can neither panic nor block.
//!
//! `eprintln!` panics when stderr fails and blocks while a pipe's reader
//! does not read. [`log!`](crate::log!) formats the message, makes it one
//! line of at most [`MAX_LINE`] bytes, and writes it only if stderr takes it
//! now (poll with a zero timeout, then one `write`); otherwise the message
//! is dropped. Errors are ignored.

/// Longest message written (a pipe takes up to PIPE_BUF bytes at once).
pub const MAX_LINE: usize = 4000;

/// Writes `message` to stderr as one line, if stderr takes it without waiting.
pub fn write_line(message: &str) {
    let mut line: String = message
        .chars()
        .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
        .collect();
    if line.len() > MAX_LINE {
        let mut end = MAX_LINE;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    line.push('\n');
    let mut fds = [libc::pollfd {
        fd: libc::STDERR_FILENO,
        events: libc::POLLOUT,
        revents: 0,
    }];
    // SAFETY: one valid pollfd; a zero timeout never waits.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
    if ready != 1 || fds[0].revents & libc::POLLOUT == 0 {
        return;
    }
    // SAFETY: writes bytes of a live buffer to fd 2; the result is ignored.
    let _ = unsafe { libc::write(libc::STDERR_FILENO, line.as_ptr().cast(), line.len()) };
}

/// `log!("densevm: ...", args)`: like `eprintln!`, but one line, never a
/// panic, never a wait (see [`write_line`](crate::log::write_line)).
#[macro_export]
macro_rules! log {
    ($($arg:tt)*) => {
        $crate::log::write_line(&format!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_message_with_newlines_is_written_without_panic() {
        write_line(&"é\nx".repeat(3000));
        crate::log!("densevm: test {}", 1);
    }
}
