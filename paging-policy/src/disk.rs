//! Disk models: modeled service times added to the real swap I/O, so that
//! results of a 2002-era disk are reproducible on a fast SSD.
//!
//! A model is fed every request (`submit`) with the time it was issued and
//! returns the time it completes. Each drive is a FIFO queue: a request starts
//! when the drive is free (`max(now, busy_until)`) and takes its service time.
//! The real pager sleeps until the completion time after doing the real I/O;
//! `pagesim` uses the same arithmetic on a virtual clock.
//!
//! Service time of a rotating drive: command overhead + seek + rotational
//! latency + transfer. A request that starts where the previous one on the
//! same drive ended is sequential and pays neither seek nor rotation. Seek time
//! grows with the square root of the distance, from the track-to-track time to
//! the full-stroke time; the full stroke is derived from the average seek so
//! that random requests over the drive's span average `seek_ms` (the mean of
//! sqrt(|x-y|) for uniform x, y is 8/15). Rotational latency is uniform in
//! [0, one revolution) from a seeded generator, so runs are reproducible.

use serde_json::json;

use crate::error::PagerError;
use crate::units::parse_size;

/// Which kind of drive a model is built from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DriveKind {
    /// Rotating disk: seek + rotation + transfer.
    Rotating,
    /// Flash: fixed latency + transfer.
    Flash,
}

/// Parameters of one drive. All can be overridden in the `--disk` string.
#[derive(Debug, Clone, PartialEq)]
pub struct DriveParams {
    /// Rotating or flash.
    pub kind: DriveKind,
    /// Average seek time over random requests (ms).
    pub seek_ms: f64,
    /// Track-to-track seek time (ms).
    pub track_ms: f64,
    /// Spindle speed (revolutions per minute).
    pub rpm: f64,
    /// Media transfer rate (MB/s, 10^6 bytes).
    pub mb_s: f64,
    /// Per-command controller overhead (ms).
    pub overhead_ms: f64,
    /// Flash access latency (ms).
    pub lat_ms: f64,
}

impl DriveParams {
    /// A 7,200 RPM IDE disk of 2002 (Denali's host: ~8.9 ms seek, ~40 MB/s).
    pub fn hdd() -> Self {
        DriveParams {
            kind: DriveKind::Rotating,
            seek_ms: 8.9,
            track_ms: 1.0,
            rpm: 7200.0,
            mb_s: 40.0,
            overhead_ms: 0.1,
            lat_ms: 0.0,
        }
    }

    /// The e-commerce study's 15,000 RPM SCSI disk (Seagate ST373453LC):
    /// 0.2 ms track to track, 7.2 ms more for a full stroke (so 4.04 ms on
    /// average over uniform requests), 75 MB/s. The database tracer's
    /// `hdd15k` is built from these same parameters.
    pub fn hdd15k() -> Self {
        DriveParams {
            kind: DriveKind::Rotating,
            seek_ms: 0.2 + 7.2 * 8.0 / 15.0,
            track_ms: 0.2,
            rpm: 15000.0,
            mb_s: 75.0,
            overhead_ms: 0.0,
            lat_ms: 0.0,
        }
    }

    /// A SATA flash drive (~0.1 ms access, ~500 MB/s).
    pub fn ssd() -> Self {
        DriveParams {
            kind: DriveKind::Flash,
            seek_ms: 0.0,
            track_ms: 0.0,
            rpm: 0.0,
            mb_s: 500.0,
            overhead_ms: 0.0,
            lat_ms: 0.1,
        }
    }

    fn by_name(name: &str) -> Option<Self> {
        match name {
            "hdd" => Some(Self::hdd()),
            "hdd15k" => Some(Self::hdd15k()),
            "ssd" => Some(Self::ssd()),
            _ => None,
        }
    }
}

/// How drives are combined.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DiskLayout {
    /// No model: real I/O only.
    None,
    /// One drive.
    Single,
    /// N drives, requests split by address in stripe units (RAID-0).
    Array(u32),
    /// N drives with rotating parity (RAID-5, left-asymmetric); writes that
    /// do not cover a whole stripe row pay read-modify-write.
    Raid5(u32),
}

