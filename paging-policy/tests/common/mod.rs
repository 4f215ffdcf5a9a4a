//! Helpers for the pager tests: "guest RAM" regions (memfd-backed
//! `GuestMemory`, as a densevm cell has) touched by plain host threads, which
//! fault through userfaultfd exactly as KVM's accesses do.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::OnceLock;

use paging_policy::{GuestMemory, Pager, PagerConfig, PagerError, SpaceId};

/// A region's memory and the space it is attached as (once).
struct Backing {
    memory: GuestMemory,
    space: OnceLock<SpaceId>,
}

/// One VM's guest memory, never touched before registration.
#[derive(Clone, Copy)]
pub struct Region {
    pub addr: usize,
    pub len: usize,
    backing: &'static Backing,
}

impl Region {
    /// Creates `len` bytes of guest memory (leaked at the end of the test
    /// process: unmapping a region the pager may still serve is not what the
    /// tests are about).
    pub fn new(len: usize) -> Region {
        let memory = GuestMemory::new(len).expect("guest memory");
        let backing: &'static Backing = Box::leak(Box::new(Backing {
            memory,
            space: OnceLock::new(),
        }));
        Region {
            addr: backing.memory.as_ptr() as usize,
            len,
            backing,
        }
    }

    /// Attaches the region to `pager` (the first time) and registers it as VM `vm`.
    pub fn register(&self, pager: &Pager, vm: u32) -> Result<(), PagerError> {
        let space = match self.backing.space.get() {
            Some(&space) => space,
            None => {
                let space = pager.attach_space(self.backing.memory.handoff()?)?;
                *self.backing.space.get_or_init(|| space)
            }
        };
        pager.register_vm(vm, space, 0, self.len)
    }

    /// The space the region is attached as, once registered.
    pub fn space(&self) -> Option<SpaceId> {
        self.backing.space.get().copied()
    }

    pub fn ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Reads the u64 at word `i`.
    pub fn read(&self, i: usize) -> u64 {
        assert!(i * 8 < self.len);
        // SAFETY: inside the mapping; volatile so every access really
        // touches memory (and may fault).
        unsafe { std::ptr::read_volatile((self.addr as *const u64).add(i)) }
    }

    /// Writes the u64 at word `i`.
    pub fn write(&self, i: usize, v: u64) {
        assert!(i * 8 < self.len);
        // SAFETY: as in `read`.
        unsafe { std::ptr::write_volatile((self.addr as *mut u64).add(i), v) }
    }

    /// Pages of the region resident in memory (mincore).
    pub fn resident_pages(&self) -> usize {
        let pages = self.len / 4096;
        let mut vec = vec![0u8; pages];
        // SAFETY: vec has one byte per page.
        let r =
            unsafe { libc::mincore(self.addr as *mut libc::c_void, self.len, vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore failed");
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A unique swap path in the temp directory.
pub fn swap_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "pager-test-{}-{}-{}.swap",
        std::process::id(),
        tag,
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A configuration for tests.
pub fn config(policy: &str, block: u64, budget: u64, tag: &str) -> PagerConfig {
    PagerConfig {
        budget_bytes: budget,
        block_bytes: block,
        policy: paging_policy::PolicySpec::parse(policy).expect("a valid test policy"),
        swap_path: Some(swap_path(tag)),
        keep_swap: false,
        swap_bytes: None,
        ..PagerConfig::default()
    }
}

/// xorshift64*: a tiny deterministic generator for access patterns.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Directory holding the built example plugins (target/<profile>/examples).
pub fn examples_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test binary>
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("examples")
}

/// Path of an example plugin, building the examples if needed.
pub fn plugin(name: &str) -> PathBuf {
    let p = examples_dir().join(format!("lib{name}.so"));
    if !p.exists() {
        let release = examples_dir()
            .parent()
            .is_some_and(|d| d.ends_with("release"));
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "-q", "-p", "paging-policy", "--examples"]);
        if release {
            cmd.arg("--release");
        }
        let ok = cmd.status().expect("run cargo").success();
        assert!(ok, "building the example plugins failed");
    }
    assert!(p.exists(), "{} missing", p.display());
    p
}
