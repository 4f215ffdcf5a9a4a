/*
 * The hostile guest's misbehaviours, one per hostile_behaviour. Each breaks
 * a rule of abi.h on purpose; the monitor must stop or throttle this VM and
 * nothing else (tests/test_hostile_guests.py).
 */
#include "hostile.h"
#include "arch.h"

#define RECORD_HEADER 8u
#define PAGE 4096u

static void ring_flood(void) __attribute__((noreturn));
static void window_violation(void) __attribute__((noreturn));
static void never_close(void) __attribute__((noreturn));
static void spin(void) __attribute__((noreturn));
static void take_rx(uint8_t *open, int credit);
static void lying_counter(void) __attribute__((noreturn));
static void output_after_close(void) __attribute__((noreturn));
static void dirty_system(void) __attribute__((noreturn));
static void fault_storm(const struct dv_boot_info *bi) __attribute__((noreturn));
static void write_image(void);

/* The image's rodata (link.ld): the objects' pattern, the HTTP strings. */
extern char __rodata_start[], __rodata_end[];

static void publish_tx_record(uint16_t slot, uint8_t type, uint32_t len)
{
    struct dv_ring_hdr *r = ring_hdr();
    uint32_t pos = r->tx_prod % DV_TX_RING_BYTES;
    uint32_t contig = DV_TX_RING_BYTES - pos;
    if (contig < RECORD_HEADER + len) {
        struct dv_rec *pad = (struct dv_rec *)((uint8_t *)DV_TX_RING_GPA + pos);
        *pad = (struct dv_rec){.type = DV_REC_PAD, .len = contig - RECORD_HEADER};
        __atomic_store_n(&r->tx_prod, r->tx_prod + contig, __ATOMIC_RELEASE);
        return;
    }
    struct dv_rec *rec = (struct dv_rec *)((uint8_t *)DV_TX_RING_GPA + pos);
    *rec = (struct dv_rec){.slot = slot, .type = type, .len = len};
    __atomic_store_n(&r->tx_prod, r->tx_prod + RECORD_HEADER + ((len + 7u) & ~7u), __ATOMIC_RELEASE);
}

static void publish_tx(uint16_t slot, uint32_t len)
{
    publish_tx_record(slot, DV_REC_DATA, len);
}

static uint32_t tx_room(void)
{
    struct dv_ring_hdr *r = ring_hdr();
    return DV_TX_RING_BYTES - (r->tx_prod - __atomic_load_n(&r->tx_cons, __ATOMIC_ACQUIRE));
}

/* Empty records, always: the host retires them as fast as they come. */
static void ring_flood(void)
{
    for (;;) {
        for (int i = 0; i < 1024 && tx_room() >= 64; i++)
            publish_tx(0, 0);
        arch_doorbell();
    }
}

/* Takes the host's rx records; marks each slot that opened, and with
 * `credit` hands the host back room for the bytes taken, as a reader would. */
static void take_rx(uint8_t *open, int credit)
{
    struct dv_ring_hdr *r = ring_hdr();
    uint32_t cons = r->rx_cons, prod = __atomic_load_n(&r->rx_prod, __ATOMIC_ACQUIRE);
    while (cons != prod) {
        uint32_t pos = cons % DV_RX_RING_BYTES;
        const struct dv_rec *rec = (const struct dv_rec *)((uint8_t *)DV_RX_RING_GPA + pos);
        if (rec->type == DV_REC_PAD) {
            cons += DV_RX_RING_BYTES - pos;
            continue;
        }
        if (rec->type == DV_REC_OPEN && rec->slot < DV_MAX_SLOTS)
            open[rec->slot] = 1;
        if (credit && rec->type == DV_REC_DATA && rec->slot < DV_MAX_SLOTS)
            __atomic_store_n(&credits()[rec->slot].rx_consumed,
                             credits()[rec->slot].rx_consumed + rec->len, __ATOMIC_RELEASE);
        cons += RECORD_HEADER + ((rec->len + 7u) & ~7u);
    }
    __atomic_store_n(&r->rx_cons, cons, __ATOMIC_RELEASE);
}

static void take_opens(uint8_t *open)
{
    take_rx(open, 0);
}

/* Response bytes on every open slot, whatever the host acknowledged. */
static void window_violation(void)
{
    static uint8_t open[DV_MAX_SLOTS];
    for (;;) {
        take_opens(open);
        for (uint16_t s = 0; s < DV_MAX_SLOTS; s++)
            if (open[s] && tx_room() >= 8192 + RECORD_HEADER)
                publish_tx(s, 8192);
        arch_doorbell();
    }
}

/* Halts until the host has put something in the rx ring. */
static void idle_until_rx(void)
{
    struct dv_ring_hdr *r = ring_hdr();
    irq_seen = 0;
    r->idle_gen++;
    r->guest_idle = 1;
    arch_mb();
    if (__atomic_load_n(&r->rx_prod, __ATOMIC_ACQUIRE) == r->rx_cons)
        idle_wait();
    r->guest_idle = 0;
}

