//! The control API: newline-delimited JSON requests on a Unix socket.
//!
//! Every request gets exactly one reply line, `{"ok": true, ...}` or
//! `{"error": "..."}`; no request can take the monitor down.

use serde::Deserialize;

/// A parsed control request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Total statistics, and with `per_vm` each VM's (a light request for
    /// frequent sampling leaves them out: they cost a pass over every VM's
    /// memory map and the pager's lock while each VM's entry is built).
    Stats {
        /// Include the per-VM list.
        per_vm: bool,
    },
    /// The VMs with their addresses and states.
    List,
    /// Boot `count` more VMs.
    Create {
        /// How many.
        count: u32,
    },
    /// Stop a VM and release it.
    Destroy {
        /// Its index.
        vm: u32,
    },
    /// Make a guest fault (fault-containment testing).
    Crash {
        /// Its index.
        vm: u32,
        /// Triple fault rather than an invalid instruction.
        triple: bool,
    },
    /// The pager's settings and totals.
    Pager,
    /// Charge or suspend the pager's disk model (priming phases).
    Disk {
        /// Whether modeled service times are charged.
        modeled: bool,
    },
}

/// Largest `count` a single create request may ask for.
pub const MAX_CREATE: u32 = 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    cmd: String,
    vm: Option<u32>,
    count: Option<u32>,
    how: Option<String>,
    modeled: Option<bool>,
    vms: Option<bool>,
}

/// Why a request line was refused (its message is the error reply).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The line is not UTF-8.
    #[error("request is not UTF-8")]
    NotUtf8,
    /// The line is blank.
    #[error("empty request")]
    Empty,
    /// The line is not a request object.
    #[error("malformed request: {0}")]
    Malformed(serde_json::Error),
    /// A field the command needs is missing.
    #[error("'{cmd}' needs {field}")]
    Missing {
        /// The command.
        cmd: String,
        /// The field, as the client should write it.
        field: &'static str,
    },
    /// `create` with no VM to create.
    #[error("'create' needs count >= 1")]
    NoCount,
    /// `create` with more than [`MAX_CREATE`] VMs.
    #[error("'create' takes at most {MAX_CREATE} VMs at a time")]
    TooMany,
    /// `crash` with an unknown kind.
    #[error("unknown crash kind '{0}' (ud2 or triple)")]
    CrashKind(String),
    /// An unknown command.
    #[error("unknown command '{0}'")]
    Unknown(String),
}

/// Parses one request line.
pub fn parse(line: &[u8]) -> Result<Request, ApiError> {
    let text = std::str::from_utf8(line)
        .map_err(|_| ApiError::NotUtf8)?
        .trim();
    if text.is_empty() {
        return Err(ApiError::Empty);
    }
    let raw: Raw = serde_json::from_str(text).map_err(ApiError::Malformed)?;
    let need_vm = || {
        raw.vm.ok_or_else(|| ApiError::Missing {
            cmd: raw.cmd.clone(),
            field: "\"vm\"",
        })
    };
    match raw.cmd.as_str() {
        "stats" => Ok(Request::Stats {
            per_vm: raw.vms.unwrap_or(true),
        }),
        "list" => Ok(Request::List),
        "pager" => Ok(Request::Pager),
        "disk" => Ok(Request::Disk {
            modeled: raw.modeled.ok_or(ApiError::Missing {
                cmd: "disk".into(),
                field: "\"modeled\": true|false",
            })?,
        }),
        "create" => match raw.count.unwrap_or(1) {
            0 => Err(ApiError::NoCount),
            n if n > MAX_CREATE => Err(ApiError::TooMany),
            count => Ok(Request::Create { count }),
        },
        "destroy" => Ok(Request::Destroy { vm: need_vm()? }),
        "crash" => {
            let triple = match raw.how.as_deref() {
                None | Some("ud2") => false,
                Some("triple") => true,
                Some(other) => return Err(ApiError::CrashKind(other.into())),
            };
            Ok(Request::Crash {
                vm: need_vm()?,
                triple,
            })
        }
        other => Err(ApiError::Unknown(other.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_command() {
        assert_eq!(
            parse(br#"{"cmd":"stats"}"#).ok(),
            Some(Request::Stats { per_vm: true })
        );
        assert_eq!(
            parse(br#"{"cmd":"stats","vms":false}"#).ok(),
            Some(Request::Stats { per_vm: false })
        );
        assert_eq!(parse(b"{\"cmd\":\"list\"}\n").ok(), Some(Request::List));
        assert_eq!(
            parse(br#"{"cmd":"create","count":3}"#).ok(),
            Some(Request::Create { count: 3 })
        );
        assert_eq!(
            parse(br#"{"cmd":"destroy","vm":7}"#).ok(),
            Some(Request::Destroy { vm: 7 })
        );
        assert_eq!(
            parse(br#"{"cmd":"crash","vm":1,"how":"triple"}"#).ok(),
            Some(Request::Crash {
                vm: 1,
                triple: true
            })
        );
        assert_eq!(
            parse(br#"{"cmd":"disk","modeled":false}"#).ok(),
            Some(Request::Disk { modeled: false })
        );
    }

    #[test]
    fn rejects_bad_requests_with_a_reason() {
        for (line, fragment) in [
            (&b"not json"[..], "malformed"),
            (br#"{"cmd":"reboot"}"#, "unknown command"),
            (br#"{"cmd":"destroy"}"#, "needs \"vm\""),
            (br#"{"cmd":"disk"}"#, "needs \"modeled\""),
            (br#"{"cmd":"disk","modeled":"no"}"#, "malformed"),
            (br#"{"cmd":"destroy","vm":-1}"#, "malformed"),
            (br#"{"cmd":"create","count":0}"#, "count >= 1"),
            (br#"{"cmd":"create","count":100000}"#, "at most"),
            (br#"{"cmd":"stats","extra":1}"#, "malformed"),
            (
                br#"{"cmd":"crash","vm":1,"how":"gently"}"#,
                "unknown crash kind",
            ),
            (b"\xff\xfe", "UTF-8"),
            (b"   ", "empty"),
        ] {
            let error = parse(line).unwrap_err().to_string();
            assert!(error.contains(fragment), "{error:?} lacks {fragment:?}");
        }
    }
}
