/* webguest: a freestanding HTTP server VM for densevm. */
#include "abi.h"
#include "arch.h"
#include "server.h"
#include "workingset.h"
#ifdef HOSTILE
#include "hostile.h"
#endif

void guest_main(const struct dv_boot_info *bi) __attribute__((noreturn));
void guest_main(const struct dv_boot_info *bi)
{
    struct dv_ctrl *ctrl = ctrl_page();
    if (bi->magic != DV_BOOT_MAGIC || bi->version != DV_BOOT_VERSION)
        arch_crash(DV_CMD_CRASH);
    /* A new vCPU needs its IDT and APIC set up again; a resumed guest's
     * memory already holds everything else, its misbehaviour included. */
    arch_init(bi);
    /* A template is the image as loaded, before any VM's own start; each
     * clone then starts as its own boot would have. */
    if (bi->flags & DV_FLAG_TEMPLATE)
        ws_prepare(bi);
    if (bi->flags & DV_FLAG_CLONE)
        ws_adopt(bi);
#ifdef HOSTILE
    if (!(bi->flags & (DV_FLAG_RESUME | DV_FLAG_TEMPLATE)) || (bi->flags & DV_FLAG_CLONE))
        hostile_start(bi);
#endif
    ctrl->state = DV_STATE_READY;
    arch_doorbell();
    server_run(bi);
}