/* Slots open and are never released: FINs are read and ignored. */
static void never_close(void)
{
    static uint8_t open[DV_MAX_SLOTS];
    for (;;) {
        take_opens(open);
        idle_until_rx();
    }
}

static void spin(void)
{
    for (;;)
        __asm__ volatile("pause");
}

/* Burns its CPU while its request counter says it serves a great deal,
 * taking every request sent so that the host keeps sending more. */
static void lying_counter(void)
{
    static uint8_t open[DV_MAX_SLOTS];
    struct dv_ctrl *ctrl = ctrl_page();
    for (;;) {
        take_rx(open, 1);
        arch_doorbell();
        for (int i = 0; i < 4096; i++)
            ctrl->requests++;
    }
}

/* Every connection gets a full window of response bytes and is released
 * at once: what the host holds for a client that never reads is the host's
 * to bound, since the slot is free for the next connection. */
static void output_after_close(void)
{
    static uint8_t open[DV_MAX_SLOTS];
    static uint32_t sent[DV_MAX_SLOTS];
    for (;;) {
        take_opens(open);
        int busy = 0;
        for (uint16_t s = 0; s < DV_MAX_SLOTS; s++) {
            while (open[s] && sent[s] < DV_TX_WINDOW && tx_room() >= 8192 + 2 * RECORD_HEADER) {
                publish_tx(s, 8192);
                sent[s] += 8192;
            }
            if (open[s] && sent[s] >= DV_TX_WINDOW && tx_room() >= 2 * RECORD_HEADER) {
                publish_tx_record(s, DV_REC_CLOSE, 0);
                open[s] = 0;
                sent[s] = 0;
            }
            busy |= open[s];
        }
        arch_doorbell();
        if (busy)
            continue;
        idle_until_rx();
    }
}

static void dirty_system(void)
{
    /* Between the credit page and the rx ring: no part of the ABI. */
    for (uint64_t a = DV_CREDIT_GPA + PAGE; a < DV_RX_RING_GPA; a += PAGE)
        *(volatile uint64_t *)a = a;
    spin();
}

static void fault_storm(const struct dv_boot_info *bi)
{
    uint64_t ws_end = bi->ram_gpa + bi->ram_bytes - DV_STACK_BYTES;
    for (uint64_t round = 1;; round++)
        for (uint64_t a = bi->ws_gpa; a < ws_end; a += PAGE)
            *(volatile uint64_t *)a = round;
}

/* Inverts every byte of the image's rodata. Where KVM maps the image
 * read-only the first write stops this VM; elsewhere the host gives each VM
 * a private copy, so only this VM serves the wrong bytes. */
static void write_image(void)
{
    for (volatile char *p = __rodata_start; p < __rodata_end; p++)
        *p = (char)~*p;
}

void hostile_start(const struct dv_boot_info *bi)
{
    uint32_t chosen = (bi->guest_arg >> 32) & 0xff;
    if (chosen == HOSTILE_ALL) {
        if (bi->vm_id >= HOSTILE_LAST)
            return;
        chosen = bi->vm_id + 1;
    } else {
        uint32_t first = (uint32_t)bi->guest_arg;
        uint32_t count = (bi->guest_arg >> 40) & 0xffff;
        if (bi->vm_id < first || bi->vm_id - first >= (count ? count : 1))
            return;
    }
    struct dv_ctrl *ctrl = ctrl_page();
    switch ((enum hostile_behaviour)chosen) {
    case HOSTILE_NEVER_BOOT:
        spin();
    case HOSTILE_RING_FLOOD:
        ctrl->state = DV_STATE_READY;
        ring_flood();
    case HOSTILE_WINDOW:
        ctrl->state = DV_STATE_READY;
        window_violation();
    case HOSTILE_COUNTER:
        ctrl->requests = ~0ULL;
        return;
    case HOSTILE_NEVER_CLOSE:
        /* Ready like any guest: said with a doorbell, or a host that has
         * already looked at it never notices. */
        ctrl->state = DV_STATE_READY;
        arch_doorbell();
        never_close();
    case HOSTILE_DIRTY_SYSTEM:
        ctrl->state = DV_STATE_READY;
        arch_doorbell();
        dirty_system();
    case HOSTILE_FAULT_STORM:
        ctrl->state = DV_STATE_READY;
        arch_doorbell();
        fault_storm(bi);
    case HOSTILE_SPIN:
        ctrl->state = DV_STATE_READY;
        arch_doorbell();
        spin();
    case HOSTILE_LYING_COUNTER:
        ctrl->state = DV_STATE_READY;
        arch_doorbell();
        lying_counter();
    case HOSTILE_OUTPUT_AFTER_CLOSE:
        ctrl->state = DV_STATE_READY;
        arch_doorbell();
        output_after_close();
    case HOSTILE_WRITE_IMAGE:
        write_image();
        return;
    case HOSTILE_NONE:
    case HOSTILE_ALL:
        return;
    }
}
