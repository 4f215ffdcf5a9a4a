/*
 * The web server: connection slots fed by the rx ring, responses written to
 * the tx ring under per-connection credit, and the idle loop.
 *
 * Flow control (see abi.h): the host never sends a slot more request bytes
 * than fit in its DV_RX_WINDOW buffer, and the guest never has more than
 * DV_TX_WINDOW response bytes of a slot unacknowledged. Both rings are
 * therefore always drained, and a slow client stalls only its own slot.
 */
#include "server.h"
#include "arch.h"
#include "http.h"
#include "lib.h"
#include "object.h"
#include "workingset.h"

#define RECORD_HEADER 8u
#define MIN_CHUNK 1024u
/* An empty tx ring starts again at its first byte once past this. */
#define TX_RESTART (16u << 10)

struct response {
    char header[256];
    uint32_t header_len, header_sent;
    uint32_t body_len, body_sent;
    const char *text_body; /* error text; NULL: the object pattern */
    uint8_t active;
    uint8_t close_after;
};

struct conn {
    uint8_t open;
    uint8_t fin;      /* the host will send no more bytes */
    uint8_t closing;  /* release the slot once the response is out */
    uint32_t rx_len;  /* bytes in the buffer */
    uint32_t scan;    /* http_parse resume point */
    uint32_t request_len;
    uint32_t tx_produced;
    struct response resp;
};

static struct conn conns[DV_MAX_SLOTS];
/* Last in bss (link.ld): a request touches only its own slot's buffer. */
uint8_t rx_buffers[DV_MAX_SLOTS][DV_RX_WINDOW] __attribute__((aligned(4096), section(".bss.rx")));

