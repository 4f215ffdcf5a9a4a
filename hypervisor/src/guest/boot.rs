//! What a VM finds at boot: identity page tables, a GDT with a TSS, the
//! boot-info page, and the layout of its RAM.

use crate::guest::abi::{self, BootInfo};
use crate::guest::memory::Mapping;
use paging_policy::config::blocks_touched;

const PAGE: u64 = 4096;
const PTE_PRESENT: u64 = 1 << 0;
const PTE_WRITABLE: u64 = 1 << 1;
/// Set on every level: PVM refaults forever on supervisor-only entries.
const PTE_USER: u64 = 1 << 2;
/// Accessed and dirty preset, so the walker never writes the tables.
const PTE_ACCESSED: u64 = 1 << 5;
const PTE_DIRTY: u64 = 1 << 6;
const PTE_HUGE: u64 = 1 << 7;
const TABLE: u64 = PTE_PRESENT | PTE_WRITABLE | PTE_USER | PTE_ACCESSED;
const HUGE_PAGE: u64 = 2 << 20;

/// Where things are in a VM's RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RamLayout {
    /// Size of RAM.
    pub ram_bytes: u64,
    /// RAM offset of the working set (just past the guest's bss).
    pub ws_offset: u64,
    /// Size of the working set.
    pub ws_bytes: u64,
    /// RAM offset of the connection buffers (end of per-request bss).
    pub rx_buffers: u64,
}

impl RamLayout {
    /// Lays out RAM: bss, then the working set, stack at the top. Returns
    /// `None` when they do not fit.
    pub fn new(ram_bytes: u64, bss_end: u64, rx_buffers: u64, ws_bytes: u64) -> Option<Self> {
        let ws_offset = bss_end.next_multiple_of(PAGE);
        (ws_offset + ws_bytes + abi::STACK_BYTES <= ram_bytes).then_some(RamLayout {
            ram_bytes,
            ws_offset,
            ws_bytes,
            rx_buffers,
        })
    }

    /// RAM offset of the stack's top word: what a vCPU started at the
    /// guest's entry (at boot, or woken from hibernation) writes first.
    pub fn resume_stack_offset(&self) -> u64 {
        self.ram_bytes - 8
    }

    /// The smallest RAM that holds the layout.
    pub fn min_ram_bytes(bss_end: u64, ws_bytes: u64) -> u64 {
        bss_end.next_multiple_of(PAGE) + ws_bytes + abi::STACK_BYTES
    }

    /// RAM ranges (offset, length) a request on the first connection slot
    /// touches: per-request bss, the slot's buffer, the working set, the stack.
    pub fn request_ranges(&self) -> Vec<(u64, u64)> {
        vec![
            (0, self.rx_buffers),
            (self.rx_buffers, abi::RX_WINDOW as u64),
            (self.ws_offset, self.ws_bytes),
            (self.ram_bytes - abi::STACK_BYTES, abi::STACK_BYTES),
        ]
    }

    /// Bytes a request touches.
    pub fn request_footprint(&self) -> u64 {
        self.request_ranges().iter().map(|(_, len)| len).sum()
    }

    /// Bytes of the `block_bytes` blocks a request touches: what a VM that
    /// has served requests holds resident under the pager.
    pub fn request_blocks_bytes(&self, block_bytes: u64) -> u64 {
        blocks_touched(&self.request_ranges(), block_bytes).len() as u64 * block_bytes
    }
}