/// A parsed `--disk` string.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskSpec {
    /// The string as given.
    pub text: String,
    /// Drive combination.
    pub layout: DiskLayout,
    /// Parameters of every drive.
    pub drive: DriveParams,
    /// Stripe unit for arrays (bytes).
    pub stripe_bytes: u64,
    /// Address span the seek curve is scaled to (bytes per drive after
    /// striping); 0 = the swap device's size.
    pub span_bytes: u64,
    /// Seed of the rotational-latency generator.
    pub seed: u64,
}

impl Default for DiskSpec {
    /// No model (`none`): real I/O only.
    fn default() -> Self {
        DiskSpec::parse("none").expect("'none' is a valid disk model")
    }
}

impl DiskSpec {
    /// Parses `none`, `hdd`, `hdd15k`, `ssd`, `array:N`, `raid5:N`, followed
    /// by optional `,key=value` overrides: `seek_ms`, `track_ms`, `rpm`,
    /// `mb_s`, `overhead_ms`, `lat_ms`, `drive` (hdd|hdd15k|ssd, for arrays),
    /// `stripe` (size), `span` (size), `seed`.
    pub fn parse(text: &str) -> Result<DiskSpec, PagerError> {
        let bad = |reason: String| PagerError::BadDisk {
            spec: text.to_string(),
            reason,
        };
        let mut parts = text.split(',');
        let head = parts.next().unwrap_or("").trim();
        let parse_n = |s: &str| -> Result<u32, PagerError> {
            match s.parse::<u32>() {
                Ok(n) if (1..=64).contains(&n) => Ok(n),
                _ => Err(bad(format!("disk count '{s}' must be 1..64"))),
            }
        };
        let (layout, mut drive) = if head == "none" || head.is_empty() {
            (DiskLayout::None, DriveParams::hdd())
        } else if let Some(d) = DriveParams::by_name(head) {
            (DiskLayout::Single, d)
        } else if let Some(n) = head.strip_prefix("array:") {
            (DiskLayout::Array(parse_n(n)?), DriveParams::hdd())
        } else if let Some(n) = head.strip_prefix("raid5:") {
            let n = parse_n(n)?;
            if n < 3 {
                return Err(bad("raid5 needs at least 3 disks".into()));
            }
            (DiskLayout::Raid5(n), DriveParams::hdd())
        } else {
            return Err(bad(format!(
                "unknown model '{head}' (expected none, hdd, hdd15k, ssd, array:N, raid5:N)"
            )));
        };
        let mut spec = DiskSpec {
            text: text.to_string(),
            layout,
            drive: drive.clone(),
            stripe_bytes: 64 << 10,
            span_bytes: 0,
            seed: 0x5ca1_ab1e,
        };
        for kv in parts {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(format!("override '{kv}' is not key=value")))?;
            let num = || -> Result<f64, PagerError> {
                match v.parse::<f64>() {
                    Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
                    _ => Err(bad(format!("{k}={v}: not a non-negative number"))),
                }
            };
            match k {
                "seek_ms" => drive.seek_ms = num()?,
                "track_ms" => drive.track_ms = num()?,
                "rpm" => drive.rpm = num()?,
                "mb_s" => drive.mb_s = num()?,
                "overhead_ms" => drive.overhead_ms = num()?,
                "lat_ms" => drive.lat_ms = num()?,
                "drive" => {
                    drive = DriveParams::by_name(v)
                        .ok_or_else(|| bad(format!("unknown drive '{v}'")))?;
                }
                "stripe" => spec.stripe_bytes = parse_size(v).map_err(|e| bad(e.to_string()))?,
                "span" => spec.span_bytes = parse_size(v).map_err(|e| bad(e.to_string()))?,
                "seed" => {
                    spec.seed = v
                        .parse()
                        .map_err(|_| bad(format!("seed '{v}' is not an integer")))?
                }
                _ => return Err(bad(format!("unknown parameter '{k}'"))),
            }
        }
        if drive.mb_s <= 0.0 {
            return Err(bad("mb_s must be positive".into()));
        }
        if drive.kind == DriveKind::Rotating && (drive.rpm <= 0.0 || drive.seek_ms < drive.track_ms)
        {
            return Err(bad("rpm must be positive and seek_ms >= track_ms".into()));
        }
        if spec.stripe_bytes < 512 || !spec.stripe_bytes.is_power_of_two() {
            return Err(bad("stripe must be a power of two >= 512".into()));
        }
        spec.drive = drive;
        Ok(spec)
    }

    /// Builds the model for a swap device of `swap_bytes`.
    pub fn build(&self, swap_bytes: u64) -> DiskModel {
        let n = match self.layout {
            DiskLayout::None => 0,
            DiskLayout::Single => 1,
            DiskLayout::Array(n) | DiskLayout::Raid5(n) => n,
        };
        let data_disks = match self.layout {
            DiskLayout::Raid5(n) => n - 1,
            _ => n.max(1),
        };
        let span = if self.span_bytes > 0 {
            self.span_bytes
        } else {
            swap_bytes.div_ceil(data_disks as u64)
        }
        .max(1);
        let drives = (0..n)
            .map(|i| Drive::new(self.drive.clone(), span, self.seed.wrapping_add(i as u64)))
            .collect();
        DiskModel {
            layout: self.layout,
            stripe: self.stripe_bytes,
            drives,
        }
    }
}

