/* The served objects: deterministic bytes a client can verify (see README). */
#ifndef WEBGUEST_OBJECT_H
#define WEBGUEST_OBJECT_H
#include <stdint.h>

/* Copies bytes [offset, offset + len) of the object pattern to dst. */
void object_copy(uint8_t *dst, uint32_t offset, uint32_t len);
#endif
