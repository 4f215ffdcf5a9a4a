/* The working set every request touches: it stands for the guest OS and
 * server footprint Denali's VMs carried. The first request (or the template's
 * boot) gives every page content; each request then reads every page and
 * writes every Nth. */
#ifndef WEBGUEST_WORKINGSET_H
#define WEBGUEST_WORKINGSET_H
#include "abi.h"

void ws_touch(const struct dv_boot_info *bi);
/* The template's boot: gives the working set its content before the VM
 * says it is ready, so that clones start with it. */
void ws_prepare(const struct dv_boot_info *bi);
/* A clone's first start: makes the per-VM words of the template's content
 * this VM's own, as its own load would have written them. */
void ws_adopt(const struct dv_boot_info *bi);
#endif
