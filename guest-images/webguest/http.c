#include "http.h"
#include "lib.h"

static int is_token_char(uint8_t c)
{
    if (c >= 'a' && c <= 'z') return 1;
    if (c >= 'A' && c <= 'Z') return 1;
    if (c >= '0' && c <= '9') return 1;
    switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+':
    case '-': case '.': case '^': case '_': case '`': case '|': case '~':
        return 1;
    }
    return 0;
}

static uint8_t lower(uint8_t c) { return (c >= 'A' && c <= 'Z') ? (uint8_t)(c + 32) : c; }

static int equals_nocase(const uint8_t *s, uint32_t n, const char *lit)
{
    uint32_t i = 0;
    for (; i < n && lit[i]; i++)
        if (lower(s[i]) != (uint8_t)lit[i])
            return 0;
    return i == n && lit[i] == 0;
}

/* Does the comma-separated value contain token lit (lower-case)? */
static int value_has_token(const uint8_t *v, uint32_t n, const char *lit)
{
    uint32_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
            i++;
        uint32_t start = i;
        while (i < n && v[i] != ',')
            i++;
        uint32_t end = i;
        while (end > start && (v[end - 1] == ' ' || v[end - 1] == '\t'))
            end--;
        if (end > start && equals_nocase(v + start, end - start, lit))
            return 1;
    }
    return 0;
}

/* Line [s, e) without its line ending. */
static uint32_t line_end(const uint8_t *buf, uint32_t s, uint32_t limit, uint32_t *next)
{
    uint32_t e = s;
    while (e < limit && buf[e] != '\n')
        e++;
    *next = e + 1;
    if (e > s && buf[e - 1] == '\r')
        e--;
    return e;
}

static enum http_target classify_path(const uint8_t *p, uint32_t n)
{
    uint32_t len = 0;
    while (len < n && p[len] != '?' && p[len] != '#')
        len++;
    if (len == 1 && p[0] == '/')
        return TARGET_SMALL;
    if (len == 6 && memcmp(p, "/large", 6) == 0)
        return TARGET_LARGE;
    return TARGET_NOT_FOUND;
}

static enum http_parse_result parse_request_line(const uint8_t *s, uint32_t n,
                                                 struct http_request *req, int *http11)
{
    uint32_t i = 0;
    while (i < n && is_token_char(s[i]))
        i++;
    if (i == 0 || i >= n || s[i] != ' ')
        return HTTP_MALFORMED;
    uint32_t method_len = i++;
    uint32_t target_start = i;
    while (i < n && s[i] > ' ' && s[i] < 0x7f)
        i++;
    if (i == target_start || i >= n || s[i] != ' ')
        return HTTP_MALFORMED;
    uint32_t target_len = i - target_start;
    const uint8_t *version = s + i + 1;
    if (n - i - 1 != 8 || memcmp(version, "HTTP/1.", 7) != 0)
        return HTTP_MALFORMED;
    if (version[7] != '0' && version[7] != '1')
        return HTTP_MALFORMED;
    *http11 = version[7] == '1';

    const uint8_t *target = s + target_start;
    if (target[0] != '/') {
        /* absolute-form: skip "scheme://authority" */
        uint32_t j = 0;
        while (j + 2 < target_len && !(target[j] == ':' && target[j + 1] == '/' && target[j + 2] == '/'))
            j++;
        if (j + 2 >= target_len)
            return HTTP_MALFORMED;
        j += 3;
        while (j < target_len && target[j] != '/')
            j++;
        target += j;
        target_len -= j;
        if (target_len == 0) {
            target = (const uint8_t *)"/";
            target_len = 1;
        }
    }
    req->head = method_len == 4 && memcmp(s, "HEAD", 4) == 0;
    req->implemented = req->head || (method_len == 3 && memcmp(s, "GET", 3) == 0);
    req->target = (uint8_t)classify_path(target, target_len);
    return HTTP_REQUEST;
}

