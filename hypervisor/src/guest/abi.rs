//! The densevm <-> webguest ABI, mirrored from `guest-images/webguest/abi.h`.
//!
//! The C header is the source of truth for the guest; the unit test at the
//! bottom reads it and fails if any constant here disagrees.

/// Start of the system pages (boot info, VIF, GDT, control page, rings).
pub const SYS_GPA: u64 = 0x0;
/// Size of the system region.
pub const SYS_BYTES: u64 = 0x10_0000;
/// Boot-info page.
pub const BOOTINFO_GPA: u64 = 0x1000;
/// PVM's virtual interrupt-flag page.
pub const VIF_GPA: u64 = 0x2000;
/// Global descriptor table.
pub const GDT_GPA: u64 = 0x3000;
/// Task-state segment (required by VMX entry checks, unused by the guest).
pub const TSS_GPA: u64 = 0x3800;
/// Control page: guest counters and state, host command word.
pub const CTRL_GPA: u64 = 0x4000;
/// Page-table root.
pub const PML4_GPA: u64 = 0x5000;
/// Page-directory-pointer table.
pub const PDPT_GPA: u64 = 0x6000;
/// Page directory (2 MiB pages).
pub const PD_GPA: u64 = 0x7000;
/// Ring indices and idle flags.
pub const RINGHDR_GPA: u64 = 0x8000;
/// Per-slot flow-control counters.
pub const CREDIT_GPA: u64 = 0x9000;
/// Host-to-guest ring.
pub const RX_RING_GPA: u64 = 0x1_0000;
/// Size of the host-to-guest ring.
pub const RX_RING_BYTES: u64 = 0x1_0000;
/// Guest-to-host ring.
pub const TX_RING_GPA: u64 = 0x4_0000;
/// Size of the guest-to-host ring.
pub const TX_RING_BYTES: u64 = 0x4_0000;
/// The shared read-only guest image (text and rodata).
pub const IMAGE_GPA: u64 = 0x20_0000;
/// Largest guest image.
pub const IMAGE_BYTES: u64 = 0x20_0000;
/// The parts of the system region the ABI uses: the pages up to the credit
/// page, and the two rings. The rest is inaccessible to the guest, so it
/// cannot dirty host memory outside the budget.
pub const SYS_USED: [(u64, u64); 3] = [
    (SYS_GPA, CREDIT_GPA + 0x1000),
    (RX_RING_GPA, RX_RING_BYTES),
    (TX_RING_GPA, TX_RING_BYTES),
];
/// The system pages a hibernated VM keeps: its counters and state, its
/// rings' indices and its connections' credits. The others are written
/// again when it wakes (boot info, GDT, page tables) or hold nothing then
/// (the rings' bytes: every connection ended before it slept).
pub const SYS_KEPT_ASLEEP: [(u64, u64); 2] = [(CTRL_GPA, 0x1000), (RINGHDR_GPA, 0x2000)];
/// Bytes of the system region given to the guest (its end: the tx ring's).
pub const SYS_MAPPED_BYTES: u64 = TX_RING_GPA + TX_RING_BYTES;
/// Guest RAM: bss, connection buffers, working set, stack.
pub const RAM_GPA: u64 = 0x40_0000;

/// "DENSEVM1".
pub const BOOT_MAGIC: u64 = 0x314d_5645_534e_4544;
/// Version of the boot-info layout.
pub const BOOT_VERSION: u32 = 1;
/// The host is PVM: the interrupt flag lives in the VIF page.
pub const FLAG_PVM: u32 = 0x1;
/// Stamp and verify every working-set page on every request.
pub const FLAG_SELFCHECK: u32 = 0x2;
/// The guest wakes from hibernation: its RAM and rings are as it left them,
/// only its vCPU is new (set up again, nothing else initialised).
pub const FLAG_RESUME: u32 = 0x4;
/// The image's template boots: the guest gives its memory the content a
/// loaded server's has before it says it is ready, then is parked and
/// saved, and every other VM starts as a clone of that memory.
pub const FLAG_TEMPLATE: u32 = 0x8;
/// With [`FLAG_RESUME`]: a clone's first start, on a copy of the
/// template's RAM; the guest makes the template's per-VM state its own.
pub const FLAG_CLONE: u32 = 0x10;

/// Guest-to-host notification port (an ioeventfd).
pub const DOORBELL_PORT: u16 = 0x510;
/// Port a dying guest writes to: exits to the monitor.
pub const PANIC_PORT: u16 = 0x511;
/// Vector of the host-to-guest interrupt.
pub const IRQ_VECTOR: u32 = 0x40;

