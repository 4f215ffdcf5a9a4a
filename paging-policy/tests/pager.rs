//! The real pager on anonymous memory, with host threads as vCPUs.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, plugin, Region, Rng};
use paging_policy::{
    CloneTemplate, DiskSpec, GuestMemory, Pager, PagerConfig, PagerError, PolicySpec,
};

const WORDS_PER_PAGE: usize = 512;

fn total(p: &Pager, key: &str) -> u64 {
    p.stats()["totals"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("stats key {key}"))
}

/// Target number of served faults per integrity case
/// (PAGER_INTEGRITY_FAULTS overrides; the lead's acceptance runs use 1e6).
fn fault_target() -> u64 {
    std::env::var("PAGER_INTEGRITY_FAULTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15_000)
}

/// Several VMs, two writer/reader threads each, a budget of a fraction of
/// their RAM: every word read must equal the last word written (or zero).
/// A watcher samples real residency (mincore) against the budget.
fn integrity(policy: &'static str, block: u64) {
    let vms = 4usize;
    let blocks_per_vm = 48usize;
    let budget_blocks = 40u64;
    let vm_ram = blocks_per_vm * block as usize;
    let cfg = config(policy, block, budget_blocks * block, "integrity");
    let pager = Pager::new(cfg, vms as u32, vm_ram as u64).expect("pager");
    let regions: Vec<Region> = (0..vms).map(|_| Region::new(vm_ram)).collect();
    for (i, r) in regions.iter().enumerate() {
        r.register(&pager, i as u32).expect("register");
    }
    let target = fault_target();
    let stop = Arc::new(AtomicBool::new(false));
    let max_resident = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (stop, max_resident, regions) = (stop.clone(), max_resident.clone(), regions.clone());
        let pager = pager.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // The vCPU threads of a stopped pager stay blocked for good:
                // fail the whole test binary instead of hanging.
                if let Some(e) = pager.fatal_error() {
                    eprintln!("integrity {policy} {block}: pager stopped: {e}");
                    std::process::exit(101);
                }
                // Sweeps are not atomic: memory moving from a region already
                // counted to one not yet counted is seen twice. Sweeping both
                // ways and keeping the smaller count cancels that; a real
                // excess is a state and shows in both sweeps.
                let fwd: usize = regions.iter().map(|r| r.resident_pages()).sum();
                let back: usize = regions.iter().rev().map(|r| r.resident_pages()).sum();
                let pages = fwd.min(back);
                max_resident.fetch_max(pages as u64 * 4096, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(300));
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(120.max(target / 500));
    // Two threads per VM (a vCPU and the monitor's I/O thread touch the same
    // RAM): each owns four of the eight tracked words of every page, so
    // they fault on the same blocks at the same time.
    let workers: Vec<_> = (0..vms * 2)
        .map(|w| {
            let (vm, half) = (w / 2, w % 2);
            let r = regions[vm];
            let pager = pager.clone();
            std::thread::spawn(move || {
                let pages = r.len / 4096;
                let mut shadow = vec![0u64; pages * 4];
                let mut rng = Rng(0x9E37_79B9 ^ ((w as u64 + 1) * 0x0001_2345_6789));
                let mut mismatches = 0u64;
                let mut ops = 0u64;
                let mut counter = 1u64;
                let word_of =
                    |page: usize, slot: usize| page * WORDS_PER_PAGE + (half * 4 + slot) * 61;
                while total(&pager, "faults") < target && Instant::now() < deadline {
                    for _ in 0..64 {
                        let page = rng.below(pages as u64) as usize;
                        let slot = rng.below(4) as usize;
                        if rng.below(3) == 0 {
                            let v = (w as u64) << 56 | counter;
                            counter += 1;
                            r.write(word_of(page, slot), v);
                            shadow[page * 4 + slot] = v;
                        } else if r.read(word_of(page, slot)) != shadow[page * 4 + slot] {
                            mismatches += 1;
                        }
                        ops += 1;
                    }
                }
                // Final pass over every tracked word.
                for page in 0..pages {
                    for slot in 0..4 {
                        if r.read(word_of(page, slot)) != shadow[page * 4 + slot] {
                            mismatches += 1;
                        }
                    }
                }
                (mismatches, ops)
            })
        })
        .collect();
    let mut mismatches = 0;
    let mut ops = 0;
    for w in workers {
        let (m, o) = w.join().expect("worker");
        mismatches += m;
        ops += o;
    }
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let s = pager.stats();
    let faults = s["totals"]["faults"].as_u64().unwrap();
    eprintln!(
        "{policy} block {block}: {faults} faults, {ops} accesses, {} blocks out, {mismatches} mismatches, max resident {} of budget {}, fault latency {}",
        s["totals"]["blocks_out"], max_resident.load(Ordering::Relaxed), budget_blocks * block, s["totals"]["fault_latency_us"]
    );
    assert_eq!(pager.fatal_error(), None);
    assert_eq!(mismatches, 0, "data mismatches");
    assert!(faults >= target, "only {faults} faults");
    assert!(
        s["totals"]["blocks_out"].as_u64().unwrap() > 0,
        "no eviction happened"
    );
    // Resident memory: never above the budget plus one block per fault in
    // flight (at most one per service thread).
    let bound = budget_blocks * block + 8 * block;
    assert!(
        max_resident.load(Ordering::Relaxed) <= bound,
        "resident exceeded budget"
    );
    assert!(s["totals"]["resident_bytes"].as_u64().unwrap() <= budget_blocks * block);
    pager.shutdown();
}

#[test]
fn integrity_demand_4k() {
    integrity("demand", 4 << 10);
}

#[test]
fn integrity_demand_32k() {
    integrity("demand", 32 << 10);
}

#[test]
fn integrity_demand_256k() {
    integrity("demand", 256 << 10);
}

#[test]
fn integrity_wsswap_4k() {
    integrity("wsswap", 4 << 10);
}

#[test]
fn integrity_wsswap_32k() {
    integrity("wsswap", 32 << 10);
}

#[test]
fn integrity_wsswap_256k() {
    integrity("wsswap", 256 << 10);
}

#[test]
fn integrity_fifo_plugin() {
    let path = plugin("fifo_policy");
    integrity(path.to_str().unwrap().to_string().leak(), 32 << 10);
}

/// Clean blocks already on swap are dropped without being written again.
/// Two VMs of 16 blocks share a 16-block budget, so touching one evicts the
/// other entirely.
/// Block size and blocks per VM of the two-VM tests.
const PAIR_BLOCK: u64 = 32 << 10;
const PAIR_BLOCKS: usize = 16;

/// A pager with `policy` and a budget of `budget_blocks`, serving two VMs of
/// `PAIR_BLOCKS` blocks (VM 0 and VM 1).
fn pager_for_two_vms(policy: &str, budget_blocks: u64, tag: &str) -> (Arc<Pager>, Region, Region) {
    let cfg = config(policy, PAIR_BLOCK, budget_blocks * PAIR_BLOCK, tag);
    let pager = Pager::new(cfg, 2, PAIR_BLOCKS as u64 * PAIR_BLOCK).unwrap();
    let a = Region::new(PAIR_BLOCKS * PAIR_BLOCK as usize);
    let b = Region::new(PAIR_BLOCKS * PAIR_BLOCK as usize);
    a.register(&pager, 0).unwrap();
    b.register(&pager, 1).unwrap();
    (pager, a, b)
}

fn dirty_tracking(policy: &str) {
    let (block, blocks) = (PAIR_BLOCK, PAIR_BLOCKS);
    let (pager, a, b) = pager_for_two_vms(policy, blocks as u64, "dirty");
    let wpb = block as usize / 8;
    let fill = |r: &Region, tag: u64| {
        for i in 0..blocks {
            r.write(i * wpb, tag + i as u64);
        }
    };
    let check = |r: &Region, tag: u64| {
        for i in 0..blocks {
            assert_eq!(r.read(i * wpb), tag + i as u64, "block {i}");
        }
    };
    fill(&a, 0xA000);
    fill(&b, 0xB000);
    check(&a, 0xA000);
    check(&b, 0xB000);
    // Every block has now been written out exactly once.
    let written = total(&pager, "swap_write_bytes");
    assert_eq!(written, 2 * blocks as u64 * block);
    let out = total(&pager, "blocks_out");
    for _ in 0..3 {
        check(&a, 0xA000);
        check(&b, 0xB000);
    }
    assert!(
        total(&pager, "blocks_out") >= out + 6 * blocks as u64,
        "re-evictions happened"
    );
    assert_eq!(
        total(&pager, "swap_write_bytes"),
        written,
        "clean blocks were rewritten"
    );
    // A write that leaves the content as it was (as when KVM maps memory
    // writable without the guest writing) costs a write-protect fault but
    // no swap write: the content still matches the swap copy.
    let wp = total(&pager, "wp_faults");
    b.write(2 * wpb, 0xB000 + 2);
    assert_eq!(total(&pager, "wp_faults"), wp + 1);
    check(&a, 0xA000);
    check(&b, 0xB000);
    assert_eq!(
        total(&pager, "swap_write_bytes"),
        written,
        "unchanged block was rewritten"
    );
    // One real change to a resident clean block makes exactly that block
    // dirty again.
    let wp = total(&pager, "wp_faults");
    b.write(3 * wpb + 1, 42);
    assert_eq!(total(&pager, "wp_faults"), wp + 1);
    check(&a, 0xA000);
    check(&b, 0xB000);
    assert_eq!(total(&pager, "swap_write_bytes"), written + block);
    assert_eq!(b.read(3 * wpb + 1), 42);
    pager.shutdown();
}

#[test]
fn dirty_tracking_demand() {
    dirty_tracking("demand");
}

/// The log layout (wsswap) rewrites every block of an evicted VM that holds
/// data, changed or not, so the VM's set lies in one fresh extent and comes
/// back with one read; the data survive every round.
#[test]
fn wsswap_rewrites_whole_batches() {
    let (block, blocks) = (PAIR_BLOCK, PAIR_BLOCKS);
    let (pager, a, b) = pager_for_two_vms("wsswap,after=1", blocks as u64, "whole");
    let wpb = block as usize / 8;
    for i in 0..blocks {
        a.write(i * wpb, 0xA000 + i as u64);
    }
    for i in 0..blocks {
        b.write(i * wpb, 0xB000 + i as u64);
    }
    let check = |r: &Region, tag: u64| {
        for i in 0..blocks {
            assert_eq!(r.read(i * wpb), tag + i as u64, "block {i}");
        }
    };
    let (written, out) = (
        total(&pager, "swap_write_bytes"),
        total(&pager, "blocks_out"),
    );
    for _ in 0..3 {
        check(&a, 0xA000);
        check(&b, 0xB000);
    }
    let evicted = total(&pager, "blocks_out") - out;
    assert!(evicted >= 6 * blocks as u64, "re-evictions happened");
    assert_eq!(
        total(&pager, "swap_write_bytes") - written,
        evicted * block,
        "unchanged blocks were left behind"
    );
    pager.shutdown();
}

/// wsswap brings a VM's working set back with one fault and one read
/// (`after=1`), or with its third fault (default).
fn wsswap_swap_in(policy: &str, faults_to_swap_in: u64) {
    let block = PAIR_BLOCK;
    let (pager, a, b) = pager_for_two_vms(policy, 20, "ws");
    let wpb = block as usize / 8;
    for i in 0..10 {
        a.write(i * wpb, i as u64 + 1);
    }
    // VM 1's 12 blocks push VM 0 out (whole VM).
    for i in 0..12 {
        b.write(i * wpb, 100 + i as u64);
    }
    assert_eq!(pager.vm_stats(0)["resident_bytes"], 0);
    let faults = pager.vm_stats(0)["faults"].as_u64().unwrap();
    for i in 0..10 {
        assert_eq!(a.read(i * wpb), i as u64 + 1);
    }
    let v = pager.vm_stats(0);
    assert_eq!(
        v["faults"].as_u64().unwrap(),
        faults + faults_to_swap_in,
        "faults to bring the set back"
    );
    assert_eq!(v["resident_bytes"].as_u64().unwrap(), 10 * block);
    assert_eq!(v["swap_read_bytes"].as_u64().unwrap(), 10 * block);
    pager.shutdown();
}

#[test]
fn wsswap_reads_working_set_at_once() {
    wsswap_swap_in("wsswap,after=1", 1);
}

#[test]
fn wsswap_swaps_in_at_third_fault() {
    wsswap_swap_in("wsswap", 3);
}

#[test]
fn stats_shape() {
    let cfg = config("demand", 32 << 10, 1 << 20, "stats");
    let pager = Pager::new(cfg, 2, 1 << 20).unwrap();
    let r = Region::new(1 << 20);
    r.register(&pager, 3).unwrap();
    r.write(0, 7);
    pager.note_access(3);
    let s = pager.stats();
    for k in [
        "resident_bytes",
        "budget_bytes",
        "block_bytes",
        "faults",
        "blocks_in",
        "blocks_out",
        "swap_read_bytes",
        "swap_write_bytes",
        "io_seconds",
    ] {
        assert!(s["totals"][k].is_number(), "totals.{k}");
    }
    for k in ["p50", "p90", "p99", "max", "count"] {
        assert!(
            s["totals"]["fault_latency_us"][k].is_number(),
            "latency {k}"
        );
    }
    assert_eq!(s["totals"]["faults"], 1);
    assert_eq!(s["vms"]["3"]["resident_bytes"], 32 << 10);
    assert_eq!(pager.vm_stats(3)["faults"], 1);
    assert!(pager.vm_stats(9).is_null());
    pager.unregister_vm(3);
    assert_eq!(pager.stats()["totals"]["resident_bytes"], 0);
    pager.shutdown();
}

#[test]
fn bad_configuration_fails_with_one_line() {
    let mb = 1u64 << 20;
    let ok = config("demand", 32 << 10, 64 * mb, "bad");
    assert!(ok.validate(4 * mb, mb).is_ok());
    let cases: Vec<(PagerConfig, &str)> = vec![
        (
            PagerConfig {
                block_bytes: 3000,
                ..ok.clone()
            },
            "block size",
        ),
        (
            PagerConfig {
                block_bytes: 512 << 10,
                ..ok.clone()
            },
            "block size",
        ),
        (
            PagerConfig {
                block_bytes: 2048,
                ..ok.clone()
            },
            "block size",
        ),
        (
            PagerConfig {
                budget_bytes: mb / 2,
                ..ok.clone()
            },
            "below one VM's minimum footprint",
        ),
        (
            PagerConfig {
                policy: PolicySpec::parse("/nonexistent/libp.so").unwrap(),
                ..ok.clone()
            },
            "not found",
        ),
        (
            PagerConfig {
                swap_path: Some("/proc/no/swap".into()),
                ..ok.clone()
            },
            "not writable",
        ),
    ];
    for (cfg, want) in cases {
        let e = cfg.validate(4 * mb, mb).expect_err(want).to_string();
        assert!(e.contains(want), "'{e}' lacks '{want}'");
        assert!(!e.contains('\n'), "multi-line: {e}");
        // Pager::new refuses the same configurations (footprint aside).
        if want != "below one VM's minimum footprint" {
            assert!(Pager::new(cfg, 1, 4 * mb).is_err(), "{want}");
        }
    }
    assert!(matches!(
        paging_policy::parse_size("12q"),
        Err(PagerError::BadSize(_))
    ));
    // Names are refused where they are parsed, once.
    let policy = PolicySpec::parse("lru").unwrap_err().to_string();
    assert!(
        policy.contains("unknown policy") && !policy.contains('\n'),
        "{policy}"
    );
    let disk = DiskSpec::parse("floppy").unwrap_err().to_string();
    assert!(
        disk.contains("invalid disk model") && !disk.contains('\n'),
        "{disk}"
    );
}

/// Waits until the pager reports a fatal error.
fn wait_fatal(p: &Pager) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(e) = p.fatal_error() {
            return e;
        }
        assert!(Instant::now() < deadline, "no fatal error");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Issue 39 item 3: the log's capacity is checked when a VM registers: a
/// VM that would not fit is refused (typed, one line) and the others run
/// on, paging through the log without running out.
#[test]
fn a_vm_past_the_swap_capacity_is_refused_at_registration() {
    let (pager, block, blocks) = log_with_room_for_two(false);
    let vm_ram = blocks as u64 * block;
    let rs: Vec<Region> = (0..3).map(|_| Region::new(vm_ram as usize)).collect();
    rs[0].register(&pager, 0).unwrap();
    rs[1].register(&pager, 1).unwrap();
    let e = rs[2].register(&pager, 2).unwrap_err();
    assert!(matches!(e, PagerError::BadVm { vm: 2, .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains("no room on swap") && !e.contains('\n'), "{e}");
    two_vms_page_on_intact(&pager, [&rs[0], &rs[1]], blocks, block);
}

/// Issue 40: with `swap_on_first_fault`, swap is committed to a VM at its
/// first fault, not at registration, so a host can hold more VMs asleep
/// than its swap backs whole. The log's capacity is checked at that
/// commit: a VM that would not fit fails alone (reported, one line) and the
/// others run on, paging through the log without running out.
#[test]
fn a_vm_past_the_swap_capacity_fails_alone_at_its_first_fault() {
    let (pager, block, blocks) = log_with_room_for_two(true);
    let vm_ram = blocks as u64 * block;
    let rs: Vec<&'static Region> = (0..3)
        .map(|_| &*Box::leak(Box::new(Region::new(vm_ram as usize))))
        .collect();
    for (v, r) in rs.iter().enumerate() {
        r.register(&pager, v as u32).unwrap();
    }
    assert_eq!(pager.stats()["totals"]["swap_used_bytes"], 0);
    rs[0].write(0, 1);
    rs[1].write(0, 1);
    // Its fault is never served: the thread stays blocked, as a failed
    // VM's vCPU does until its owner destroys it.
    let third = rs[2];
    std::thread::spawn(move || third.write(0, 1));
    let deadline = Instant::now() + Duration::from_secs(20);
    let failures = loop {
        let f = pager.take_failures();
        if !f.is_empty() {
            break f;
        }
        assert!(Instant::now() < deadline, "the third VM did not fail");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].vm, Some(2));
    let why = &failures[0].reason;
    assert!(
        why.contains("no swap for its memory: swap device full") && !why.contains('\n'),
        "{why}"
    );
    pager.unregister_vm(2);
    two_vms_page_on_intact(&pager, [rs[0], rs[1]], blocks, block);
}

/// A wsswap pager for three VMs of 16 blocks of 32 KiB with a log for two
/// (2 x RAM a VM), committing swap at registration or at the first fault:
/// the pager, the block size and the blocks a VM.
fn log_with_room_for_two(swap_on_first_fault: bool) -> (Arc<Pager>, u64, usize) {
    let block = 32u64 << 10;
    let blocks = 16usize;
    let vm_ram = blocks as u64 * block;
    let mut cfg = config("wsswap", block, 8 * block, "full");
    cfg.swap_bytes = Some(2 * 2 * vm_ram);
    cfg.swap_on_first_fault = swap_on_first_fault;
    (Pager::new(cfg, 3, vm_ram).unwrap(), block, blocks)
}

/// Two VMs of `blocks` blocks rewrite every block six times through a
/// pager with room for them, and read the last values back: no failure,
/// nothing lost. Shuts the pager down.
fn two_vms_page_on_intact(pager: &Pager, rs: [&Region; 2], blocks: usize, block: u64) {
    let wpb = block as usize / 8;
    for round in 0..6u64 {
        for (v, r) in rs.iter().enumerate() {
            for b in 0..blocks {
                r.write(b * wpb, round << 32 | (v * 100 + b) as u64);
            }
        }
    }
    for (v, r) in rs.iter().enumerate() {
        for b in 0..blocks {
            assert_eq!(r.read(b * wpb), 5 << 32 | (v * 100 + b) as u64);
        }
    }
    assert!(pager.fatal_error().is_none(), "{:?}", pager.fatal_error());
    assert!(pager.take_failures().is_empty());
    pager.shutdown();
}

/// Issue 39 item 3: an operation on one space failing (here its holder
/// unmapped its guest memory, so write-protecting a victim fails with
/// ENOENT) fails that space alone: it is reported to the owner, and the
/// other space's VM is served on, its memory intact.
#[test]
fn an_error_on_one_space_fails_that_space_alone() {
    let block = 32u64 << 10;
    let blocks = 16usize;
    let vm_ram = blocks as u64 * block;
    let cfg = config("demand", block, 8 * block, "space-error");
    let pager = Pager::new(cfg, 2, vm_ram).unwrap();
    let (a, b) = (Region::new(vm_ram as usize), Region::new(vm_ram as usize));
    a.register(&pager, 0).unwrap();
    b.register(&pager, 1).unwrap();
    let wpb = block as usize / 8;
    for i in 0..4 {
        a.write(i * wpb, 7);
    }
    // A hostile holder: its guest memory is no longer mapped where it said.
    // SAFETY: the region is never touched again.
    assert_eq!(
        unsafe { libc::munmap(a.addr as *mut libc::c_void, a.len) },
        0
    );
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for round in 0..3u64 {
            for i in 0..blocks {
                b.write(i * wpb, round << 32 | i as u64);
            }
        }
        let ok = (0..blocks).all(|i| b.read(i * wpb) == 2 << 32 | i as u64);
        let _ = done.send(ok);
    });
    let served = finished.recv_timeout(Duration::from_secs(30));
    assert_eq!(
        served,
        Ok(true),
        "the other space was not served on (fatal: {:?})",
        pager.fatal_error()
    );
    assert!(pager.fatal_error().is_none(), "{:?}", pager.fatal_error());
    let failures = pager.take_failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(
        (failures[0].space, failures[0].vm),
        (a.space().unwrap(), None)
    );
    assert!(!failures[0].reason.contains('\n'));
    assert!(pager.take_failures().is_empty(), "reported once");
    assert_eq!(pager.stats()["totals"]["failures"], 1);
    // The owner kills its cell and detaches it; the rest goes on.
    pager.detach_space(a.space().unwrap());
    assert!(pager.vm_stats(0).is_null());
    b.write(0, 99);
    assert_eq!(b.read(0), 99);
    pager.shutdown();
}