static enum http_parse_result parse_header(const uint8_t *s, uint32_t n, struct http_request *req)
{
    uint32_t i = 0;
    while (i < n && is_token_char(s[i]))
        i++;
    if (i == 0 || i >= n || s[i] != ':')
        return HTTP_MALFORMED;
    uint32_t name_len = i++;
    for (uint32_t j = i; j < n; j++)
        if ((s[j] < 0x20 && s[j] != '\t') || s[j] == 0x7f)
            return HTTP_MALFORMED;
    while (i < n && (s[i] == ' ' || s[i] == '\t'))
        i++;
    const uint8_t *value = s + i;
    uint32_t value_len = n - i;
    if (equals_nocase(s, name_len, "connection")) {
        if (value_has_token(value, value_len, "close"))
            req->keep_alive = 0;
        else if (value_has_token(value, value_len, "keep-alive"))
            req->keep_alive = 1;
    } else if (equals_nocase(s, name_len, "content-length")) {
        /* Request bodies are not served: only an explicit zero is accepted. */
        for (uint32_t j = 0; j < value_len; j++)
            if (value[j] != '0' && value[j] != ' ')
                return HTTP_MALFORMED;
    } else if (equals_nocase(s, name_len, "transfer-encoding")) {
        return HTTP_MALFORMED;
    }
    return HTTP_REQUEST;
}

enum http_parse_result http_parse(const uint8_t *buf, uint32_t len, uint32_t max_header,
                                  uint32_t *scan, struct http_request *req)
{
    uint32_t start = 0;
    while (start < len && (buf[start] == '\r' || buf[start] == '\n'))
        start++;
    if (start >= max_header)
        return HTTP_MALFORMED;

    /* Find the blank line: "\n\n" or "\n\r\n". */
    uint32_t i = *scan > start ? *scan : start;
    uint32_t end = 0;
    for (; i < len; i++) {
        if (buf[i] != '\n')
            continue;
        if (i + 1 < len && buf[i + 1] == '\n') {
            end = i + 2;
            break;
        }
        if (i + 2 < len && buf[i + 1] == '\r' && buf[i + 2] == '\n') {
            end = i + 3;
            break;
        }
        if (i + 2 >= len)
            break; /* the terminator may still be arriving */
    }
    if (end == 0) {
        *scan = i > 0 ? i : 0;
        return len >= max_header ? HTTP_MALFORMED : HTTP_INCOMPLETE;
    }
    if (end - start > max_header)
        return HTTP_MALFORMED;
    *scan = 0;

    for (uint32_t j = start; j < end; j++)
        if (buf[j] == 0 || buf[j] == 0x7f || (buf[j] < 0x20 && buf[j] != '\r' && buf[j] != '\n' && buf[j] != '\t'))
            return HTTP_MALFORMED;

    req->length = end;
    uint32_t next;
    uint32_t e = line_end(buf, start, end, &next);
    int http11 = 0;
    if (parse_request_line(buf + start, e - start, req, &http11) != HTTP_REQUEST)
        return HTTP_MALFORMED;
    req->keep_alive = (uint8_t)http11;
    for (uint32_t s = next; s < end;) {
        e = line_end(buf, s, end, &next);
        if (e == s)
            break; /* the blank line */
        if (buf[s] == ' ' || buf[s] == '\t')
            return HTTP_MALFORMED; /* obsolete line folding */
        if (parse_header(buf + s, e - s, req) != HTTP_REQUEST)
            return HTTP_MALFORMED;
        s = next;
    }
    return HTTP_REQUEST;
}

static uint32_t append(char *out, uint32_t at, const char *s)
{
    while (*s)
        out[at++] = *s++;
    return at;
}

const char *http_status_body(uint32_t status)
{
    switch (status) {
    case 400: return "400 Bad Request\n";
    case 404: return "404 Not Found\n";
    case 501: return "501 Not Implemented\n";
    default: return "";
    }
}

static const char *reason(uint32_t status)
{
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    default: return "Not Implemented";
    }
}

uint32_t http_response_header(char *out, uint32_t status, uint32_t content_length,
                              int text_body, int keep_alive)
{
    uint32_t n = append(out, 0, "HTTP/1.1 ");
    n += fmt_u32(out + n, status);
    n = append(out, n, " ");
    n = append(out, n, reason(status));
    n = append(out, n, "\r\nServer: webguest\r\nContent-Type: ");
    n = append(out, n, text_body ? "text/plain" : "application/octet-stream");
    n = append(out, n, "\r\nContent-Length: ");
    n += fmt_u32(out + n, content_length);
    n = append(out, n, keep_alive ? "\r\nConnection: keep-alive\r\n\r\n" : "\r\nConnection: close\r\n\r\n");
    return n;
}
