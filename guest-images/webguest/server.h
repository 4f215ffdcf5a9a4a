/* The web server loop: serves connections until the VM is destroyed. */
#ifndef WEBGUEST_SERVER_H
#define WEBGUEST_SERVER_H
#include "abi.h"

void server_run(const struct dv_boot_info *bi) __attribute__((noreturn));
#endif
