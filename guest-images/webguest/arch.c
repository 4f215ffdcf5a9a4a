/* Descriptor tables, x2APIC and the interrupt flag, doorbell and panic ports. */
#include "arch.h"

struct idt_gate {
    uint16_t offset_low;
    uint16_t selector;
    uint8_t ist;
    uint8_t type_attr;
    uint16_t offset_mid;
    uint32_t offset_high;
    uint32_t reserved;
} __attribute__((packed));

struct table_ptr {
    uint16_t limit;
    uint64_t base;
} __attribute__((packed));

#define KERNEL_CS 0x08
#define GATE_INTERRUPT 0x8e
#define MSR_X2APIC_SVR 0x80f

extern const uint64_t exception_stubs[32];
extern char irq_entry[], spurious_entry[];

volatile uint32_t irq_seen;
/* Read by irq_entry: the host is PVM, which completes the EOI as it delivers
 * an interrupt and emulates iretq (see entry.S). */
uint8_t irq_pvm;
static struct idt_gate idt[256] __attribute__((aligned(4096)));

static void set_gate(int vector, uint64_t handler)
{
    idt[vector] = (struct idt_gate){
        .offset_low = (uint16_t)handler,
        .selector = KERNEL_CS,
        .type_attr = GATE_INTERRUPT,
        .offset_mid = (uint16_t)(handler >> 16),
        .offset_high = (uint32_t)(handler >> 32),
    };
}

static void wrmsr(uint32_t msr, uint64_t value)
{
    __asm__ volatile("wrmsr" ::"c"(msr), "a"((uint32_t)value), "d"((uint32_t)(value >> 32)));
}

static void load_idt(uint16_t limit, uint64_t base)
{
    struct table_ptr ptr = {.limit = limit, .base = base};
    __asm__ volatile("lidt %0" ::"m"(ptr));
}

static void enable_interrupts(const struct dv_boot_info *bi)
{
    if (bi->flags & DV_FLAG_PVM) {
        irq_pvm = 1;
        *(volatile uint8_t *)DV_VIF_GPA = 1; /* PVM's interrupt flag is virtual */
    } else {
        __asm__ volatile("sti");
    }
}

void arch_init(const struct dv_boot_info *bi)
{
    for (int v = 0; v < 32; v++)
        set_gate(v, exception_stubs[v]);
    set_gate(DV_IRQ_VECTOR, (uint64_t)irq_entry);
    set_gate(DV_SPURIOUS_VECTOR, (uint64_t)spurious_entry);
    load_idt(sizeof(idt) - 1, (uint64_t)idt);
    /* The monitor switched the APIC to x2APIC mode; software-enable it. */
    wrmsr(MSR_X2APIC_SVR, 0x100 | DV_SPURIOUS_VECTOR);
    enable_interrupts(bi);
}

void arch_doorbell(void)
{
    __asm__ volatile("outb %%al, %%dx" ::"a"(0), "d"(DV_DOORBELL_PORT) : "memory");
}

struct exception_frame {
    uint64_t vector, error_code, rip, cs, rflags, rsp, ss;
};

void guest_exception(const struct exception_frame *frame) __attribute__((noreturn));
void guest_exception(const struct exception_frame *frame)
{
    struct dv_ctrl *ctrl = ctrl_page();
    ctrl->panic_vector = frame->vector;
    ctrl->panic_rip = frame->rip;
    ctrl->panic_error_code = frame->error_code;
    ctrl->state = DV_STATE_PANICKED;
    for (;;)
        __asm__ volatile("outb %%al, %%dx" ::"a"(0), "d"(DV_PANIC_PORT) : "memory");
}

void arch_crash(uint32_t how)
{
    if (how == DV_CMD_TRIPLE)
        load_idt(0, 0); /* no gate for #UD, #DF or anything: shutdown */
    for (;;)
        __asm__ volatile("ud2");
}