/// What the modeled drives did: how a model's time splits into positioning
/// and transfer, so a run can tell a busier drive from an idle one.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DiskUsage {
    /// Requests served (RAID read-modify-writes count once per drive).
    pub requests: u64,
    /// Requests that paid a seek and rotation (not sequential, rotating drives).
    pub positioned: u64,
    /// Seconds of seek and rotational latency, over all drives.
    pub positioning_s: f64,
    /// Service seconds of the busiest drive: the disk-bound limit of a run.
    pub busiest_s: f64,
}

impl DiskUsage {
    /// The usage as JSON, for the pager's stats.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "requests": self.requests,
            "positioned": self.positioned,
            "positioning_seconds": self.positioning_s,
            "busy_seconds": self.busiest_s,
        })
    }
}

/// One drive's queue and head state.
#[derive(Debug, Clone)]
pub struct Drive {
    p: DriveParams,
    span: f64,
    full_stroke_ms: f64,
    head: u64,
    busy_until: f64,
    busy_total: f64,
    requests: u64,
    positioned: u64,
    positioning_total: f64,
    rng: u64,
}

impl Drive {
    fn new(p: DriveParams, span: u64, seed: u64) -> Drive {
        let full_stroke_ms = p.track_ms + (p.seek_ms - p.track_ms) * 15.0 / 8.0;
        Drive {
            p,
            span: span as f64,
            full_stroke_ms,
            head: u64::MAX,
            busy_until: 0.0,
            busy_total: 0.0,
            requests: 0,
            positioned: 0,
            positioning_total: 0.0,
            rng: seed,
        }
    }

