/* x86-64 platform of the guest: descriptor tables, APIC, interrupts, ports. */
#ifndef WEBGUEST_ARCH_H
#define WEBGUEST_ARCH_H
#include <stdint.h>
#include "abi.h"

/* Set by the doorbell interrupt; cleared by the idle loop before it checks. */
extern volatile uint32_t irq_seen;

void arch_init(const struct dv_boot_info *bi);
void idle_wait(void);
void arch_doorbell(void);
void arch_crash(uint32_t how) __attribute__((noreturn));

static inline void arch_mb(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline struct dv_ctrl *ctrl_page(void) { return (struct dv_ctrl *)DV_CTRL_GPA; }
static inline struct dv_ring_hdr *ring_hdr(void) { return (struct dv_ring_hdr *)DV_RINGHDR_GPA; }
static inline struct dv_credit *credits(void) { return (struct dv_credit *)DV_CREDIT_GPA; }
#endif