/// Writes page tables, GDT, TSS and boot info into a VM's system pages.
pub fn write_system_pages(sys: &Mapping, info: &BootInfo) {
    let ram_end = info.ram_gpa + info.ram_bytes;
    sys.write_obj(abi::PML4_GPA, abi::PDPT_GPA | TABLE);
    sys.write_obj(abi::PDPT_GPA, abi::PD_GPA | TABLE);
    for (i, base) in (0..ram_end).step_by(HUGE_PAGE as usize).enumerate() {
        sys.write_obj(
            abi::PD_GPA + 8 * i as u64,
            base | TABLE | PTE_DIRTY | PTE_HUGE,
        );
    }
    let gdt: [u64; 5] = [
        0,
        0x00af_9b00_0000_ffff, // 0x08: 64-bit code, DPL 0, accessed
        0x00cf_9300_0000_ffff, // 0x10: data, DPL 0, accessed
        tss_descriptor_low(abi::TSS_GPA, 0x67),
        abi::TSS_GPA >> 32,
    ];
    for (i, entry) in gdt.iter().enumerate() {
        sys.write_obj(abi::GDT_GPA + 8 * i as u64, *entry);
    }
    sys.write_obj(abi::BOOTINFO_GPA, *info);
}

/// Size of the GDT written by [`write_system_pages`], minus one.
pub const GDT_LIMIT: u16 = 5 * 8 - 1;
/// Selector of the TSS.
pub const TSS_SELECTOR: u16 = 0x18;

fn tss_descriptor_low(base: u64, limit: u64) -> u64 {
    let access = 0x8b; // present, busy 64-bit TSS
    (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | (access << 40)
        | (((limit >> 16) & 0xf) << 48)
        | (((base >> 24) & 0xff) << 56)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_puts_the_working_set_after_bss_and_leaves_the_stack() {
        let layout = RamLayout::new(4 << 20, 0x86e08, 0x7000, 896 << 10).unwrap();
        assert_eq!(layout.ws_offset, 0x87000);
        assert!(layout.ws_offset + layout.ws_bytes <= layout.ram_bytes - abi::STACK_BYTES);
        assert!(RamLayout::new(1 << 20, 0x86e08, 0x7000, 896 << 10).is_none());
        assert_eq!(
            layout.request_footprint(),
            0x7000 + 8192 + (896 << 10) + abi::STACK_BYTES
        );
        assert_eq!(
            RamLayout::min_ram_bytes(0x86e08, 896 << 10),
            0x87000 + (896 << 10) + abi::STACK_BYTES
        );
    }

    #[test]
    fn request_blocks_count_each_block_a_request_overlaps_once() {
        let layout = RamLayout::new(4 << 20, 0x86e08, 0x7000, 896 << 10).unwrap();
        // 4k blocks: exactly the pages touched.
        assert_eq!(
            layout.request_blocks_bytes(4096),
            layout.request_footprint()
        );
        // 256k blocks: bss and receive window share block 0, the working set
        // spans blocks 2-5, the stack is in the last block.
        assert_eq!(layout.request_blocks_bytes(256 << 10), 6 * (256 << 10));
        // One block holds everything.
        assert_eq!(layout.request_blocks_bytes(4 << 20), 4 << 20);
    }

    #[test]
    fn page_tables_identity_map_ram_with_user_bits() {
        let sys = Mapping::anonymous(abi::SYS_BYTES as usize, false).unwrap();
        let info = BootInfo {
            ram_gpa: abi::RAM_GPA,
            ram_bytes: 4 << 20,
            ..Default::default()
        };
        write_system_pages(&sys, &info);
        let pd = |i: u64| sys.read_volatile::<u64>(abi::PD_GPA + 8 * i);
        assert_eq!(pd(0) & !0xfff, 0);
        assert_eq!(pd(3) & !0xfff, 3 * HUGE_PAGE);
        assert_eq!(pd(4), 0, "nothing mapped past RAM");
        for entry in [
            sys.read_volatile::<u64>(abi::PML4_GPA),
            sys.read_volatile::<u64>(abi::PDPT_GPA),
            pd(2),
        ] {
            assert_eq!(entry & PTE_USER, PTE_USER);
            assert_eq!(entry & PTE_PRESENT, PTE_PRESENT);
        }
    }

    #[test]
    fn tss_descriptor_encodes_base_and_limit() {
        let low = tss_descriptor_low(0x3800, 0x67);
        assert_eq!(low & 0xffff, 0x67);
        assert_eq!((low >> 16) & 0xff_ffff, 0x3800);
        assert_eq!((low >> 40) & 0xff, 0x8b);
    }
}
