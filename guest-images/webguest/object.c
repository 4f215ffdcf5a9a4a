#include "object.h"
#include "abi.h"
#include "lib.h"
#include "pattern.h"

void object_copy(uint8_t *dst, uint32_t offset, uint32_t len)
{
    while (len) {
        uint32_t start = offset % DV_PATTERN_PERIOD;
        uint32_t chunk = len < DV_PATTERN_PERIOD ? len : DV_PATTERN_PERIOD;
        memcpy(dst, object_pattern + start, chunk);
        dst += chunk;
        offset += chunk;
        len -= chunk;
    }
}
