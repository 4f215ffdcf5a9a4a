/* HTTP/1.0 and 1.1 request parsing and response headers. Pure functions:
 * no guest state, so the parser is also compiled into a host-side test. */
#ifndef WEBGUEST_HTTP_H
#define WEBGUEST_HTTP_H
#include <stdint.h>

enum http_parse_result {
    HTTP_INCOMPLETE,      /* need more bytes */
    HTTP_REQUEST,         /* a whole request: see struct http_request */
    HTTP_MALFORMED,       /* 400, then close */
};

enum http_target { TARGET_SMALL, TARGET_LARGE, TARGET_NOT_FOUND };

struct http_request {
    uint32_t length;      /* bytes of the request, including its blank line */
    uint8_t head;         /* HEAD rather than GET */
    uint8_t implemented;  /* GET or HEAD; anything else gets 501 and close */
    uint8_t keep_alive;
    uint8_t target;       /* enum http_target */
};

/* Parses the request at the start of buf[0, len). *scan is where the search
 * for the blank line resumes (0 for a new request), so bytes arriving one at
 * a time cost linear time. A header block longer than max_header without
 * its blank line is malformed. */
enum http_parse_result http_parse(const uint8_t *buf, uint32_t len, uint32_t max_header,
                                  uint32_t *scan, struct http_request *req);

/* Writes the status line and headers into out (at least 256 bytes) and
 * returns their length. */
uint32_t http_response_header(char *out, uint32_t status, uint32_t content_length,
                              int text_body, int keep_alive);

const char *http_status_body(uint32_t status);
#endif