fn misbehaving(mode: &str, want: &str) {
    let block = 32u64 << 10;
    let path = plugin("misbehaving_policy");
    let policy = format!("{},mode={mode}", path.display());
    let cfg = config(&policy, block, 4 * block, "plugin");
    let pager = Pager::new(cfg, 1, 16 * block).unwrap();
    let r = Region::new(16 * block as usize);
    r.register(&pager, 0).unwrap();
    let wpb = block as usize / 8;
    for b in 0..4 {
        r.write(b * wpb, 1000 + b as u64);
    }
    // The fifth block needs a victim: the plugin misbehaves.
    let toucher = std::thread::spawn(move || r.write(4 * wpb, 5));
    let e = wait_fatal(&pager);
    assert!(e.contains(want), "{e}");
    assert!(!e.contains('\n'));
    // Nothing was evicted on the plugin's say-so: memory is intact.
    for b in 0..4 {
        assert_eq!(r.read(b * wpb), 1000 + b as u64);
    }
    assert_eq!(total(&pager, "blocks_out"), 0);
    drop(toucher);
    pager.shutdown();
}

#[test]
fn panicking_plugin_is_contained() {
    misbehaving("panic", "panicked in choose_victims");
}

#[test]
fn nonsense_plugin_is_contained() {
    misbehaving("nonsense", "does not exist");
}