/// Connection slots per VM.
pub const MAX_SLOTS: usize = 64;
/// Request bytes a slot may have outstanding in the guest.
pub const RX_WINDOW: u32 = 8192;
/// Response bytes a slot may have unacknowledged by the host.
pub const TX_WINDOW: u32 = 262_144;
/// Stack at the top of RAM.
pub const STACK_BYTES: u64 = 0x8000;

/// Size of the object at `/`.
#[cfg(test)]
pub const SMALL_BYTES: u32 = 2258;
/// Size of the object at `/large`.
#[cfg(test)]
pub const LARGE_BYTES: u32 = 134_007;
/// Period of the object byte pattern.
#[cfg(test)]
pub const PATTERN_PERIOD: u32 = 4096;

/// Connection bytes (both directions).
pub const REC_DATA: u8 = 1;
/// Host to guest: a new connection on the slot.
pub const REC_OPEN: u8 = 2;
/// Host to guest: the client sent EOF or failed.
pub const REC_FIN: u8 = 3;
/// Guest to host: slot released; close after flushing.
pub const REC_CLOSE: u8 = 4;
/// Skip to the end of the ring.
pub const REC_PAD: u8 = 0xff;
/// Every record starts with this many header bytes.
pub const RECORD_HEADER: u32 = 8;

/// Guest state: booting.
#[cfg(test)]
pub const STATE_BOOTING: u32 = 0;
/// Guest state: serving.
pub const STATE_READY: u32 = 1;
/// Guest state: took an exception.
pub const STATE_PANICKED: u32 = 2;
/// Parked at a safe point for hibernation ([`CMD_PARK`]).
pub const STATE_PARKED: u32 = 3;

/// Host command: execute an invalid instruction.
pub const CMD_CRASH: u32 = 1;
/// Host command: triple fault.
pub const CMD_TRIPLE: u32 = 2;
/// Park for hibernation: the guest stops at the top of its loop, where
/// nothing is half done, and says so ([`STATE_PARKED`]).
pub const CMD_PARK: u32 = 3;

/// `struct dv_boot_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BootInfo {
    /// [`BOOT_MAGIC`].
    pub magic: u64,
    /// [`BOOT_VERSION`].
    pub version: u32,
    /// Index of the VM.
    pub vm_id: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Write one word in every Nth working-set page per request.
    pub ws_write_stride: u32,
    /// Guest-physical start of RAM.
    pub ram_gpa: u64,
    /// Size of RAM.
    pub ram_bytes: u64,
    /// Guest-physical start of the working set.
    pub ws_gpa: u64,
    /// Size of the working set.
    pub ws_bytes: u64,
    /// `--guest-arg`: opaque to the monitor, given to every guest.
    pub guest_arg: u64,
}

/// `struct dv_ctrl`: read by the host with volatile loads.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Ctrl {
    /// `STATE_*`.
    pub state: u32,
    /// `CMD_*`, written by the host.
    pub host_cmd: u32,
    /// Responses started.
    pub requests: u64,
    /// Of which 4xx or 5xx.
    pub responses_4xx: u64,
    /// Response bytes produced.
    pub tx_bytes: u64,
    /// Times the guest halted.
    pub wakeups: u64,
    /// Working-set pages verified in self-check mode.
    pub selfcheck_pages: u64,
    /// Pages whose stamps did not match.
    pub selfcheck_errors: u64,
    /// Exception vector of a panicked guest.
    pub panic_vector: u64,
    /// Its RIP.
    pub panic_rip: u64,
    /// Its error code.
    pub panic_error_code: u64,
}

/// Offsets of the fields of `struct dv_ring_hdr` (one cache line each).
pub mod ring_hdr {
    /// Host-written rx producer index.
    pub const RX_PROD: u64 = 0;
    /// Guest-written rx consumer index.
    pub const RX_CONS: u64 = 64;
    /// Guest-written tx producer index.
    pub const TX_PROD: u64 = 128;
    /// Host-written tx consumer index.
    pub const TX_CONS: u64 = 192;
    /// Guest: 1 while it may halt.
    pub const GUEST_IDLE: u64 = 256;
    /// Guest: bumped at every idle period.
    pub const IDLE_GEN: u64 = 260;
    /// Guest: 1 while it idles with output that credit or ring room holds back.
    pub const TX_WAITING: u64 = 264;
}