    /// SplitMix64: deterministic and independent of `rand`'s version, so
    /// modeled times are reproducible across builds.
    fn next_unit(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Seek time in seconds for moving the head from `from` to `to`.
    pub fn seek_s(&self, from: u64, to: u64) -> f64 {
        if from == u64::MAX || from == to {
            // Unknown position: charge the average seek.
            return if from == to {
                0.0
            } else {
                self.p.seek_ms / 1e3
            };
        }
        let d = (from.abs_diff(to) as f64 / self.span).min(1.0);
        (self.p.track_ms + (self.full_stroke_ms - self.p.track_ms) * d.sqrt()) / 1e3
    }

    /// Transfer time in seconds for `len` bytes.
    pub fn transfer_s(&self, len: u64) -> f64 {
        len as f64 / (self.p.mb_s * 1e6)
    }

    /// One revolution in seconds.
    pub fn revolution_s(&self) -> f64 {
        if self.p.rpm > 0.0 {
            60.0 / self.p.rpm
        } else {
            0.0
        }
    }

    /// Service time of a request and the head update.
    fn service(&mut self, offset: u64, len: u64) -> f64 {
        let t = match self.p.kind {
            DriveKind::Flash => self.p.lat_ms / 1e3 + self.transfer_s(len),
            DriveKind::Rotating if offset == self.head => {
                self.p.overhead_ms / 1e3 + self.transfer_s(len)
            }
            DriveKind::Rotating => {
                let positioning =
                    self.seek_s(self.head, offset) + self.next_unit() * self.revolution_s();
                self.positioned += 1;
                self.positioning_total += positioning;
                self.p.overhead_ms / 1e3 + positioning + self.transfer_s(len)
            }
        };
        self.requests += 1;
        self.head = offset + len;
        t
    }

    /// Queues a request issued at `now`; returns its completion time.
    pub fn submit(&mut self, now: f64, offset: u64, len: u64) -> f64 {
        let s = self.service(offset, len);
        self.finish(now, s)
    }

    /// Queues a read-modify-write of `[offset, offset+len)`: read, then
    /// rewrite the same sectors one revolution later.
    fn submit_rmw(&mut self, now: f64, offset: u64, len: u64) -> f64 {
        let read = self.service(offset, len);
        let write = match self.p.kind {
            DriveKind::Flash => self.p.lat_ms / 1e3 + self.transfer_s(len),
            DriveKind::Rotating => {
                self.revolution_s() - self.transfer_s(len).min(self.revolution_s())
                    + self.transfer_s(len)
            }
        };
        self.finish(now, read + write)
    }

    fn finish(&mut self, now: f64, service: f64) -> f64 {
        let start = now.max(self.busy_until);
        self.busy_until = start + service;
        self.busy_total += service;
        self.busy_until
    }
}

/// A set of drives behind one swap device.
#[derive(Debug, Clone)]
pub struct DiskModel {
    layout: DiskLayout,
    stripe: u64,
    drives: Vec<Drive>,
}

impl DiskModel {
    /// True when the model adds no time.
    pub fn is_none(&self) -> bool {
        self.layout == DiskLayout::None
    }

    /// Queues a request of `len` bytes at byte `offset` issued at `now`
    /// (seconds); returns when it completes.
    pub fn submit(&mut self, now: f64, offset: u64, len: u64, write: bool) -> f64 {
        match self.layout {
            DiskLayout::None => now,
            DiskLayout::Single => self.drives[0].submit(now, offset, len),
            DiskLayout::Array(n) => self.submit_array(now, offset, len, n as u64),
            DiskLayout::Raid5(n) if write => self.submit_raid5_write(now, offset, len, n as u64),
            DiskLayout::Raid5(n) => self.submit_raid5_read(now, offset, len, n as u64),
        }
    }

