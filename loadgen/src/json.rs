//! The JSON document (`--json`), schema "zipfperf/1" as pinned in the
//! repository's INTERFACES.md; keys beyond the pinned ones are additions.

use serde_json::{json, Value};

use crate::cli::Args;
use crate::engine::Ending;
use crate::report::{conn_time_ms, latency_ms, ratio, CpuTime};
use crate::stats::{summary, Stats};

/// Schema identifier.
pub const SCHEMA: &str = "zipfperf/1";

/// Build the document for a finished run.
pub fn document(args: &Args, s: &Stats, cpu: CpuTime, ending: Ending) -> Value {
    let d = s.duration.as_secs_f64();
    let replies = s.replies as f64;
    let samples = s.rate_samples();
    let [rmin, ravg, rmax, rsd] = summary(&samples);
    let [cmin, cavg, cmax, cmed, csd] = conn_time_ms(s);
    let [mean, p50, p90, p99, p999, lmax] = latency_ms(s);
    let e = s.errors;
    let mut doc = json!({
        "schema": SCHEMA,
        "config": args,
        "mode": if args.concurrency.is_some() { "closed" } else { "open" },
        "ending": match ending {
            Ending::Complete => "complete",
            Ending::Duration => "duration",
            Ending::Deadline => "deadline",
            Ending::Interrupted => "interrupted",
        },
        "duration_s": d,
        "connections": {
            "total": s.conns_initiated,
            "rate": ratio(s.conns_initiated as f64, d),
            "completed": s.conns_completed,
            "max_concurrent": s.max_concurrent,
            "max_burst": s.max_burst,
            "connect_ms": ratio(s.connect_us, s.connects as f64) / 1000.0,
            "time_ms": {"min": cmin, "avg": cavg, "max": cmax, "median": cmed, "stddev": csd},
        },
        "requests": {
            "total": s.requests,
            "rate": ratio(s.requests as f64, d),
            "size_avg": ratio(s.request_bytes as f64, s.requests as f64),
            "abandoned": s.abandoned,
        },
        "replies": {
            "total": s.replies,
            "rate": ratio(replies, d),
            "rate_samples": {"min": rmin, "avg": ravg, "max": rmax, "stddev": rsd, "n": samples.len()},
            "status": {
                "1xx": s.status[0], "2xx": s.status[1], "3xx": s.status[2],
                "4xx": s.status[3], "5xx": s.status[4],
            },
            "response_ms": ratio(s.response_us, replies) / 1000.0,
            "transfer_ms": ratio(s.transfer_us, replies) / 1000.0,
            "size_avg": {
                "header": ratio(s.header_bytes as f64, replies),
                "content": ratio(s.content_bytes as f64, replies),
                "footer": ratio(s.footer_bytes as f64, replies),
            },
        },
        "latency_ms": {"mean": mean, "p50": p50, "p90": p90, "p99": p99, "p999": p999, "max": lmax},
        "errors": {
            "total": e.total(), "client_timo": e.client_timo, "socket_timo": e.socket_timo,
            "connrefused": e.connrefused, "connreset": e.connreset, "fd_unavail": e.fd_unavail,
            "addrunavail": e.addrunavail, "ftab_full": e.ftab_full, "other": e.other,
        },
        "bytes": {"sent": s.bytes_sent, "received": s.bytes_received},
        "cpu_s": {"user": cpu.user, "system": cpu.system},
        "per_target": s.per_target,
    });
    if !s.per_uri.is_empty() {
        doc["per_uri"] = json!(s.per_uri);
    }
    doc
}
