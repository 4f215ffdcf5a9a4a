/* The few libc routines a freestanding guest needs (gcc may emit calls to them). */
#ifndef WEBGUEST_LIB_H
#define WEBGUEST_LIB_H
#include <stddef.h>
#include <stdint.h>

void *memcpy(void *dst, const void *src, size_t n);
void *memmove(void *dst, const void *src, size_t n);
void *memset(void *dst, int c, size_t n);
int memcmp(const void *a, const void *b, size_t n);
/* Decimal digits of v into out (no terminator); returns the count. */
uint32_t fmt_u32(char *out, uint32_t v);
#endif