static uint32_t round8(uint32_t n) { return (n + 7u) & ~7u; }
static uint32_t load_acquire(volatile uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void store_release(volatile uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* ---- tx ring (guest produces) ---- */

static uint32_t tx_free_bytes(void)
{
    struct dv_ring_hdr *r = ring_hdr();
    return DV_TX_RING_BYTES - (r->tx_prod - load_acquire(&r->tx_cons));
}

/* Reserves a record for up to want payload bytes: on success sets the
 * payload address and the length granted (at least 1 when want > 0) and
 * returns 1; returns 0 when there is no room now. Pads to the ring's end when
 * the contiguous tail is too short to be worth a record, and when the ring
 * is empty and past TX_RESTART: it then starts again at its first byte, so a
 * VM that answers now and then reuses its first few pages instead of
 * touching its whole ring (every page touched for the first time is a host
 * fault and stays host memory). */
static int tx_reserve(uint32_t want, uint8_t **payload, uint32_t *granted)
{
    struct dv_ring_hdr *r = ring_hdr();
    uint8_t *ring = (uint8_t *)DV_TX_RING_GPA;
    for (int attempt = 0; attempt < 2; attempt++) {
        uint32_t free = tx_free_bytes();
        uint32_t pos = r->tx_prod % DV_TX_RING_BYTES;
        uint32_t contig = DV_TX_RING_BYTES - pos;
        uint32_t needed = RECORD_HEADER + (want < MIN_CHUNK ? round8(want) : MIN_CHUNK);
        /* Until the host consumes the pad only the bytes before pos are
         * free: restart only where the whole record and the next few fit
         * there (a pad alone is no news to the host, so nothing would wake
         * this guest to retry, and a split response leaves as two segments). */
        uint32_t whole = RECORD_HEADER + round8(want);
        if (free < DV_TX_RING_BYTES || pos < (whole > TX_RESTART ? whole : TX_RESTART)) {
            uint32_t room = free < contig ? free : contig;
            if (room >= needed) {
                uint32_t len = room - RECORD_HEADER;
                *granted = len > want ? want : len;
                *payload = ring + pos + RECORD_HEADER;
                return 1;
            }
            if (contig >= free)
                return 0; /* the consumer has to make room first */
        }
        struct dv_rec *pad = (struct dv_rec *)(ring + pos);
        *pad = (struct dv_rec){.type = DV_REC_PAD, .len = contig - RECORD_HEADER};
        store_release(&r->tx_prod, r->tx_prod + contig);
    }
    return 0;
}

static void tx_commit(uint16_t slot, uint8_t type, uint32_t len)
{
    struct dv_ring_hdr *r = ring_hdr();
    struct dv_rec *rec = (struct dv_rec *)((uint8_t *)DV_TX_RING_GPA + r->tx_prod % DV_TX_RING_BYTES);
    *rec = (struct dv_rec){.slot = slot, .type = type, .len = len};
    store_release(&r->tx_prod, r->tx_prod + RECORD_HEADER + round8(len));
}

/* Response bytes slot may send now: its credit, bounded by the ring. */
static uint32_t tx_credit(uint16_t slot)
{
    uint32_t unacked = conns[slot].tx_produced - load_acquire(&credits()[slot].tx_acked);
    return unacked >= DV_TX_WINDOW ? 0 : DV_TX_WINDOW - unacked;
}

/* ---- connections ---- */

static void consume_request_bytes(uint16_t slot, uint32_t n)
{
    struct conn *c = &conns[slot];
    memmove(rx_buffers[slot], rx_buffers[slot] + n, c->rx_len - n);
    c->rx_len -= n;
    c->scan = 0;
    store_release(&credits()[slot].rx_consumed, credits()[slot].rx_consumed + n);
}

static void start_response(uint16_t slot, uint32_t status, const struct http_request *req,
                           int keep_alive)
{
    struct response *resp = &conns[slot].resp;
    uint32_t length;
    int text = status != 200;
    if (text) {
        resp->text_body = http_status_body(status);
        length = 0;
        while (resp->text_body[length])
            length++;
    } else {
        resp->text_body = 0;
        length = req->target == TARGET_LARGE ? DV_LARGE_BYTES : DV_SMALL_BYTES;
    }
    resp->header_len = http_response_header(resp->header, status, length, text, keep_alive);
    resp->header_sent = 0;
    resp->body_len = (req && req->head) ? 0 : length;
    resp->body_sent = 0;
    resp->close_after = (uint8_t)!keep_alive;
    resp->active = 1;

    struct dv_ctrl *ctrl = ctrl_page();
    ctrl->requests++;
    if (status >= 400)
        ctrl->responses_4xx++;
}

/* Emits as much of the current response as credit and ring allow; returns
 * whether anything was written. */
static int emit_response(uint16_t slot)
{
    struct conn *c = &conns[slot];
    struct response *resp = &c->resp;
    int wrote = 0;
    while (resp->header_sent < resp->header_len || resp->body_sent < resp->body_len) {
        uint32_t credit = tx_credit(slot);
        uint32_t header_left = resp->header_len - resp->header_sent;
        uint32_t want = header_left + (resp->body_len - resp->body_sent);
        if (want > credit)
            want = credit;
        if (want == 0)
            break;
        uint8_t *dst;
        uint32_t len;
        if (!tx_reserve(want, &dst, &len))
            break;
        uint32_t from_header = len < header_left ? len : header_left;
        memcpy(dst, resp->header + resp->header_sent, from_header);
        resp->header_sent += from_header;
        uint32_t from_body = len - from_header;
        if (from_body) {
            if (resp->text_body)
                memcpy(dst + from_header, resp->text_body + resp->body_sent, from_body);
            else
                object_copy(dst + from_header, resp->body_sent, from_body);
            resp->body_sent += from_body;
        }
        tx_commit(slot, DV_REC_DATA, len);
        c->tx_produced += len;
        ctrl_page()->tx_bytes += len;
        wrote = 1;
    }
    if (resp->header_sent == resp->header_len && resp->body_sent == resp->body_len) {
        resp->active = 0;
        consume_request_bytes(slot, c->request_len);
        if (resp->close_after)
            c->closing = 1;
    }
    return wrote;
}

static int release_slot(uint16_t slot)
{
    uint8_t *unused;
    uint32_t granted;
    if (!tx_reserve(0, &unused, &granted))
        return 0;
    tx_commit(slot, DV_REC_CLOSE, 0);
    struct conn *c = &conns[slot];
    /* Discarded request bytes still count as consumed: the host's and the
     * guest's counters must agree when the slot is opened again. */
    store_release(&credits()[slot].rx_consumed, credits()[slot].rx_consumed + c->rx_len);
    c->rx_len = 0;
    c->open = 0;
    return 1;
}

/* Answers whatever the slot's buffer holds, as far as credit allows. */
static int serve(const struct dv_boot_info *bi, uint16_t slot)
{
    struct conn *c = &conns[slot];
    int progress = 0;
    for (;;) {
        if (c->resp.active) {
            progress |= emit_response(slot);
            if (c->resp.active)
                return progress;
            progress = 1;
        }
        if (c->closing) {
            if (release_slot(slot))
                progress = 1;
            return progress;
        }
        struct http_request req = {0};
        enum http_parse_result r = http_parse(rx_buffers[slot], c->rx_len, DV_RX_WINDOW, &c->scan, &req);
        if (r == HTTP_INCOMPLETE) {
            if (!c->fin)
                return progress;
            c->closing = 1; /* EOF, possibly mid-request: nothing more to answer */
            continue;
        }
        ws_touch(bi);
        if (r == HTTP_MALFORMED) {
            c->request_len = c->rx_len;
            start_response(slot, 400, 0, 0);
        } else if (!req.implemented) {
            c->request_len = req.length;
            start_response(slot, 501, &req, 0);
        } else {
            c->request_len = req.length;
            start_response(slot, req.target == TARGET_NOT_FOUND ? 404 : 200, &req, req.keep_alive);
        }
    }
}

/* ---- rx ring (host produces) ---- */

static void receive(uint16_t slot, uint8_t type, const uint8_t *data, uint32_t len)
{
    if (slot >= DV_MAX_SLOTS)
        return;
    struct conn *c = &conns[slot];
    switch (type) {
    case DV_REC_OPEN:
        *c = (struct conn){.open = 1, .tx_produced = c->tx_produced};
        break;
    case DV_REC_DATA:
        if (!c->open || c->closing || len > DV_RX_WINDOW - c->rx_len) {
            /* stale bytes of a released slot: account them, drop them */
            store_release(&credits()[slot].rx_consumed, credits()[slot].rx_consumed + len);
            break;
        }
        memcpy(rx_buffers[slot] + c->rx_len, data, len);
        c->rx_len += len;
        break;
    case DV_REC_FIN:
        if (c->open)
            c->fin = 1;
        break;
    }
}

static int drain_rx(void)
{
    struct dv_ring_hdr *r = ring_hdr();
    uint8_t *ring = (uint8_t *)DV_RX_RING_GPA;
    uint32_t cons = r->rx_cons;
    uint32_t prod = load_acquire(&r->rx_prod);
    if (cons == prod)
        return 0;
    while (cons != prod) {
        uint32_t pos = cons % DV_RX_RING_BYTES;
        const struct dv_rec *rec = (const struct dv_rec *)(ring + pos);
        if (rec->type == DV_REC_PAD) {
            cons += DV_RX_RING_BYTES - pos;
            continue;
        }
        receive(rec->slot, rec->type, (const uint8_t *)(rec + 1), rec->len);
        cons += RECORD_HEADER + round8(rec->len);
    }
    store_release(&r->rx_cons, cons);
    return 1;
}

/* Does the slot have response bytes or its CLOSE record still to send? */
static int has_output(const struct conn *c)
{
    return c->open && (c->resp.active || c->closing);
}

/* Could a pass over the slots do anything now? Checked after announcing
 * idleness, so a host update made meanwhile is never missed. */
static int has_work(void)
{
    struct dv_ring_hdr *r = ring_hdr();
    if (load_acquire(&r->rx_prod) != r->rx_cons || ctrl_page()->host_cmd)
        return 1;
    for (uint16_t s = 0; s < DV_MAX_SLOTS; s++)
        if (has_output(&conns[s]) && tx_credit(s) > 0 && tx_free_bytes() >= MIN_CHUNK)
            return 1;
    return 0;
}

/* Has a slot output still to send? When idle, credit or ring room holds it
 * back; announced then, since only then does the host interrupt the guest
 * for tx progress. */
static int output_held_back(void)
{
    for (uint16_t s = 0; s < DV_MAX_SLOTS; s++)
        if (has_output(&conns[s]))
            return 1;
    return 0;
}

static void idle(void)
{
    struct dv_ring_hdr *r = ring_hdr();
    irq_seen = 0;
    r->tx_waiting = output_held_back();
    r->idle_gen++;
    r->guest_idle = 1;
    arch_mb();
    if (!has_work()) {
        ctrl_page()->wakeups++;
        idle_wait();
    }
    r->guest_idle = 0;
}

/* Hibernation: parks at the top of the loop, where nothing is half done, so
 * a guest resumed from its entry on a new vCPU finds its memory consistent.
 * It then halts until its vCPU is stopped: irq_seen is cleared before each
 * halt, or the interrupt that asked it to park (or any later one) would
 * make every idle_wait return at once, and a parked guest would spin until
 * its holder got to it, which on a busy host fed on itself. */
static void park(void) __attribute__((noreturn));
static void park(void)
{
    struct dv_ctrl *ctrl = ctrl_page();
    ctrl->host_cmd = DV_CMD_NONE;
    ctrl->state = DV_STATE_PARKED;
    arch_doorbell();
    for (;;) {
        irq_seen = 0;
        idle_wait();
    }
}

void server_run(const struct dv_boot_info *bi)
{
    struct dv_ctrl *ctrl = ctrl_page();
    for (;;) {
        if (ctrl->host_cmd == DV_CMD_PARK)
            park();
        if (ctrl->host_cmd)
            arch_crash(ctrl->host_cmd);
        int progress = drain_rx();
        for (uint16_t s = 0; s < DV_MAX_SLOTS; s++)
            if (conns[s].open)
                progress |= serve(bi, s);
        if (progress)
            arch_doorbell();
        else
            idle();
    }
}