#[test]
fn plugin_load_errors() {
    let path = plugin("fifo_policy");
    let bad_args = config(
        &format!("{},x=1", path.display()),
        32 << 10,
        1 << 20,
        "args",
    );
    let e = Pager::new(bad_args, 1, 1 << 20)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("refused arguments"), "{e}");
    // A shared library that is not a policy.
    let libc_path = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("libm");
    let not_policy = config(libc_path, 32 << 10, 1 << 20, "notpolicy");
    let e = Pager::new(not_policy, 1, 1 << 20)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("not a policy plugin"), "{e}");
}

#[test]
fn disk_model_adds_time() {
    let block = 32u64 << 10;
    let mut cfg = config("demand", block, 4 * block, "disk");
    cfg.disk = DiskSpec::parse("hdd").unwrap();
    let pager = Pager::new(cfg, 1, 16 * block).unwrap();
    let r = Region::new(16 * block as usize);
    r.register(&pager, 0).unwrap();
    let wpb = block as usize / 8;
    for b in 0..16 {
        r.write(b * wpb, b as u64 + 1);
    }
    let read0 = total(&pager, "swap_read_bytes");
    let t = Instant::now();
    for _ in 0..2 {
        for b in 0..16 {
            assert_eq!(r.read(b * wpb), b as u64 + 1);
        }
    }
    // Every block read from swap costs at least its modeled transfer time
    // (32 KiB at 40 MB/s = 0.82 ms), seeks and rotation on top.
    let reads = (total(&pager, "swap_read_bytes") - read0) / block;
    assert!(reads >= 16, "{reads} reads");
    assert!(
        t.elapsed() >= Duration::from_micros(reads * 820),
        "{:?}",
        t.elapsed()
    );
    assert!(pager.stats()["totals"]["io_seconds"].as_f64().unwrap() > reads as f64 * 0.00082);
    assert_eq!(pager.stats()["config"]["disk"]["rpm"], 7200.0);
    pager.shutdown();
}

