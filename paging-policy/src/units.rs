//! Sizes as users write them (`32k`, `896K`, `1G`).

use crate::error::PagerError;

/// Parses a size such as `32k`, `896K`, `1G`, `4096`, `4M`, `2GiB`.
/// Suffixes are binary (k = 1024).
pub fn parse_size(s: &str) -> Result<u64, PagerError> {
    let bad = || PagerError::BadSize(s.to_string());
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix('B'))
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = num.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("32k").unwrap(), 32768);
        assert_eq!(parse_size("896K").unwrap(), 896 * 1024);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        for bad in ["", "k", "1.5G", "-1", "12q", "99999999999999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
