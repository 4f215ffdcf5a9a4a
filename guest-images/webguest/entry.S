/*
 * Entry point, exception and interrupt stubs, and the idle window.
 *
 * The monitor enters _start in 64-bit mode with RSP at the top of RAM and
 * RDI pointing at the boot-info page.
 */
#include "abi.h"

    .section .text.entry, "ax"
    .globl _start
_start:
    and $-16, %rsp
    call guest_main
1:  hlt
    jmp 1b

/* Exceptions: normalise the frame to (vector, error code, rip, cs, rflags,
 * rsp, ss) and report it. A dead guest never returns from guest_exception. */
.macro EXC_NOERR n
exc_\n:
    pushq $0
    pushq $\n
    jmp exc_common
.endm
.macro EXC_ERR n
exc_\n:
    pushq $\n
    jmp exc_common
.endm

EXC_NOERR 0
EXC_NOERR 1
EXC_NOERR 2
EXC_NOERR 3
EXC_NOERR 4
EXC_NOERR 5
EXC_NOERR 6
EXC_NOERR 7
EXC_ERR   8
EXC_NOERR 9
EXC_ERR   10
EXC_ERR   11
EXC_ERR   12
EXC_ERR   13
EXC_ERR   14
EXC_NOERR 15
EXC_NOERR 16
EXC_ERR   17
EXC_NOERR 18
EXC_NOERR 19
EXC_NOERR 20
EXC_ERR   21
EXC_NOERR 22
EXC_NOERR 23
EXC_NOERR 24
EXC_NOERR 25
EXC_NOERR 26
EXC_NOERR 27
EXC_NOERR 28
EXC_ERR   29
EXC_ERR   30
EXC_NOERR 31

exc_common:
    mov %rsp, %rdi
    and $-16, %rsp
    call guest_exception
2:  hlt
    jmp 2b

    .section .rodata
    .globl exception_stubs
exception_stubs:
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
    .quad exc_\n
    .endr

    .text
/* The doorbell interrupt: note it, EOI, and if it landed between the idle
 * check and its hlt, resume after the hlt so the wake-up is not lost (a PVM
 * guest has no sti-shadow to make "enable and halt" atomic). PVM completes
 * the EOI itself as it delivers the interrupt, so there the trapped wrmsr
 * would only end a spurious EOI. */
    .globl irq_entry
irq_entry:
    push %rax
    push %rcx
    push %rdx
    movl $1, irq_seen(%rip)
    cmpb $0, irq_pvm(%rip)
    jne 2f
    mov $0x80b, %ecx
    xor %eax, %eax
    xor %edx, %edx
    wrmsr
2:  mov 24(%rsp), %rax
    lea idle_window_start(%rip), %rcx
    cmp %rcx, %rax
    jb 1f
    lea idle_window_end(%rip), %rcx
    cmp %rcx, %rax
    jae 1f
    mov %rcx, 24(%rsp)
1:  cmpb $0, irq_pvm(%rip)
    jne plain_return
    pop %rdx
    pop %rcx
    pop %rax
    iretq

/* PVM emulates iretq (an exit per interrupt); with the interrupt flag a
 * byte of the VIF page, plain instructions can return instead (popfq runs
 * natively and leaves the real IF alone). Below the interrupted RSP (R) go
 * RIP, RFLAGS and the saved rax, rcx, rdx (R-8 down to R-40); then they are
 * popped. The saved registers lie below R-40 whatever the frame's
 * alignment, and every frame slot is read before its bytes are written.
 * The flag goes back on only once RSP is final: an interrupt taken after
 * that pushes its frame below everything still to be popped. */
plain_return:
    mov 48(%rsp), %rax
    mov 24(%rsp), %rcx
    mov %rcx, -8(%rax)
    mov 40(%rsp), %rcx
    mov %rcx, -16(%rax)
    pushq 16(%rsp)
    popq -24(%rax)
    pushq 8(%rsp)
    popq -32(%rax)
    pushq (%rsp)
    popq -40(%rax)
    lea -40(%rax), %rsp
    movb $1, DV_VIF_GPA
    pop %rdx
    pop %rcx
    pop %rax
    popfq
    ret

    .globl spurious_entry
spurious_entry:
    iretq

/* void idle_wait(void): halt unless the doorbell interrupt came after
 * irq_seen was last cleared. */
    .globl idle_wait
idle_wait:
idle_window_start:
    cmpl $0, irq_seen(%rip)
    jne idle_window_end
    hlt
idle_window_end:
    ret