#[test]
fn swap_file_removed_unless_kept() {
    let cfg = config("demand", 32 << 10, 1 << 20, "rm");
    let path = cfg.swap_path.clone().unwrap();
    let pager = Pager::new(cfg, 1, 1 << 20).unwrap();
    // Unlinked as soon as it is open: even SIGKILL leaves nothing behind.
    assert!(!path.exists());
    pager.shutdown();
    assert!(!path.exists());
    let mut cfg = config("demand", 32 << 10, 1 << 20, "keep");
    cfg.keep_swap = true;
    let path = cfg.swap_path.clone().unwrap();
    let pager = Pager::new(cfg, 1, 1 << 20).unwrap();
    pager.shutdown();
    assert!(path.exists());
    std::fs::remove_file(path).unwrap();
}

#[test]
fn unregister_frees_memory_and_swap() {
    let block = 32u64 << 10;
    let blocks = 16usize;
    let vm_ram = blocks as u64 * block;
    let mut cfg = config("demand", block, blocks as u64 * block, "unreg");
    // Room for two VM regions only.
    cfg.swap_bytes = Some(2 * vm_ram);
    let pager = Pager::new(cfg, 2, vm_ram).unwrap();
    let a = Region::new(vm_ram as usize);
    let b = Region::new(vm_ram as usize);
    a.register(&pager, 0).unwrap();
    b.register(&pager, 1).unwrap();
    let c = Region::new(vm_ram as usize);
    let e = c.register(&pager, 2).unwrap_err().to_string();
    assert!(e.contains("swap device full"), "{e}");
    let wpb = block as usize / 8;
    for i in 0..blocks {
        a.write(i * wpb, 10 + i as u64);
        b.write(i * wpb, 20 + i as u64);
    }
    pager.unregister_vm(0);
    // SAFETY: the pager no longer serves this region.
    unsafe { libc::munmap(a.ptr().cast(), a.len) };
    assert!(pager.vm_stats(0).is_null());
    assert_eq!(
        total(&pager, "resident_bytes"),
        pager.vm_stats(1)["resident_bytes"].as_u64().unwrap()
    );
    // VM 0's swap region is free again.
    c.register(&pager, 2).unwrap();
    for i in 0..blocks {
        c.write(i * wpb, 30 + i as u64);
    }
    for i in 0..blocks {
        assert_eq!(b.read(i * wpb), 20 + i as u64);
        assert_eq!(c.read(i * wpb), 30 + i as u64);
    }
    assert_eq!(pager.fatal_error(), None);
    pager.shutdown();
}

