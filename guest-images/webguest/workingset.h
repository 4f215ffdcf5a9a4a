/* The working set every request touches: it stands for the guest OS and
 * server footprint Denali's VMs carried. The first request gives every page
 * content; each request then reads every page and writes every Nth. */
#ifndef WEBGUEST_WORKINGSET_H
#define WEBGUEST_WORKINGSET_H
#include "abi.h"

void ws_touch(const struct dv_boot_info *bi);
#endif
