#include "workingset.h"
#include "arch.h"

#define PAGE 4096
#define STAMP_MAGIC 0x4b43454846534c57ULL /* "WLSFHECK" */

struct stamp {
    uint64_t magic, vm_id, page, generation;
};

/* Generation of the stamps now in memory, and the VM whose they are (the
 * template's in a clone until it adopts them); they live in RAM like
 * everything the pager could lose, so a lost page of bss shows up as
 * mismatches too. */
static uint64_t stamped_generation;
static uint64_t stamped_vm;

static int stamp_matches(const volatile struct stamp *s, uint64_t vm, uint64_t page, uint64_t gen)
{
    if (gen == 0)
        return s->magic == 0 && s->vm_id == 0 && s->page == 0 && s->generation == 0;
    return s->magic == STAMP_MAGIC && s->vm_id == vm && s->page == page && s->generation == gen;
}

static void stamp_write(volatile struct stamp *s, uint64_t vm, uint64_t page, uint64_t gen)
{
    s->magic = STAMP_MAGIC;
    s->vm_id = vm;
    s->page = page;
    s->generation = gen;
}

/* Verify the stamps in memory at both ends of every page, then write VM
 * vm's of generation gen in their place. */
static void restamp(const struct dv_boot_info *bi, uint64_t vm, uint64_t gen)
{
    struct dv_ctrl *ctrl = ctrl_page();
    uint8_t *ws = (uint8_t *)bi->ws_gpa;
    uint64_t pages = bi->ws_bytes / PAGE;
    uint64_t errors = 0;
    for (uint64_t p = 0; p < pages; p++) {
        volatile struct stamp *head = (volatile struct stamp *)(ws + p * PAGE);
        volatile struct stamp *tail = (volatile struct stamp *)(ws + (p + 1) * PAGE - sizeof(struct stamp));
        if (!stamp_matches(head, stamped_vm, p, stamped_generation) ||
            !stamp_matches(tail, stamped_vm, p, stamped_generation))
            errors++;
        stamp_write(head, vm, p, gen);
        stamp_write(tail, vm, p, gen);
    }
    stamped_vm = vm;
    stamped_generation = gen;
    ctrl->selfcheck_pages += pages;
    ctrl->selfcheck_errors += errors;
}

/* Every request verifies the previous generation and writes the next: every
 * page is dirtied by every request. A VM checks its own stamps only. */
static void selfcheck(const struct dv_boot_info *bi)
{
    if (stamped_generation != 0 && stamped_vm != bi->vm_id)
        ctrl_page()->selfcheck_errors++;
    stamped_vm = bi->vm_id;
    restamp(bi, bi->vm_id, stamped_generation + 1);
}

/* The first word of working-set page p: the VM's own. */
static uint64_t own_word(const struct dv_boot_info *bi, uint64_t p)
{
    return ((uint64_t)bi->vm_id << 32) | p | 1;
}

/* Whether the working set holds its content yet (in RAM, like the content). */
static uint64_t ws_loaded;

/* Printable text, like a server's strings and markup: a text line is 64
 * bytes of it from an offset, copied a word at a time (a division per byte
 * cost the boot milliseconds of guest CPU). */
static const char text[128] =
    "GET /index.html HTTP/1.1\r\nHost: www.example.com\r\nContent-Type: text/html; "
    "charset=utf-8\r\n<div class=\"item\"><a href=\"/p/";

static void text_line(uint64_t *line, uint64_t seed)
{
    const uint8_t *from = (const uint8_t *)text + (seed % 8) * 8;
    for (uint64_t k = 0; k < 8; k++) {
        uint64_t w;
        __builtin_memcpy(&w, from + k * 8, 8);
        line[k] = w;
    }
}

/* Give every page content once, as loading an OS and a server would: a page
 * that was never written is zeros the pager brings back without reading swap,
 * which would make the read-only part of the footprint free to page in. The
 * content is as compressible as a server's memory (LZ4 about 2.5x; the pager
 * reports the ratio it measures as template_lz4_ratio): per 64-byte line,
 * chosen by a hash of its place, about 35% noise (pointers, hashes, data),
 * 30% zeros and 35% text. It depends on the page, not the VM, as the same
 * image loads the same bytes in every VM; the first word of each page is the
 * VM's own. */
static void ws_load(const struct dv_boot_info *bi, uint8_t *ws, uint64_t pages)
{
    for (uint64_t p = 0; p < pages; p++) {
        uint8_t *page = ws + p * PAGE;
        for (uint64_t l = 0; l < PAGE / 64; l++) {
            uint64_t x = (p * (PAGE / 64) + l + 1) * 0x9e3779b97f4a7c15ULL;
            x ^= x >> 29;
            uint64_t *words = (uint64_t *)(page + l * 64);
            uint64_t kind = (x >> 40) % 20;
            if (kind < 7) {
                for (uint64_t k = 0; k < 8; k++) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    words[k] = x;
                }
            } else if (kind < 13) {
                for (uint64_t k = 0; k < 8; k++)
                    words[k] = 0;
            } else {
                text_line(words, x >> 8);
            }
        }
        *(volatile uint64_t *)page = own_word(bi, p);
    }
    ws_loaded = 1;
}

void ws_prepare(const struct dv_boot_info *bi)
{
    if (bi->flags & DV_FLAG_SELFCHECK)
        selfcheck(bi);
    else if (!ws_loaded)
        ws_load(bi, (uint8_t *)bi->ws_gpa, bi->ws_bytes / PAGE);
}

void ws_adopt(const struct dv_boot_info *bi)
{
    /* A self-checking clone verifies that it got the template's stamps
     * (memory of zeros is a fresh VM's, not the template's). */
    if (bi->flags & DV_FLAG_SELFCHECK) {
        if (stamped_generation == 0)
            ctrl_page()->selfcheck_errors += bi->ws_bytes / PAGE;
        else
            restamp(bi, bi->vm_id, stamped_generation);
        return;
    }
    if (!ws_loaded)
        return;
    uint8_t *ws = (uint8_t *)bi->ws_gpa;
    for (uint64_t p = 0; p < bi->ws_bytes / PAGE; p++)
        *(volatile uint64_t *)(ws + p * PAGE) = own_word(bi, p);
}

void ws_touch(const struct dv_boot_info *bi)
{
    uint8_t *ws = (uint8_t *)bi->ws_gpa;
    uint64_t pages = bi->ws_bytes / PAGE;
    if (bi->flags & DV_FLAG_SELFCHECK) {
        selfcheck(bi);
        return;
    }
    if (!ws_loaded)
        ws_load(bi, ws, pages);
    uint64_t stride = bi->ws_write_stride ? bi->ws_write_stride : 1;
    uint64_t sum = 0;
    for (uint64_t p = 0; p < pages; p++) {
        volatile uint64_t *word = (volatile uint64_t *)(ws + p * PAGE);
        if (p % stride == 0)
            word[1] += 1;
        else
            sum += word[0];
    }
    __asm__ volatile("" ::"r"(sum));
}