/// Issue 39 item 4: what a cell hands over for a space is checked, each
/// inconsistency refused with a typed one-line error (never a panic); the
/// descriptors the pager keeps are close-on-exec whatever they arrived as;
/// a VM id no cell could mean is refused, not allocated for.
#[test]
fn attach_space_refuses_an_inconsistent_handoff_and_keeps_descriptors_private() {
    use paging_policy::guest_memory::check_sealed;
    use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
    let block = 32u64 << 10;
    let cfg = config("demand", block, 8 * block, "handoff");
    let pager = Pager::new(cfg, 2, 16 * block).unwrap();
    let memory = GuestMemory::new(16 * block as usize).unwrap();
    let refused = |h: paging_policy::SpaceHandoff, want: &str| {
        let e = pager.attach_space(h).unwrap_err();
        assert!(matches!(e, PagerError::BadSpace { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{e}");
    };
    let mut h = memory.handoff().unwrap();
    h.base += 8;
    refused(h, "whole pages");
    let mut h = memory.handoff().unwrap();
    h.len = 0;
    refused(h, "whole pages");
    let mut h = memory.handoff().unwrap();
    h.base = usize::MAX - 4095;
    refused(h, "address space");
    let mut h = memory.handoff().unwrap();
    h.len = 2 * memory.len();
    refused(h, "holds");
    let mut h = memory.handoff().unwrap();
    h.memfd_offset = 4096;
    refused(h, "holds");
    let mut h = memory.handoff().unwrap();
    h.memfd_offset = 100;
    refused(h, "memfd offset");
    let mut h = memory.handoff().unwrap();
    h.memfd_offset = usize::MAX - 4095;
    refused(h, "memfd offset");
    let mut h = memory.handoff().unwrap();
    h.uffd = h.memfd.try_clone().unwrap();
    refused(h, "not a userfaultfd");
    let mut h = memory.handoff().unwrap();
    h.memfd = Arc::new(h.uffd.try_clone().unwrap());
    refused(h, "not a memory file");
    let mut h = memory.handoff().unwrap();
    let pipe = {
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        unsafe { libc::close(fds[1]) };
        unsafe { OwnedFd::from_raw_fd(fds[0]) }
    };
    h.memfd = Arc::new(pipe);
    refused(h, "not a memory file");
    // A memfd its sharer could shrink under the pager's reads.
    let unsealed = unsafe {
        let fd = libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, memory.len() as libc::off_t), 0);
        OwnedFd::from_raw_fd(fd)
    };
    assert!(check_sealed(unsealed.as_fd(), memory.len()).is_err());
    let mut h = memory.handoff().unwrap();
    h.memfd = Arc::new(unsealed);
    refused(h, "sealed against shrinking");
    // GuestMemory's own memfd is sealed: it cannot shrink.
    assert!(check_sealed(memory.memfd().unwrap(), memory.len()).is_ok());
    assert_ne!(
        unsafe { libc::ftruncate(memory.memfd().unwrap().as_raw_fd(), 4096) },
        0,
        "guest RAM must not shrink"
    );
    // Accepted, as received over SCM_RIGHTS without MSG_CMSG_CLOEXEC: the
    // pager makes what it keeps close-on-exec.
    let h = memory.handoff().unwrap();
    let raw = [h.uffd.as_raw_fd(), h.memfd.as_raw_fd()];
    for fd in raw {
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) }, 0);
    }
    let space = pager.attach_space(h).unwrap();
    for fd in raw {
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert!(
            flags >= 0 && flags & libc::FD_CLOEXEC != 0,
            "fd {fd} not close-on-exec"
        );
    }
    let e = pager
        .register_vm(u32::MAX, space, 0, block as usize)
        .unwrap_err();
    assert!(matches!(e, PagerError::BadVm { .. }), "{e}");
    assert!(pager.fatal_error().is_none());
    pager.detach_space(space);
    pager.shutdown();
}