/// `struct dv_credit`, one per slot at [`CREDIT_GPA`].
pub mod credit {
    /// Size of one slot's counters.
    pub const STRIDE: u64 = 8;
    /// Guest-written: request bytes consumed.
    pub const RX_CONSUMED: u64 = 0;
    /// Host-written: response bytes acknowledged.
    pub const TX_ACKED: u64 = 4;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn header_defines() -> HashMap<String, u64> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../guest-images/webguest/abi.h"
        );
        let text = std::fs::read_to_string(path).expect("abi.h");
        text.lines()
            .filter_map(|line| {
                let mut words = line.split_whitespace();
                (words.next()? == "#define").then_some(())?;
                let name = words.next()?.strip_prefix("DV_")?;
                let value = words.next()?.trim_end_matches("ULL");
                let parsed = match value.strip_prefix("0x") {
                    Some(hex) => u64::from_str_radix(hex, 16).ok()?,
                    None => value.parse().ok()?,
                };
                Some((name.to_string(), parsed))
            })
            .collect()
    }

    #[test]
    fn constants_match_the_c_header() {
        let defines = header_defines();
        let ours: &[(&str, u64)] = &[
            ("SYS_GPA", SYS_GPA),
            ("SYS_BYTES", SYS_BYTES),
            ("BOOTINFO_GPA", BOOTINFO_GPA),
            ("VIF_GPA", VIF_GPA),
            ("GDT_GPA", GDT_GPA),
            ("TSS_GPA", TSS_GPA),
            ("CTRL_GPA", CTRL_GPA),
            ("PML4_GPA", PML4_GPA),
            ("PDPT_GPA", PDPT_GPA),
            ("PD_GPA", PD_GPA),
            ("RINGHDR_GPA", RINGHDR_GPA),
            ("CREDIT_GPA", CREDIT_GPA),
            ("RX_RING_GPA", RX_RING_GPA),
            ("RX_RING_BYTES", RX_RING_BYTES),
            ("TX_RING_GPA", TX_RING_GPA),
            ("TX_RING_BYTES", TX_RING_BYTES),
            ("IMAGE_GPA", IMAGE_GPA),
            ("IMAGE_BYTES", IMAGE_BYTES),
            ("RAM_GPA", RAM_GPA),
            ("BOOT_MAGIC", BOOT_MAGIC),
            ("BOOT_VERSION", BOOT_VERSION as u64),
            ("FLAG_PVM", FLAG_PVM as u64),
            ("FLAG_SELFCHECK", FLAG_SELFCHECK as u64),
            ("FLAG_RESUME", FLAG_RESUME as u64),
            ("FLAG_TEMPLATE", FLAG_TEMPLATE as u64),
            ("FLAG_CLONE", FLAG_CLONE as u64),
            ("DOORBELL_PORT", DOORBELL_PORT as u64),
            ("PANIC_PORT", PANIC_PORT as u64),
            ("IRQ_VECTOR", IRQ_VECTOR as u64),
            ("MAX_SLOTS", MAX_SLOTS as u64),
            ("RX_WINDOW", RX_WINDOW as u64),
            ("TX_WINDOW", TX_WINDOW as u64),
            ("STACK_BYTES", STACK_BYTES),
            ("SMALL_BYTES", SMALL_BYTES as u64),
            ("LARGE_BYTES", LARGE_BYTES as u64),
            ("PATTERN_PERIOD", PATTERN_PERIOD as u64),
            ("REC_DATA", REC_DATA as u64),
            ("REC_OPEN", REC_OPEN as u64),
            ("REC_FIN", REC_FIN as u64),
            ("REC_CLOSE", REC_CLOSE as u64),
            ("REC_PAD", REC_PAD as u64),
            ("STATE_BOOTING", STATE_BOOTING as u64),
            ("STATE_READY", STATE_READY as u64),
            ("STATE_PANICKED", STATE_PANICKED as u64),
            ("CMD_CRASH", CMD_CRASH as u64),
            ("CMD_TRIPLE", CMD_TRIPLE as u64),
            ("CMD_PARK", CMD_PARK as u64),
            ("STATE_PARKED", STATE_PARKED as u64),
        ];
        for (name, value) in ours {
            assert_eq!(
                defines.get(*name),
                Some(value),
                "DV_{name} differs between abi.h and abi.rs"
            );
        }
    }

    #[test]
    fn struct_sizes_match_the_c_layout() {
        assert_eq!(std::mem::size_of::<BootInfo>(), 64);
        assert_eq!(std::mem::size_of::<Ctrl>(), 80);
    }
}
