/*
 * The densevm <-> webguest ABI: guest-physical layout, the boot-info page,
 * the control page and the shared-memory rings.
 *
 * hypervisor/src/guest/abi.rs mirrors every DV_ constant; a unit test there reads
 * this file and fails if the two disagree.
 *
 * Guest-physical map (identity-mapped by the monitor's page tables):
 *   [DV_SYS_GPA,   +DV_SYS_BYTES)   system pages: private to the VM, written by
 *                                   the monitor, never paged (boot info, VIF,
 *                                   GDT/TSS, control page, page tables, rings)
 *   [DV_IMAGE_GPA, +DV_IMAGE_BYTES) the guest image's text and rodata: one
 *                                   read-only copy shared by every VM
 *   [DV_RAM_GPA,   +ram_bytes)      RAM: bss, connection buffers, the working
 *                                   set and the stack; starts zeroed, paged
 */
#ifndef WEBGUEST_ABI_H
#define WEBGUEST_ABI_H

#define DV_SYS_GPA          0x0
#define DV_SYS_BYTES        0x100000
#define DV_BOOTINFO_GPA     0x1000
#define DV_VIF_GPA          0x2000
#define DV_GDT_GPA          0x3000
#define DV_TSS_GPA          0x3800
#define DV_CTRL_GPA         0x4000
#define DV_PML4_GPA         0x5000
#define DV_PDPT_GPA         0x6000
#define DV_PD_GPA           0x7000
#define DV_RINGHDR_GPA      0x8000
#define DV_CREDIT_GPA       0x9000
#define DV_RX_RING_GPA      0x10000
#define DV_RX_RING_BYTES    0x10000
#define DV_TX_RING_GPA      0x40000
#define DV_TX_RING_BYTES    0x40000
#define DV_IMAGE_GPA        0x200000
#define DV_IMAGE_BYTES      0x200000
#define DV_RAM_GPA          0x400000

#define DV_BOOT_MAGIC       0x314d5645534e4544ULL /* "DENSEVM1" */
#define DV_BOOT_VERSION     1
#define DV_FLAG_PVM         0x1 /* host is PVM: interrupt flag lives in the VIF page */
#define DV_FLAG_SELFCHECK   0x2 /* stamp and verify every working-set page */
#define DV_FLAG_RESUME      0x4 /* woken from hibernation: RAM and rings kept, vCPU new */
#define DV_FLAG_TEMPLATE    0x8 /* the image's template: give memory its content at boot, before ready */
#define DV_FLAG_CLONE       0x10 /* with RESUME: a clone's first start, on a copy of the template's RAM */

#define DV_DOORBELL_PORT    0x510 /* ioeventfd: guest -> host, stays in the kernel */
#define DV_PANIC_PORT       0x511 /* exits to the monitor: the guest is dead */
#define DV_IRQ_VECTOR       0x40  /* host -> guest, injected through an irqfd */
#define DV_SPURIOUS_VECTOR  0xff

#define DV_MAX_SLOTS        64     /* connections per VM */
#define DV_RX_WINDOW        8192   /* per-connection request buffer in the guest */
#define DV_TX_WINDOW        262144 /* per-connection unsent bytes the host accepts */
#define DV_STACK_BYTES      0x8000 /* top of RAM */

#define DV_SMALL_BYTES      2258
#define DV_LARGE_BYTES      134007
#define DV_PATTERN_PERIOD   4096

/* Record types. A record is an 8-byte header, then len bytes, padded to 8. */
#define DV_REC_DATA         1 /* both directions: connection bytes */
#define DV_REC_OPEN         2 /* host -> guest: a new connection on slot */
#define DV_REC_FIN          3 /* host -> guest: the client sent EOF or failed */
#define DV_REC_CLOSE        4 /* guest -> host: slot released; close after flushing */
#define DV_REC_PAD          0xff /* skip to the end of the ring (a producer also pads to restart an empty ring at its front) */

/* Guest states in the control page. */
#define DV_STATE_BOOTING    0
#define DV_STATE_READY      1
#define DV_STATE_PANICKED   2
#define DV_STATE_PARKED     3 /* halted at a safe point, for hibernation */

/* Host commands in the control page (for fault-containment tests). */
#define DV_CMD_NONE         0
#define DV_CMD_CRASH        1 /* execute an invalid instruction */
#define DV_CMD_TRIPLE       2 /* load an empty IDT, then fault: triple fault */
#define DV_CMD_PARK         3 /* park for hibernation; resumed from entry (DV_FLAG_RESUME) */

#ifndef __ASSEMBLER__
#include <stdint.h>

struct dv_boot_info {
    uint64_t magic;
    uint32_t version;
    uint32_t vm_id;
    uint32_t flags;
    uint32_t ws_write_stride; /* write one word in every Nth working-set page */
    uint64_t ram_gpa;
    uint64_t ram_bytes;
    uint64_t ws_gpa;          /* working set touched by every request */
    uint64_t ws_bytes;
    uint64_t guest_arg;       /* densevm --guest-arg: opaque to the monitor */
};

/* Guest-written counters and state; host-written command. */
struct dv_ctrl {
    volatile uint32_t state;
    volatile uint32_t host_cmd;
    volatile uint64_t requests;
    volatile uint64_t responses_4xx;
    volatile uint64_t tx_bytes;
    volatile uint64_t wakeups;
    volatile uint64_t selfcheck_pages;
    volatile uint64_t selfcheck_errors;
    volatile uint64_t panic_vector;
    volatile uint64_t panic_rip;
    volatile uint64_t panic_error_code;
};

/* Ring indices are free-running byte counters; position = counter % size.
 * Each field sits in its own cache line: one writer per line. */
struct dv_ring_hdr {
    volatile uint32_t rx_prod;   uint32_t pad0[15]; /* host */
    volatile uint32_t rx_cons;   uint32_t pad1[15]; /* guest */
    volatile uint32_t tx_prod;   uint32_t pad2[15]; /* guest */
    volatile uint32_t tx_cons;   uint32_t pad3[15]; /* host */
    volatile uint32_t guest_idle;                   /* guest: 1 while it may halt */
    volatile uint32_t idle_gen;                     /* guest: bumped per idle period */
    volatile uint32_t tx_waiting; uint32_t pad4[13]; /* guest: idle with output held back */
};

/* Per-slot flow-control counters, free-running across the slot's lives. */
struct dv_credit {
    volatile uint32_t rx_consumed; /* guest: request bytes taken out of its buffer */
    volatile uint32_t tx_acked;    /* host: response bytes passed on to the socket */
};

struct dv_rec {
    uint16_t slot;
    uint8_t type;
    uint8_t reserved;
    uint32_t len;
};
#endif

#endif
