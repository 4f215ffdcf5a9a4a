/* The hostile guest: webguest, except that one VM chosen at boot misbehaves. */
#ifndef WEBGUEST_HOSTILE_H
#define WEBGUEST_HOSTILE_H
#include "abi.h"

/* densevm --guest-arg: bits 0-31 the misbehaving VM's id, bits 32-39 what
 * it does (0: every VM is a plain webguest), bits 40-55 how many VMs from
 * that id on do it (0 means one). HOSTILE_ALL instead makes VM i
 * behave as behaviour i + 1 for every behaviour up to HOSTILE_LAST, all at
 * once, and every later VM a plain webguest. */
enum hostile_behaviour {
    HOSTILE_NONE = 0,
    HOSTILE_RING_FLOOD = 1,      /* publish empty tx records as fast as the host retires them */
    HOSTILE_WINDOW = 2,          /* send response bytes on every slot, ignoring tx_acked */
    HOSTILE_COUNTER = 3,         /* claim 2^64-1 served requests, then serve normally */
    HOSTILE_NEVER_CLOSE = 4,     /* never release a slot, even after the client's FIN */
    HOSTILE_NEVER_BOOT = 5,      /* spin without ever saying ready */
    HOSTILE_DIRTY_SYSTEM = 6,    /* write the system pages the ABI does not use */
    HOSTILE_FAULT_STORM = 7,     /* write every page of RAM, over and over */
    HOSTILE_SPIN = 8,            /* say ready, then spin without serving */
    HOSTILE_LYING_COUNTER = 9,   /* spin without serving while counting requests it never served */
    HOSTILE_OUTPUT_AFTER_CLOSE = 10, /* answer every connection with a full window, then release the slot at once */
    HOSTILE_WRITE_IMAGE = 11,    /* overwrite the shared image's rodata (the objects' bytes), then serve */
    HOSTILE_LAST = HOSTILE_WRITE_IMAGE,
    HOSTILE_ALL = 0xff,
};

/* Runs the behaviour the boot info selects for this VM, if any; returns
 * when this VM is to behave (or is, after HOSTILE_COUNTER). */
void hostile_start(const struct dv_boot_info *bi);
#endif