    /// Splits `[offset, offset+len)` into stripe-unit pieces:
    /// (chunk index, offset within chunk, length).
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let chunk = pos / self.stripe;
            let within = pos % self.stripe;
            let l = (self.stripe - within).min(end - pos);
            pos += l;
            Some((chunk, within, l))
        })
    }

    fn submit_array(&mut self, now: f64, offset: u64, len: u64, n: u64) -> f64 {
        // Pieces that land on one drive are contiguous there (consecutive
        // rows), so each drive gets one request covering all of its pieces.
        let mut per: Vec<Option<(u64, u64)>> = vec![None; n as usize];
        let stripe = self.stripe;
        for (chunk, within, l) in self.pieces(offset, len) {
            let d = (chunk % n) as usize;
            let local = (chunk / n) * stripe + within;
            per[d] = Some(match per[d] {
                None => (local, l),
                Some((s, tl)) => (s, tl + l),
            });
        }
        let mut done = now;
        for (d, r) in per.into_iter().enumerate() {
            if let Some((s, l)) = r {
                done = done.max(self.drives[d].submit(now, s, l));
            }
        }
        done
    }

    /// Drive holding data chunk `chunk` of a RAID-5 of `n` drives, its row,
    /// and the row's parity drive.
    fn raid5_place(chunk: u64, n: u64) -> (usize, u64, usize) {
        let row = chunk / (n - 1);
        let idx = chunk % (n - 1);
        let parity = (n - 1) - row % n;
        let disk = if idx >= parity { idx + 1 } else { idx };
        (disk as usize, row, parity as usize)
    }

    fn submit_raid5_read(&mut self, now: f64, offset: u64, len: u64, n: u64) -> f64 {
        let stripe = self.stripe;
        let pieces: Vec<_> = self.pieces(offset, len).collect();
        let mut done = now;
        for (chunk, within, l) in pieces {
            let (d, row, _) = Self::raid5_place(chunk, n);
            done = done.max(self.drives[d].submit(now, row * stripe + within, l));
        }
        done
    }

    fn submit_raid5_write(&mut self, now: f64, offset: u64, len: u64, n: u64) -> f64 {
        let stripe = self.stripe;
        let pieces: Vec<_> = self.pieces(offset, len).collect();
        let mut done = now;
        let mut i = 0;
        while i < pieces.len() {
            let row = pieces[i].0 / (n - 1);
            let mut j = i;
            let mut row_bytes = 0;
            while j < pieces.len() && pieces[j].0 / (n - 1) == row {
                row_bytes += pieces[j].2;
                j += 1;
            }
            let parity = Self::raid5_place(pieces[i].0, n).2;
            if row_bytes == stripe * (n - 1) {
                // Full-stripe write: parity computed from the new data alone.
                for &(chunk, within, l) in &pieces[i..j] {
                    let (d, _, _) = Self::raid5_place(chunk, n);
                    done = done.max(self.drives[d].submit(now, row * stripe + within, l));
                }
                done = done.max(self.drives[parity].submit(now, row * stripe, stripe));
            } else {
                // Small write: read old data and parity, write both back.
                let (mut lo, mut hi) = (u64::MAX, 0);
                for &(chunk, within, l) in &pieces[i..j] {
                    let (d, _, _) = Self::raid5_place(chunk, n);
                    done = done.max(self.drives[d].submit_rmw(now, row * stripe + within, l));
                    lo = lo.min(within);
                    hi = hi.max(within + l);
                }
                done = done.max(self.drives[parity].submit_rmw(now, row * stripe + lo, hi - lo));
            }
            i = j;
        }
        done
    }

    /// Busiest drive's accumulated service time (seconds): the disk-bound
    /// limit of a run.
    pub fn max_busy_seconds(&self) -> f64 {
        self.drives.iter().map(|d| d.busy_total).fold(0.0, f64::max)
    }

    /// What the drives have done so far.
    pub fn usage(&self) -> DiskUsage {
        DiskUsage {
            requests: self.drives.iter().map(|d| d.requests).sum(),
            positioned: self.drives.iter().map(|d| d.positioned).sum(),
            positioning_s: self.drives.iter().map(|d| d.positioning_total).sum(),
            busiest_s: self.max_busy_seconds(),
        }
    }

    /// Parameters as JSON, for stats and reports.
    pub fn describe(&self, spec: &DiskSpec) -> serde_json::Value {
        let p = &spec.drive;
        json!({
            "model": spec.text,
            "drives": self.drives.len(),
            "kind": match p.kind { DriveKind::Rotating => "rotating", DriveKind::Flash => "flash" },
            "seek_ms": p.seek_ms, "track_ms": p.track_ms, "rpm": p.rpm, "mb_s": p.mb_s,
            "overhead_ms": p.overhead_ms, "lat_ms": p.lat_ms,
            "stripe_bytes": spec.stripe_bytes,
            "span_bytes": self.drives.first().map(|d| d.span as u64).unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approx(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn parse_and_overrides() {
        let s = DiskSpec::parse("hdd,seek_ms=9,rpm=5400").unwrap();
        assert_eq!(s.layout, DiskLayout::Single);
        assert_eq!(s.drive.seek_ms, 9.0);
        assert_eq!(s.drive.rpm, 5400.0);
        assert_eq!(
            DiskSpec::parse("array:3").unwrap().layout,
            DiskLayout::Array(3)
        );
        assert_eq!(
            DiskSpec::parse("raid5:4,drive=ssd").unwrap().drive.kind,
            DriveKind::Flash
        );
        for bad in [
            "floppy",
            "array:0",
            "raid5:2",
            "hdd,seek_ms",
            "hdd,foo=1",
            "hdd,rpm=-1",
            "hdd,stripe=3k",
        ] {
            let e = DiskSpec::parse(bad).unwrap_err().to_string();
            assert!(!e.contains('\n') && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn sequential_skips_seek_and_rotation() {
        let mut m = DiskSpec::parse("hdd").unwrap().build(1 << 30);
        let t1 = m.submit(0.0, 0, 32768, false);
        let t2 = m.submit(t1, 32768, 32768, false);
        let transfer = 32768.0 / 40e6;
        assert!(approx(t2 - t1, 0.1e-3 + transfer, 1e-9), "{}", t2 - t1);
        let u = m.usage();
        assert_eq!(
            (u.requests, u.positioned),
            (2, 1),
            "only the first request seeks"
        );
        assert!(
            approx(u.positioning_s, t1 - 0.1e-3 - transfer, 1e-9),
            "{u:?}"
        );
        assert!(approx(u.busiest_s, t2, 1e-9), "{u:?}");
    }

    #[test]
    fn random_reads_average_seek_plus_half_revolution() {
        let spec = DiskSpec::parse("hdd").unwrap();
        let mut m = spec.build(1 << 34);
        let mut x: u64 = 1;
        let n = 20000;
        let mut now = 0.0;
        for _ in 0..n {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let off = ((x >> 20) % (1 << 34)) & !32767;
            now = m.submit(now, off, 32768, false);
        }
        let per = now / n as f64 * 1e3;
        // overhead 0.1 + seek 8.9 + half revolution 4.17 + transfer 0.82 ms
        assert!(approx(per, 14.0, 0.5), "mean service {per} ms");
    }

    #[test]
    fn fifo_queue() {
        let mut m = DiskSpec::parse("ssd").unwrap().build(1 << 30);
        let a = m.submit(0.0, 0, 4096, false);
        let b = m.submit(0.0, 1 << 20, 4096, false);
        let s = 0.1e-3 + 4096.0 / 500e6;
        assert!(approx(a, s, 1e-12) && approx(b, 2.0 * s, 1e-12));
        // Issued after the drive went idle: starts at issue time.
        let c = m.submit(1.0, 0, 4096, false);
        assert!(approx(c, 1.0 + s, 1e-12));
    }

    #[test]
    fn array_spreads_requests() {
        let mut one = DiskSpec::parse("ssd").unwrap().build(1 << 30);
        let mut four = DiskSpec::parse("array:4,drive=ssd").unwrap().build(1 << 30);
        // Four 64 KiB requests on four consecutive stripe units: one drive
        // serves them back to back, the array in parallel.
        let (mut a, mut b) = (0.0f64, 0.0f64);
        for i in 0..4u64 {
            a = a.max(one.submit(0.0, i * 65536, 65536, false));
            b = b.max(four.submit(0.0, i * 65536, 65536, false));
        }
        assert!(approx(a, 4.0 * b, 1e-9), "{a} {b}");
    }

    #[test]
    fn raid5_small_write_costs_read_modify_write() {
        let mut r = DiskSpec::parse("raid5:4,drive=ssd").unwrap().build(1 << 30);
        let read = r.submit(0.0, 0, 4096, false);
        let mut r2 = DiskSpec::parse("raid5:4,drive=ssd").unwrap().build(1 << 30);
        let write = r2.submit(0.0, 0, 4096, true);
        assert!(approx(write, 2.0 * read, 1e-12), "{write} {read}");
        // A full-stripe write (3 data units) needs no reads.
        let mut r3 = DiskSpec::parse("raid5:4,drive=ssd").unwrap().build(1 << 30);
        let full = r3.submit(0.0, 0, 3 * 65536, true);
        assert!(approx(full, 0.1e-3 + 65536.0 / 500e6, 1e-12), "{full}");
    }
}