/// Waits until `done` holds, failing the test after 30 s or at a fatal error.
fn wait_until(p: &Pager, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert_eq!(p.fatal_error(), None, "waiting until {what}");
        assert!(Instant::now() < deadline, "never {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn vm_counter(p: &Pager, vm: u32, key: &str) -> u64 {
    p.vm_stats(vm)[key]
        .as_u64()
        .unwrap_or_else(|| panic!("VM {vm} stats key {key}"))
}

/// Blocks of the hibernation tests: 4 KiB, so that one VM spans many
/// hibernation parts.
const HIB_BLOCK: u64 = 4 << 10;
const HIB_BLOCKS: usize = 1024;

/// A pager (`policy`, `disk`, room for both VMs) with VM 0 and VM 1 of
/// `HIB_BLOCKS` blocks; VM 0's blocks hold `0xA000 + i`, written.
fn hibernation_pager(
    policy: &str,
    disk: &str,
    wake_first: Option<u64>,
    tag: &str,
) -> (Arc<Pager>, Region, Region) {
    let vm_ram = HIB_BLOCKS * HIB_BLOCK as usize;
    let mut cfg = config(policy, HIB_BLOCK, 2 * vm_ram as u64, tag);
    cfg.disk = DiskSpec::parse(disk).unwrap();
    cfg.wake_first = wake_first;
    let pager = Pager::new(cfg, 2, vm_ram as u64).unwrap();
    let (a, b) = (Region::new(vm_ram), Region::new(vm_ram));
    a.register(&pager, 0).unwrap();
    b.register(&pager, 1).unwrap();
    let wpb = HIB_BLOCK as usize / 8;
    for i in 0..HIB_BLOCKS {
        a.write(i * wpb, 0xA000 + i as u64);
    }
    (pager, a, b)
}

/// Issue 40: hibernating a VM returns at once (the eviction, 16 parts on a
/// modeled disk, goes on behind it) and takes every resident block of it
/// out of memory (written ones to swap, zero ones dropped); after the wake
/// its touches bring them back intact. Unknown ids are ignored. The wake
/// installs first the part of a block inside its second 1 MiB piece, as if
/// the VM touched that first: each block still lands in its own place.
#[test]
fn a_hibernated_vm_leaves_memory_and_comes_back_intact() {
    let first = 300 * HIB_BLOCK + 8;
    let (pager, a, b) = hibernation_pager("demand", "hdd", Some(first), "hibernate");
    let wpb = HIB_BLOCK as usize / 8;
    let zeros = 40;
    // VM 1's first blocks are read, never written: zero, with no swap copy.
    for i in 0..zeros {
        assert_eq!(b.read(i * wpb), 0);
    }
    b.write(zeros * wpb, 7);
    let other = vm_counter(&pager, 1, "resident_bytes");
    assert_eq!(other, (zeros as u64 + 1) * HIB_BLOCK);
    pager.hibernate(0);
    pager.hibernate(1 << 19);
    assert!(
        vm_counter(&pager, 0, "resident_bytes") > 0,
        "hibernate waited for the eviction"
    );
    wait_until(&pager, "VM 0 left memory", || {
        vm_counter(&pager, 0, "resident_bytes") == 0
    });
    assert_eq!(total(&pager, "resident_bytes"), other);
    assert_eq!(a.resident_pages(), 0, "VM 0's memory is still there");
    assert_eq!(
        vm_counter(&pager, 0, "swap_write_bytes"),
        HIB_BLOCKS as u64 * HIB_BLOCK
    );
    assert_eq!(vm_counter(&pager, 0, "hibernations"), 1);
    assert_eq!(
        vm_counter(&pager, 0, "hibernated_blocks_out"),
        HIB_BLOCKS as u64
    );
    assert_eq!(total(&pager, "hibernations"), 1);
    assert_eq!(total(&pager, "hibernated_blocks_out"), HIB_BLOCKS as u64);
    // VM 1 goes too: its zero blocks are dropped without a write.
    pager.hibernate(1);
    wait_until(&pager, "VM 1 left memory", || {
        total(&pager, "resident_bytes") == 0
    });
    assert_eq!(vm_counter(&pager, 1, "swap_write_bytes"), HIB_BLOCK);
    let faults = vm_counter(&pager, 0, "faults");
    pager.note_woken(0);
    // REAP: what it had resident comes back in one batch, before any touch.
    wait_until(&pager, "VM 0's set came back", || {
        vm_counter(&pager, 0, "resident_bytes") == HIB_BLOCKS as u64 * HIB_BLOCK
    });
    assert_eq!(vm_counter(&pager, 0, "faults"), faults + 1, "one batch");
    for i in 0..HIB_BLOCKS {
        assert_eq!(a.read(i * wpb), 0xA000 + i as u64, "block {i}");
    }
    assert_eq!(
        vm_counter(&pager, 0, "swap_read_bytes"),
        HIB_BLOCKS as u64 * HIB_BLOCK
    );
    assert_eq!(b.read(zeros * wpb), 7);
    assert_eq!(b.read(0), 0);
    assert_eq!(pager.fatal_error(), None);
    pager.shutdown();
}

/// Issue 40: a VM that wakes while its hibernation is still writing it out
/// (a modeled disk) reads and writes its memory through it: blocks already
/// out fault back from swap, faults on blocks in flight wait for them, and
/// nothing is lost or left busy.
#[test]
fn a_vm_woken_during_its_hibernation_keeps_its_data() {
    let (pager, a, _b) = hibernation_pager("demand", "hdd", None, "wake-early");
    let wpb = HIB_BLOCK as usize / 8;
    let out = || total(&pager, "hibernated_blocks_out");
    pager.hibernate(0);
    wait_until(&pager, "a first part is out", || out() > 0);
    pager.note_woken(0);
    let woken_at = out();
    assert!(
        woken_at < HIB_BLOCKS as u64,
        "no race: the hibernation ended"
    );
    let vcpu = std::thread::spawn(move || {
        for i in 0..HIB_BLOCKS {
            assert_eq!(a.read(i * wpb), 0xA000 + i as u64, "block {i}");
            a.write(i * wpb + 1, i as u64);
        }
    });
    vcpu.join().expect("the woken VM read its data");
    wait_until(&pager, "the hibernation ended", || {
        out() == HIB_BLOCKS as u64
    });
    assert!(vm_counter(&pager, 0, "faults") > HIB_BLOCKS as u64);
    for i in 0..HIB_BLOCKS {
        assert_eq!(a.read(i * wpb), 0xA000 + i as u64, "block {i}");
        assert_eq!(a.read(i * wpb + 1), i as u64, "block {i}");
    }
    // Nothing stays busy: unregistration (which waits for that) completes.
    pager.unregister_vm(0);
    assert!(pager.vm_stats(0).is_null());
    assert_eq!(total(&pager, "resident_bytes"), 0);
    assert_eq!(pager.fatal_error(), None);
    pager.shutdown();
}

/// Issue 40: a VM unregistered while its hibernation is queued or under way
/// gives up the rest of it: the unregistration returns, no swap stays
/// used, and its memory can serve a new VM.
#[test]
fn a_vm_unregistered_during_its_hibernation_leaks_nothing() {
    let (pager, a, _b) = hibernation_pager("wsswap", "hdd", None, "unreg-hibernating");
    pager.hibernate(0);
    pager.unregister_vm(0);
    assert!(pager.vm_stats(0).is_null());
    assert!(
        total(&pager, "hibernated_blocks_out") < HIB_BLOCKS as u64,
        "the whole hibernation was written for a VM being destroyed"
    );
    assert_eq!(total(&pager, "resident_bytes"), 0);
    assert_eq!(total(&pager, "swap_used_bytes"), 0);
    a.register(&pager, 2).unwrap();
    let wpb = HIB_BLOCK as usize / 8;
    for i in 0..8 {
        assert_eq!(a.read(i * wpb), 0, "the new VM's block {i}");
    }
    assert_eq!(pager.fatal_error(), None);
    pager.shutdown();
}

/// A demand pager for one VM of `HIB_BLOCKS` blocks, room for two, and the
/// VM's RAM bytes.
fn one_vm_pager(tag: &str) -> (Arc<Pager>, usize) {
    let vm_ram = HIB_BLOCKS * HIB_BLOCK as usize;
    let cfg = config("demand", HIB_BLOCK, 2 * vm_ram as u64, tag);
    (Pager::new(cfg, 1, vm_ram as u64).unwrap(), vm_ram)
}

/// Issue 40: a space whose process left (a densevm holder whose VMs all
/// sleep) keeps no userfaultfd in the pager: the memory's registration ends,
/// so another descriptor can register it. A prefetch that comes meanwhile
/// goes into the memfd, and once a new process attaches, the VM's data is
/// whole, written or not, through another hibernation.
#[test]
fn a_space_released_by_its_process_holds_no_userfaultfd_and_comes_back_intact() {
    let (pager, vm_ram) = one_vm_pager("released");
    let memory = GuestMemory::new(vm_ram).unwrap();
    let space = pager.attach_space(memory.hand_over().unwrap()).unwrap();
    pager.register_vm(0, space, 0, vm_ram).unwrap();
    let word = |i: usize| memory.as_ptr() as usize + i * HIB_BLOCK as usize;
    // SAFETY (every access below): inside the mapping, which outlives them.
    let read = |i: usize| unsafe { std::ptr::read_volatile(word(i) as *const u64) };
    let write = |i: usize, v: u64| unsafe { std::ptr::write_volatile(word(i) as *mut u64, v) };
    for i in 0..HIB_BLOCKS {
        write(i, 0xB000 + i as u64);
    }
    let pager_ref = &pager;
    let resident = |want: u64| move || vm_counter(pager_ref, 0, "resident_bytes") == want;
    let full = HIB_BLOCKS as u64 * HIB_BLOCK;
    pager.hibernate(0);
    wait_until(&pager, "VM 0 left memory", resident(0));
    pager.release_process(space).unwrap();
    assert!(
        memory.register().is_ok(),
        "the pager still holds the released process's userfaultfd"
    );
    let second = memory.take_uffd().unwrap();
    drop(second);
    pager.note_woken(0);
    wait_until(
        &pager,
        "the prefetch came back into the memfd",
        resident(full),
    );
    for i in 0..HIB_BLOCKS {
        assert_eq!(
            read(i),
            0xB000 + i as u64,
            "block {i}, before the new process"
        );
    }
    memory.register().unwrap();
    pager
        .reattach_space(space, memory.take_uffd().unwrap())
        .unwrap();
    for i in (0..HIB_BLOCKS).step_by(2) {
        write(i, 0xC000 + i as u64);
    }
    pager.hibernate(0);
    wait_until(&pager, "VM 0 left memory again", resident(0));
    for i in 0..HIB_BLOCKS {
        let want = if i % 2 == 0 { 0xC000 } else { 0xB000 } + i as u64;
        assert_eq!(read(i), want, "block {i}, after the second hibernation");
    }
    let refused = pager.release_process(space + 1).unwrap_err().to_string();
    assert!(refused.contains("no such space"), "{refused}");
    assert_eq!(pager.fatal_error(), None);
    pager.shutdown();
}

/// Issue 40: a holder that leaves while its last VM's hibernation is still
/// being written, and comes back at once: the reattach returns only once
/// that eviction, begun on the departed process's descriptor, is done.
/// Before, it waited only for the space the release made, and the eviction
/// went on punching blocks the new process could already be writing.
#[test]
fn a_reattach_after_a_release_waits_for_what_began_before_the_release() {
    let (pager, a, _b) = hibernation_pager("demand", "hdd", None, "release-inflight");
    let out = || total(&pager, "hibernated_blocks_out");
    let space = a.space().unwrap();
    pager.hibernate(0);
    wait_until(&pager, "a first part is out", || out() > 0);
    pager.release_process(space).unwrap();
    assert!(out() < HIB_BLOCKS as u64, "no race: the hibernation ended");
    // A new process's descriptor (this test has one process: an unregistered one).
    let uffd = paging_policy::uffd::Uffd::new().unwrap().into_fd();
    pager.reattach_space(space, uffd).unwrap();
    assert_eq!(
        out(),
        HIB_BLOCKS as u64,
        "the reattach returned with the eviction still under way"
    );
    assert_eq!(pager.fatal_error(), None);
    pager.shutdown();
}

/// Issue 40: a space cut from a memfd that other spaces share (a densevm
/// cell's holder keeps its part of the cell's one memfd) is paged at its
/// offset in the memfd: its blocks go out and come back there, and the
/// other parts' bytes stay untouched.
#[test]
fn a_space_cut_from_a_shared_memfd_is_paged_at_its_offset() {
    use std::os::fd::AsRawFd;
    let (pager, vm_ram) = one_vm_pager("cut");
    let mut memory = GuestMemory::unregistered(3 * vm_ram).unwrap();
    let memfd = memory.memfd().unwrap().try_clone_to_owned().unwrap();
    let at = |offset: usize| {
        let mut word = [0u8; 8];
        // SAFETY: reading 8 bytes of our memfd into our buffer.
        let n = unsafe {
            libc::pread(
                memfd.as_raw_fd(),
                word.as_mut_ptr().cast(),
                8,
                offset as i64,
            )
        };
        assert_eq!(n, 8);
        u64::from_ne_bytes(word)
    };
    // SAFETY: the first part is mapped until the narrowing below.
    unsafe { std::ptr::write_volatile(memory.as_ptr().cast::<u64>(), 0x5EED) };
    memory.narrow(vm_ram, vm_ram).unwrap();
    assert!(memory.narrow(0, 2 * vm_ram).is_err(), "past the part");
    memory.register().unwrap();
    assert!(memory.narrow(0, 4096).is_err(), "registered");
    let handoff = memory.handoff().unwrap();
    assert_eq!(handoff.memfd_offset, vm_ram);
    let space = pager.attach_space(handoff).unwrap();
    pager.register_vm(0, space, 0, vm_ram).unwrap();
    let word = |i: usize| memory.as_ptr() as usize + i * HIB_BLOCK as usize;
    for i in 0..HIB_BLOCKS {
        // SAFETY: inside the part's mapping.
        unsafe { std::ptr::write_volatile(word(i) as *mut u64, 0xD000 + i as u64) };
    }
    assert_eq!(
        at(vm_ram + HIB_BLOCK as usize),
        0xD001,
        "the part is its slice of the memfd"
    );
    let pager_ref = &pager;
    let resident = |want: u64| move || vm_counter(pager_ref, 0, "resident_bytes") == want;
    pager.hibernate(0);
    wait_until(&pager, "VM 0 left memory", resident(0));
    assert_eq!(
        at(vm_ram + HIB_BLOCK as usize),
        0,
        "its blocks were freed in the memfd"
    );
    pager.note_woken(0);
    wait_until(
        &pager,
        "VM 0 came back",
        resident(HIB_BLOCKS as u64 * HIB_BLOCK),
    );
    for i in 0..HIB_BLOCKS {
        // SAFETY: as above.
        let v = unsafe { std::ptr::read_volatile(word(i) as *const u64) };
        assert_eq!(v, 0xD000 + i as u64, "block {i}");
    }
    assert_eq!(at(0), 0x5EED, "another part's bytes were touched");
    assert_eq!(at(2 * vm_ram), 0);
    assert_eq!(pager.fatal_error(), None);
    pager.shutdown();
}

/// Issue 40: under wsswap too a VM woken from hibernation gets its whole set
/// back in one batch and one read, before it touches any of it.
#[test]
fn wsswap_brings_a_woken_vm_back_in_one_read() {
    let block = PAIR_BLOCK;
    let (pager, a, _b) = pager_for_two_vms("wsswap", 20, "ws-wake");
    let wpb = block as usize / 8;
    for i in 0..10 {
        a.write(i * wpb, i as u64 + 1);
    }
    pager.hibernate(0);
    wait_until(&pager, "VM 0 left memory", || {
        vm_counter(&pager, 0, "resident_bytes") == 0
    });
    let faults = vm_counter(&pager, 0, "faults");
    pager.note_woken(0);
    wait_until(&pager, "VM 0's set came back", || {
        vm_counter(&pager, 0, "resident_bytes") == 10 * block
    });
    for i in 0..10 {
        assert_eq!(a.read(i * wpb), i as u64 + 1);
    }
    assert_eq!(vm_counter(&pager, 0, "faults"), faults + 1);
    assert_eq!(vm_counter(&pager, 0, "swap_read_bytes"), 10 * block);
    pager.shutdown();
}

/// The clone template is saved whole even when its hibernation comes while
/// one of its faults is still in flight (here: waiting for room, which an
/// eviction behind a modeled disk makes): its hibernation waits for the
/// fault, without holding up the hibernation thread, instead of saving the
/// template without that block and refusing it.
#[test]
fn a_clone_template_hibernated_with_a_fault_in_flight_is_saved_whole() {
    let block = 32u64 << 10;
    let mut cfg = config("demand", block, 4 * block, "template-in-flight");
    cfg.disk = DiskSpec::parse("hdd").unwrap();
    cfg.compact_swap = true;
    cfg.clone_template = Some(0);
    let pager = Pager::new(cfg, 2, 16 * block).unwrap();
    let template = Region::new(16 * block as usize);
    let other = Region::new(16 * block as usize);
    template.register(&pager, 0).unwrap();
    other.register(&pager, 1).unwrap();
    let wpb = block as usize / 8;
    // VM 1 fills the budget: VM 0's first touch must evict one of its
    // blocks first, a write of several milliseconds behind the disk model.
    for b in 0..4 {
        other.write(b * wpb, 0xB000 + b as u64);
    }
    let done = Arc::new(AtomicBool::new(false));
    let faulting = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            template.write(0, 0xA000);
            done.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(2));
    assert!(!done.load(Ordering::SeqCst), "the fault is still in flight");
    pager.hibernate(0);
    faulting.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pager.clone_template() == CloneTemplate::Pending && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(pager.clone_template(), CloneTemplate::Ready);
    assert_eq!(template.read(0), 0xA000, "the template's block, read back");
    pager.shutdown();
}
