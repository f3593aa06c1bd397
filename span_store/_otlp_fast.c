/* Fast decoder of OTLP/HTTP protobuf trace export requests into the span store's columns.
 *
 * decode_traces(body, received_ns) -> (columns, rejected, errors) returns exactly what
 * otlp._SpanColumns holds after otlp.decode_traces_protobuf_python(body), which stays the reference:
 * same rows, same None/int/str values, JSON text columns that json.loads to the same values.
 *
 * It reads the wire format directly instead of building a upb message and one Python wrapper per
 * KeyValue/AnyValue. Two passes:
 *   1. validate(): the whole body against the message schema, as upb's parser would. Malformed wire
 *      data, invalid UTF-8 in any string field (even ones we ignore) and nesting deeper than 100
 *      messages/groups raise ValueError, so a request is stored entirely or not at all.
 *   2. extraction: walk the (now known good) body again and build the rows.
 *
 * Protobuf semantics reproduced (checked against upb, see tests/test_otlp_fast.py):
 *   - unknown fields of every wire type are skipped, groups included (with the depth limit); a known
 *     field number with an unexpected wire type is an unknown field too, as in upb and C++ protobuf;
 *   - scalars: the last occurrence wins; a singular embedded message that occurs several times is the
 *     merge of all occurrences (Resource, InstrumentationScope, Status, KeyValue.value);
 *   - AnyValue is a oneof: the last member wins, and consecutive occurrences of array_value or
 *     kvlist_value merge (their elements concatenate) until another member resets the oneof;
 *   - duplicate keys in an attribute list behave like a Python dict built in order: the key keeps the
 *     position of its first occurrence and takes the value of its last.
 *
 * As the reference does (otlp_values.MAX_VALUE_DEPTH, otlp_values.valid_id): an attribute value nested more than
 * MAX_VALUE_DEPTH levels raises RecursionError naming the attribute, even in a span that is rejected; a span
 * whose trace, span, parent span or link id is not a valid id is rejected.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 100 /* upb's default recursion limit: nested messages and groups below the request */
#define MAX_ERRORS 20 /* as _SpanColumns.reject */
#define MAX_VALUE_DEPTH 32 /* otlp_values.MAX_VALUE_DEPTH: array/kvlist levels of an AnyValue, a plain value being 1 */

/* ---- wire format ------------------------------------------------------------------------------- */

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_SGROUP = 3, WT_EGROUP = 4, WT_I32 = 5 };

typedef struct {
    const uint8_t *p, *end;
    const uint8_t *base; /* start of the body, for byte offsets in error messages */
} Reader;

typedef struct {
    uint32_t num;
    int wt;
    uint64_t u;          /* varint, fixed32 and fixed64 values */
    const uint8_t *data; /* length-delimited payload */
    size_t len;
} Field;

static int fail(const Reader *r, const char *what)
{
    PyErr_Format(PyExc_ValueError, "%s at byte %zd", what, (Py_ssize_t)(r->p - r->base));
    return -1;
}

static int fail_depth(const Reader *r)
{
    PyErr_Format(PyExc_ValueError, "messages nested deeper than %d levels at byte %zd", MAX_DEPTH,
                 (Py_ssize_t)(r->p - r->base));
    return -1;
}

static Reader sub_reader(const Reader *r, const Field *f)
{
    Reader sub = {f->data, f->data + f->len, r->base};
    return sub;
}

/* Tags and lengths may take at most 5 bytes (upb refuses longer ones), other varints 10. */
static inline int read_varint(Reader *r, uint64_t *out, int max_bytes)
{
    if (r->p < r->end && *r->p < 0x80) { /* the common case: one byte */
        *out = *r->p++;
        return 0;
    }
    uint64_t value = 0;
    for (int i = 0; i < max_bytes; i++) {
        if (r->p >= r->end)
            return fail(r, "truncated varint");
        uint8_t byte = *r->p++;
        value |= (uint64_t)(byte & 0x7f) << (7 * i);
        if (!(byte & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return fail(r, "varint too long");
}

static inline int read_fixed(Reader *r, int n_bytes, uint64_t *out)
{
    if (r->end - r->p < n_bytes)
        return fail(r, "truncated fixed-width field");
    uint64_t value = 0;
    for (int i = n_bytes - 1; i >= 0; i--)
        value = (value << 8) | r->p[i];
    r->p += n_bytes;
    *out = value;
    return 0;
}

static inline int read_tag(Reader *r, uint32_t *num, int *wt)
{
    uint64_t tag;
    if (read_varint(r, &tag, 5) < 0)
        return -1;
    if (tag > UINT32_MAX || (tag >> 3) == 0)
        return fail(r, "invalid field tag");
    *num = (uint32_t)(tag >> 3);
    *wt = (int)(tag & 7);
    return 0;
}

static int skip_group(Reader *r, uint32_t num, int depth);

/* Reads the value of a field whose tag was just read; a group is skipped whole. */
static inline int read_value(Reader *r, Field *f, int depth)
{
    switch (f->wt) {
    case WT_VARINT:
        return read_varint(r, &f->u, 10);
    case WT_I64:
        return read_fixed(r, 8, &f->u);
    case WT_I32:
        return read_fixed(r, 4, &f->u);
    case WT_LEN: {
        uint64_t len;
        if (read_varint(r, &len, 5) < 0)
            return -1;
        if (len > (uint64_t)(r->end - r->p))
            return fail(r, "length past the end of the message");
        f->data = r->p;
        f->len = (size_t)len;
        r->p += len;
        return 0;
    }
    case WT_SGROUP:
        return skip_group(r, f->num, depth + 1);
    default:
        return fail(r, "invalid wire type");
    }
}

static int skip_group(Reader *r, uint32_t num, int depth)
{
    if (depth > MAX_DEPTH)
        return fail_depth(r);
    for (;;) {
        Field f;
        if (r->p >= r->end)
            return fail(r, "unterminated group");
        if (read_tag(r, &f.num, &f.wt) < 0)
            return -1;
        if (f.wt == WT_EGROUP)
            return f.num == num ? 0 : fail(r, "mismatched end-group tag");
        if (read_value(r, &f, depth) < 0)
            return -1;
    }
}

/* 1: *f holds the next field, 0: end of the message, -1: error set. depth: that of the message. */
static inline int next_field(Reader *r, Field *f, int depth)
{
    if (r->p >= r->end)
        return 0;
    if (read_tag(r, &f->num, &f->wt) < 0)
        return -1;
    if (f->wt == WT_EGROUP)
        return fail(r, "end-group tag outside a group");
    return read_value(r, f, depth) < 0 ? -1 : 1;
}

static inline int is_field(const Field *f, uint32_t num, int wt)
{
    return f->num == num && f->wt == wt;
}

/* ---- pass 1: validation against the schema ----------------------------------------------------- */

enum Msg {
    M_BYTES = 0, /* not a message: bytes, or a field we do not know */
    M_REQUEST, M_RESOURCE_SPANS, M_RESOURCE, M_ENTITY_REF, M_SCOPE_SPANS, M_SCOPE, M_SPAN, M_EVENT,
    M_LINK, M_STATUS, M_KEY_VALUE, M_ANY_VALUE, M_ARRAY_VALUE, M_KV_LIST, M_COUNT
};
#define M_STRING (-1)

typedef struct {
    int8_t kind; /* a message type, M_STRING, or M_BYTES */
    const char *name;
} LenField;

/* The length-delimited fields of each message (opentelemetry-proto 1.x, checked against the installed
 * descriptors by tests/test_otlp_fast.py::test_schema_table_matches_descriptors). */
static const LenField LEN_FIELDS[M_COUNT][16] = {
    [M_REQUEST] = {[1] = {M_RESOURCE_SPANS, "ExportTraceServiceRequest.resource_spans"}},
    [M_RESOURCE_SPANS] = {[1] = {M_RESOURCE, "ResourceSpans.resource"},
                          [2] = {M_SCOPE_SPANS, "ResourceSpans.scope_spans"},
                          [3] = {M_STRING, "ResourceSpans.schema_url"}},
    [M_RESOURCE] = {[1] = {M_KEY_VALUE, "Resource.attributes"}, [3] = {M_ENTITY_REF, "Resource.entity_refs"}},
    [M_ENTITY_REF] = {[1] = {M_STRING, "EntityRef.schema_url"}, [2] = {M_STRING, "EntityRef.type"},
                      [3] = {M_STRING, "EntityRef.id_keys"}, [4] = {M_STRING, "EntityRef.description_keys"}},
    [M_SCOPE_SPANS] = {[1] = {M_SCOPE, "ScopeSpans.scope"}, [2] = {M_SPAN, "ScopeSpans.spans"},
                       [3] = {M_STRING, "ScopeSpans.schema_url"}},
    [M_SCOPE] = {[1] = {M_STRING, "InstrumentationScope.name"}, [2] = {M_STRING, "InstrumentationScope.version"},
                 [3] = {M_KEY_VALUE, "InstrumentationScope.attributes"}},
    [M_SPAN] = {[1] = {M_BYTES, "Span.trace_id"}, [2] = {M_BYTES, "Span.span_id"},
                [3] = {M_STRING, "Span.trace_state"}, [4] = {M_BYTES, "Span.parent_span_id"},
                [5] = {M_STRING, "Span.name"}, [9] = {M_KEY_VALUE, "Span.attributes"},
                [11] = {M_EVENT, "Span.events"}, [13] = {M_LINK, "Span.links"}, [15] = {M_STATUS, "Span.status"}},
    [M_EVENT] = {[2] = {M_STRING, "Event.name"}, [3] = {M_KEY_VALUE, "Event.attributes"}},
    [M_LINK] = {[1] = {M_BYTES, "Link.trace_id"}, [2] = {M_BYTES, "Link.span_id"},
                [3] = {M_STRING, "Link.trace_state"}, [4] = {M_KEY_VALUE, "Link.attributes"}},
    [M_STATUS] = {[2] = {M_STRING, "Status.message"}},
    [M_KEY_VALUE] = {[1] = {M_STRING, "KeyValue.key"}, [2] = {M_ANY_VALUE, "KeyValue.value"}},
    [M_ANY_VALUE] = {[1] = {M_STRING, "AnyValue.string_value"}, [5] = {M_ARRAY_VALUE, "AnyValue.array_value"},
                     [6] = {M_KV_LIST, "AnyValue.kvlist_value"}, [7] = {M_BYTES, "AnyValue.bytes_value"}},
    [M_ARRAY_VALUE] = {[1] = {M_ANY_VALUE, "ArrayValue.values"}},
    [M_KV_LIST] = {[1] = {M_KEY_VALUE, "KeyValueList.values"}},
};

/* Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF), as upb and Python check it. */
static int utf8_valid(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        if (n - i >= 8) {
            uint64_t word;
            memcpy(&word, s + i, 8);
            if (!(word & 0x8080808080808080ULL)) {
                i += 8;
                continue;
            }
        }
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t extra;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) {
            extra = 1;
            cp = c & 0x1f;
        } else if (c >= 0xE0 && c <= 0xEF) {
            extra = 2;
            cp = c & 0x0f;
        } else if (c >= 0xF0 && c <= 0xF4) {
            extra = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (n - i - 1 < extra)
            return 0;
        for (size_t k = 1; k <= extra; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if (extra == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF)))
            return 0;
        if (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF))
            return 0;
        i += extra + 1;
    }
    return 1;
}

static int validate(Reader r, int msg, int depth)
{
    Field f;
    int rc;
    while ((rc = next_field(&r, &f, depth)) > 0) {
        if (f.wt != WT_LEN || f.num >= 16)
            continue;
        const LenField *spec = &LEN_FIELDS[msg][f.num];
        if (spec->kind == M_STRING && !utf8_valid(f.data, f.len)) {
            PyErr_Format(PyExc_ValueError, "invalid UTF-8 in string field %s at byte %zd", spec->name,
                         (Py_ssize_t)(f.data - r.base));
            return -1;
        }
        if (spec->kind > M_BYTES) {
            if (depth + 1 > MAX_DEPTH)
                return fail_depth(&r);
            if (validate(sub_reader(&r, &f), spec->kind, depth + 1) < 0)
                return -1;
        }
    }
    return rc;
}

/* ---- growable output buffer -------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t extra)
{
    if (b->cap - b->len >= extra)
        return 0;
    if (extra > PY_SSIZE_T_MAX / 2 - b->len) {
        PyErr_NoMemory();
        return -1;
    }
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < extra)
        cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, size_t n)
{
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

static int buf_putc(Buf *b, char c)
{
    return buf_put(b, &c, 1);
}

static PyObject *buf_to_str(const Buf *b)
{
    return PyUnicode_DecodeUTF8(b->data ? b->data : "", (Py_ssize_t)b->len, "strict");
}

/* ---- JSON pieces ------------------------------------------------------------------------------- */

static const char HEX[] = "0123456789abcdef";

/* How many bytes from s on need no escaping in a JSON string: not '"', '\\' or a control character. */
static size_t plain_run(const uint8_t *s, size_t n)
{
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) { /* eight bytes at a time: any byte < 0x20, == '"' or == '\\'? */
        uint64_t w;
        memcpy(&w, s + i, 8);
        uint64_t quote = w ^ (ones * '"'), backslash = w ^ (ones * '\\');
        uint64_t special = ((w - ones * 0x20) & ~w) | ((quote - ones) & ~quote) | ((backslash - ones) & ~backslash);
        if (special & highs)
            break;
    }
    while (i < n && s[i] >= 0x20 && s[i] != '"' && s[i] != '\\')
        i++;
    return i;
}

/* s is valid UTF-8 (pass 1): only '"', '\\' and control characters need escaping. */
static int put_json_str(Buf *b, const uint8_t *s, size_t n)
{
    if (n > PY_SSIZE_T_MAX / 8) {
        PyErr_NoMemory();
        return -1;
    }
    if (buf_reserve(b, n * 6 + 2) < 0)
        return -1;
    char *o = b->data + b->len;
    *o++ = '"';
    for (size_t i = 0; i < n; i++) {
        size_t run = plain_run(s + i, n - i);
        memcpy(o, s + i, run);
        o += run;
        i += run;
        if (i == n)
            break;
        uint8_t c = s[i];
        *o++ = '\\';
        switch (c) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '\n': *o++ = 'n'; break;
        case '\r': *o++ = 'r'; break;
        case '\t': *o++ = 't'; break;
        case '\b': *o++ = 'b'; break;
        case '\f': *o++ = 'f'; break;
        default:
            memcpy(o, "u00", 3);
            o[3] = HEX[c >> 4];
            o[4] = HEX[c & 15];
            o += 5;
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->data);
    return 0;
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int put_base64(Buf *b, const uint8_t *s, size_t n)
{
    if (n > PY_SSIZE_T_MAX / 2) {
        PyErr_NoMemory();
        return -1;
    }
    if (buf_reserve(b, (n + 2) / 3 * 4) < 0)
        return -1;
    char *o = b->data + b->len;
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        o[0] = B64[v >> 18];
        o[1] = B64[(v >> 12) & 63];
        o[2] = B64[(v >> 6) & 63];
        o[3] = B64[v & 63];
        o += 4;
    }
    if (i < n) {
        uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0);
        o[0] = B64[v >> 18];
        o[1] = B64[(v >> 12) & 63];
        o[2] = i + 1 < n ? B64[(v >> 6) & 63] : '=';
        o[3] = '=';
        o += 4;
    }
    b->len = (size_t)(o - b->data);
    return 0;
}

static int put_digits(Buf *b, uint64_t v, int negative)
{
    char tmp[24], *end = tmp + sizeof tmp, *o = end;
    do {
        *--o = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    if (negative)
        *--o = '-';
    return buf_put(b, o, (size_t)(end - o));
}

static int put_uint(Buf *b, uint64_t v)
{
    return put_digits(b, v, 0);
}

static int put_int(Buf *b, int64_t v)
{
    return v < 0 ? put_digits(b, 0 - (uint64_t)v, 1) : put_digits(b, (uint64_t)v, 0);
}

static double as_double(uint64_t bits)
{
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* Python's repr "1.5e-05" / "1e-07" as orjson writes it: "0.000015" / "1e-7" (same shortest digits;
 * orjson switches to exponent notation below 1e-5 where repr does below 1e-4, and writes no leading
 * zeros in a negative exponent). Positive exponents ("1e+16") are the same in both. */
static int put_repr_as_orjson(Buf *b, const char *text)
{
    const char *e = strchr(text, 'e');
    if (!e || e[1] != '-')
        return buf_put(b, text, strlen(text));
    int exponent = atoi(e + 2);
    if (exponent != 5)
        return buf_put(b, text, (size_t)(e + 2 - text)) < 0 ? -1 : put_uint(b, (uint64_t)exponent);
    const char *digits = text;
    if (*digits == '-' && buf_putc(b, *digits++) < 0)
        return -1;
    if (buf_put(b, "0.0000", 6) < 0)
        return -1;
    for (; digits < e; digits++)
        if (*digits != '.' && buf_putc(b, *digits) < 0)
            return -1;
    return 0;
}

/* NaN and infinities have no JSON form; like orjson, write null. Finite: the shortest form that reads
 * back as the same double, spelled as orjson does (so both decoders store the same text). */
static int put_double(Buf *b, double d)
{
    if (!isfinite(d))
        return buf_put(b, "null", 4);
    char *text = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (!text)
        return -1;
    int rc = put_repr_as_orjson(b, text);
    PyMem_Free(text);
    return rc;
}

static int put_hex(Buf *b, const uint8_t *s, size_t n)
{
    if (buf_reserve(b, 2 * n + 2) < 0)
        return -1;
    char *o = b->data + b->len;
    *o++ = '"';
    for (size_t i = 0; i < n; i++) {
        *o++ = HEX[s[i] >> 4];
        *o++ = HEX[s[i] & 15];
    }
    *o++ = '"';
    b->len = (size_t)(o - b->data);
    return 0;
}

static PyObject *hex_str(const uint8_t *s, size_t n)
{
    if (n > PY_SSIZE_T_MAX / 2)
        return PyErr_NoMemory();
    PyObject *out = PyUnicode_New((Py_ssize_t)(2 * n), 127);
    if (!out)
        return NULL;
    Py_UCS1 *o = PyUnicode_1BYTE_DATA(out);
    for (size_t i = 0; i < n; i++) {
        o[2 * i] = (Py_UCS1)HEX[s[i] >> 4];
        o[2 * i + 1] = (Py_UCS1)HEX[s[i] & 15];
    }
    return out;
}

static PyObject *utf8_str(const uint8_t *s, size_t n)
{
    if (n == 0)
        return PyUnicode_New(0, 0);
    return PyUnicode_DecodeUTF8((const char *)s, (Py_ssize_t)n, "strict");
}

/* "" -> None, as `value or None` */
static PyObject *utf8_str_or_none(const uint8_t *s, size_t n)
{
    if (n == 0)
        Py_RETURN_NONE;
    return utf8_str(s, n);
}

/* ---- AnyValue as protobuf merges it ------------------------------------------------------------ */

/* An AnyValue: the concatenation of the payloads of every length-delimited occurrence of `field` in
 * the message [start, end) (a KeyValue's value: field 2), or with field == 0 [start, end) itself
 * (an array element). Concatenated encodings parse as the merge of the messages. */
typedef struct {
    Reader outer, part;
    uint32_t field;
    int in_part, done;
} AnyIter;

static AnyIter any_iter(const uint8_t *base, const uint8_t *start, const uint8_t *end, uint32_t field)
{
    AnyIter it = {{start, end, base}, {start, start, base}, field, 0, 0};
    return it;
}

static int any_iter_next(AnyIter *it, Field *f)
{
    for (;;) {
        if (it->in_part) {
            int rc = next_field(&it->part, f, 0);
            if (rc != 0)
                return rc;
            it->in_part = 0;
        }
        if (it->field == 0) {
            if (it->done)
                return 0;
            it->done = 1;
            it->part = it->outer;
            it->in_part = 1;
            continue;
        }
        Field g;
        int rc = next_field(&it->outer, &g, 0);
        if (rc <= 0)
            return rc;
        if (is_field(&g, it->field, WT_LEN)) {
            it->part = sub_reader(&it->outer, &g);
            it->in_part = 1;
        }
    }
}

enum { AV_NONE = 0, AV_STRING, AV_BOOL, AV_INT, AV_DOUBLE, AV_ARRAY, AV_KVLIST, AV_BYTES, AV_STRINDEX };
static const int AV_WIRE[9] = {-1, WT_LEN, WT_VARINT, WT_VARINT, WT_I64, WT_LEN, WT_LEN, WT_LEN, WT_VARINT};

typedef struct {
    int kind;
    Field last; /* the occurrence that set the value (scalars) */
    AnyIter from; /* array/kvlist: where the occurrences that merge into the value start */
} AnyInfo;

static int resolve_any(AnyIter it, AnyInfo *info)
{
    info->kind = AV_NONE;
    for (;;) {
        AnyIter before = it;
        Field f;
        int rc = any_iter_next(&it, &f);
        if (rc <= 0)
            return rc;
        if (f.num < 1 || f.num > 8 || f.wt != AV_WIRE[f.num])
            continue; /* unknown, or a wire type upb treats as unknown */
        if ((f.num == AV_ARRAY || f.num == AV_KVLIST) && info->kind == (int)f.num)
            continue; /* merges into the list already set */
        info->kind = (int)f.num;
        info->last = f;
        info->from = before;
    }
}

/* The elements (field 1 of every merged array_value / kvlist_value) of a list AnyValue. */
typedef struct {
    AnyIter outer;
    Reader list;
    uint32_t kind;
    int in_list;
} ElemIter;

static ElemIter elem_iter(const AnyInfo *info)
{
    ElemIter it = {info->from, {NULL, NULL, NULL}, (uint32_t)info->kind, 0};
    return it;
}

static int elem_next(ElemIter *it, Field *elem)
{
    for (;;) {
        if (it->in_list) {
            int rc = next_field(&it->list, elem, 0);
            if (rc < 0)
                return -1;
            if (rc > 0 && is_field(elem, 1, WT_LEN))
                return 1;
            if (rc == 0)
                it->in_list = 0;
            continue;
        }
        Field f;
        int rc = any_iter_next(&it->outer, &f);
        if (rc <= 0)
            return rc;
        if (is_field(&f, it->kind, WT_LEN)) {
            it->list = sub_reader(&it->outer.part, &f);
            it->in_list = 1;
        }
    }
}

/* ---- key/value lists --------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *key;
    size_t key_len;
    const uint8_t *start, *end; /* the KeyValue message; its value is the merge of its field 2 */
} KeyValue;

/* A stack: an attribute list being collected sits on top of the lists that enclose it. */
typedef struct {
    KeyValue *items;
    size_t len, cap;
} KvStack;

static int kv_scan(const uint8_t *base, const uint8_t *data, size_t len, KeyValue *kv)
{
    Reader r = {data, data + len, base};
    Field f;
    int rc;
    kv->key = data;
    kv->key_len = 0;
    kv->start = data;
    kv->end = data + len;
    while ((rc = next_field(&r, &f, 0)) > 0)
        if (is_field(&f, 1, WT_LEN)) {
            kv->key = f.data;
            kv->key_len = f.len;
        }
    return rc;
}

static int kv_push(KvStack *s, const uint8_t *base, const Field *f)
{
    if (s->len == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        if (cap > PY_SSIZE_T_MAX / sizeof(KeyValue)) {
            PyErr_NoMemory();
            return -1;
        }
        KeyValue *items = PyMem_Realloc(s->items, cap * sizeof(KeyValue));
        if (!items) {
            PyErr_NoMemory();
            return -1;
        }
        s->items = items;
        s->cap = cap;
    }
    if (kv_scan(base, f->data, f->len, &s->items[s->len]) < 0)
        return -1;
    s->len++;
    return 0;
}

static int same_key(const KeyValue *a, const KeyValue *b)
{
    return a->key_len == b->key_len && memcmp(a->key, b->key, a->key_len) == 0;
}

static uint64_t key_hash(const KeyValue *kv)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < kv->key_len; i++)
        h = (h ^ kv->key[i]) * 1099511628211ULL;
    return h;
}

/* Python dict semantics: order[k] = index of the LAST item with the k-th distinct key, keys in order
 * of first occurrence. Returns the number of distinct keys, or -1 (MemoryError). */
static Py_ssize_t dedup_keys(const KeyValue *kv, size_t n, size_t *order)
{
    size_t m = 0;
    if (n <= 32) {
        for (size_t i = 0; i < n; i++) {
            size_t k = 0;
            while (k < m && !same_key(&kv[order[k]], &kv[i]))
                k++;
            order[k] = i;
            if (k == m)
                m++;
        }
        return (Py_ssize_t)m;
    }
    size_t size = 64;
    while (size < 2 * n)
        size *= 2;
    size_t *slots = PyMem_Calloc(size, sizeof(size_t)); /* k + 1, 0 = empty */
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        size_t at = (size_t)key_hash(&kv[i]) & (size - 1);
        while (slots[at] && !same_key(&kv[order[slots[at] - 1]], &kv[i]))
            at = (at + 1) & (size - 1);
        if (!slots[at])
            slots[at] = ++m;
        order[slots[at] - 1] = i;
    }
    PyMem_Free(slots);
    return (Py_ssize_t)m;
}

/* Index of the last item with this key in s[base:], or -1: what dict.get would find. */
static Py_ssize_t kv_find(const KvStack *s, size_t base, const char *key)
{
    size_t n = strlen(key);
    for (size_t i = s->len; i-- > base;)
        if (s->items[i].key_len == n && memcmp(s->items[i].key, key, n) == 0)
            return (Py_ssize_t)i;
    return -1;
}

/* ---- AnyValue to JSON and to Python ------------------------------------------------------------ */

typedef struct {
    const uint8_t *base;
    KvStack kvs;
    int too_deep; /* the Python error set is the RecursionError of a value nested too deep */
} Ctx;

static int emit_object(Ctx *c, Buf *out, size_t base, int depth);

/* The JSON of an AnyValue at level `depth` (an attribute's value is level 1). */
static int emit_any(Ctx *c, Buf *out, AnyIter src, int depth)
{
    AnyInfo info;
    if (depth > MAX_VALUE_DEPTH) {
        c->too_deep = 1;
        PyErr_Format(PyExc_RecursionError, "the value at byte %zd", (Py_ssize_t)(src.outer.p - c->base));
        return -1;
    }
    if (resolve_any(src, &info) < 0)
        return -1;
    const Field *f = &info.last;
    switch (info.kind) {
    case AV_STRING: return put_json_str(out, f->data, f->len);
    case AV_BOOL: return f->u ? buf_put(out, "true", 4) : buf_put(out, "false", 5);
    case AV_INT: return put_int(out, (int64_t)f->u);
    case AV_DOUBLE: return put_double(out, as_double(f->u));
    case AV_BYTES:
        if (buf_putc(out, '"') < 0 || put_base64(out, f->data, f->len) < 0)
            return -1;
        return buf_putc(out, '"');
    case AV_STRINDEX: return put_int(out, (int32_t)(uint32_t)f->u);
    case AV_ARRAY: {
        ElemIter it = elem_iter(&info);
        Field elem;
        int rc, n = 0;
        if (buf_putc(out, '[') < 0)
            return -1;
        while ((rc = elem_next(&it, &elem)) > 0) {
            if ((n++ && buf_putc(out, ',') < 0) ||
                emit_any(c, out, any_iter(c->base, elem.data, elem.data + elem.len, 0), depth + 1) < 0)
                return -1;
        }
        return rc < 0 ? -1 : buf_putc(out, ']');
    }
    case AV_KVLIST: {
        size_t base = c->kvs.len;
        ElemIter it = elem_iter(&info);
        Field elem;
        int rc;
        while ((rc = elem_next(&it, &elem)) > 0)
            if (kv_push(&c->kvs, c->base, &elem) < 0)
                return -1;
        if (rc == 0)
            rc = emit_object(c, out, base, depth + 1);
        c->kvs.len = base;
        return rc;
    }
    default: return buf_put(out, "null", 4);
    }
}

/* A value under attribute kv nests too deep: name the attribute (the outermost one names it last). */
static void name_too_deep(const KeyValue *kv)
{
    PyErr_Clear();
    PyObject *key = utf8_str(kv->key, kv->key_len);
    if (key) {
        PyErr_Format(PyExc_RecursionError, "attribute %R", key);
        Py_DECREF(key);
    }
}

/* The JSON object of the key/values c->kvs[base:] (duplicate keys as in a Python dict), their values at
 * level `depth`. */
static int emit_object(Ctx *c, Buf *out, size_t base, int depth)
{
    size_t n = c->kvs.len - base, small[32];
    size_t *order = n <= 32 ? small : PyMem_Malloc(n * sizeof(size_t));
    if (!order) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t m = dedup_keys(c->kvs.items + base, n, order);
    int rc = m < 0 || buf_putc(out, '{') < 0 ? -1 : 0;
    for (Py_ssize_t k = 0; rc == 0 && k < m; k++) {
        KeyValue kv = c->kvs.items[base + order[k]]; /* a copy: nested lists may move the stack */
        if ((k && buf_putc(out, ',') < 0) || put_json_str(out, kv.key, kv.key_len) < 0 ||
            buf_putc(out, ':') < 0 || emit_any(c, out, any_iter(c->base, kv.start, kv.end, 2), depth) < 0) {
            rc = -1;
            if (c->too_deep)
                name_too_deep(&kv);
        }
    }
    if (order != small)
        PyMem_Free(order);
    return rc < 0 ? -1 : buf_putc(out, '}');
}

/* The value otlp_values.pb_value gives (used for the few attributes promoted to columns). */
static PyObject *any_to_py(const uint8_t *base, AnyIter src)
{
    AnyInfo info;
    if (resolve_any(src, &info) < 0)
        return NULL;
    const Field *f = &info.last;
    switch (info.kind) {
    case AV_STRING: return utf8_str(f->data, f->len);
    case AV_BOOL: return PyBool_FromLong(f->u != 0);
    case AV_INT: return PyLong_FromLongLong((long long)(int64_t)f->u);
    case AV_DOUBLE: return PyFloat_FromDouble(as_double(f->u));
    case AV_STRINDEX: return PyLong_FromLong((int32_t)(uint32_t)f->u);
    case AV_BYTES: {
        Buf b = {NULL, 0, 0};
        PyObject *out = put_base64(&b, f->data, f->len) < 0 ? NULL : buf_to_str(&b);
        PyMem_Free(b.data);
        return out;
    }
    case AV_ARRAY:
    case AV_KVLIST: {
        PyObject *out = info.kind == AV_ARRAY ? PyList_New(0) : PyDict_New();
        ElemIter it = elem_iter(&info);
        Field elem;
        int rc;
        while (out && (rc = elem_next(&it, &elem)) != 0) {
            KeyValue kv;
            PyObject *key = NULL, *value = NULL;
            if (rc < 0) {
                Py_CLEAR(out);
            } else if (info.kind == AV_ARRAY) {
                value = any_to_py(base, any_iter(base, elem.data, elem.data + elem.len, 0));
                if (!value || PyList_Append(out, value) < 0)
                    Py_CLEAR(out);
            } else if (kv_scan(base, elem.data, elem.len, &kv) < 0 || !(key = utf8_str(kv.key, kv.key_len)) ||
                       !(value = any_to_py(base, any_iter(base, kv.start, kv.end, 2))) ||
                       PyDict_SetItem(out, key, value) < 0) {
                Py_CLEAR(out);
            }
            Py_XDECREF(key);
            Py_XDECREF(value);
        }
        return out;
    }
    default: Py_RETURN_NONE;
    }
}

/* dict.get(key) on the attribute list c->kvs[base:]: None when absent. With a fallback key:
 * get(key, get(fallback)). */
static PyObject *attr_get(Ctx *c, size_t base, const char *key, const char *fallback)
{
    Py_ssize_t i = kv_find(&c->kvs, base, key);
    if (i < 0 && fallback)
        i = kv_find(&c->kvs, base, fallback);
    if (i < 0)
        Py_RETURN_NONE;
    const KeyValue *kv = &c->kvs.items[i];
    return any_to_py(c->base, any_iter(c->base, kv->start, kv->end, 2));
}

/* otlp_values.as_str; steals value. */
static PyObject *as_str(PyObject *value)
{
    if (!value || value == Py_None || PyUnicode_CheckExact(value))
        return value;
    PyObject *out = PyObject_Str(value);
    Py_DECREF(value);
    return out;
}

/* otlp_values.as_int; steals value. int() failing with OverflowError (float infinity) also gives None,
 * where the Python reference lets the OverflowError escape. */
static PyObject *as_int(PyObject *value)
{
    if (!value || value == Py_None)
        return value;
    PyObject *number = PyNumber_Long(value);
    Py_DECREF(value);
    if (!number) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError) &&
            !PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int overflow;
    PyLong_AsLongLongAndOverflow(number, &overflow);
    if (overflow) {
        Py_DECREF(number);
        Py_RETURN_NONE;
    }
    return number;
}

/* ---- pass 2: rows ------------------------------------------------------------------------------ */

enum Col {
    C_TRACE_ID, C_SPAN_ID, C_PARENT_SPAN_ID, C_TRACE_STATE, C_FLAGS, C_NAME, C_KIND, C_START_NS, C_END_NS,
    C_STATUS_CODE, C_STATUS_MESSAGE, C_ATTRIBUTES, C_RESOURCE, C_SCOPE_NAME, C_SCOPE_VERSION, C_EVENTS,
    C_LINKS, C_SERVICE_NAME, C_ROLLOUT_ID, C_TASK_ID, C_ATTEMPT, C_OPERATION_NAME, C_REQUEST_MODEL,
    C_RESPONSE_MODEL, C_INPUT_TOKENS, C_OUTPUT_TOKENS, C_RECEIVED_NS, C_RESPONSE_ID, C_AGENT_NAME, N_COLS
};

/* Must equal otlp.SPAN_SCHEMA.names (tests/test_otlp_fast.py checks). */
static const char *const COL_NAMES[N_COLS] = {
    "trace_id", "span_id", "parent_span_id", "trace_state", "flags", "name", "kind", "start_ns", "end_ns",
    "status_code", "status_message", "attributes", "resource", "scope_name", "scope_version", "events",
    "links", "service_name", "rollout_id", "task_id", "attempt", "operation_name", "request_model",
    "response_model", "input_tokens", "output_tokens", "received_ns", "response_id", "agent_name",
};
static const char *const SPAN_KINDS[] = {"UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER"};
static const char *const STATUS_CODES[] = {"UNSET", "OK", "ERROR"};

typedef struct {
    PyObject *json, *service_name, *rollout_id, *task_id, *attempt;
} Resource;

typedef struct {
    Ctx ctx;
    PyObject *cols[N_COLS];
    PyObject *errors, *received_ns;
    Py_ssize_t rejected;
    Buf attrs, events, links;
} Decoder;

typedef struct {
    Field trace_id, span_id, trace_state, parent, name, status_message;
    int32_t kind, status_code;
    uint64_t start, end, flags;
    size_t n_events, n_links;
    Field bad_link_id;                       /* the first invalid id of a link, */
    const char *bad_link_what, *bad_link_rule; /* which one it is (NULL: every link is valid) and its rule */
} Span;

static PyObject *enum_name(int32_t value, const char *const *names, int n_names)
{
    if (value >= 0 && value < n_names)
        return PyUnicode_FromString(names[value]);
    return PyUnicode_FromFormat("%d", (int)value);
}

static PyObject *clamp_ns(uint64_t ns)
{
    return PyLong_FromLongLong(ns > INT64_MAX ? INT64_MAX : (long long)ns);
}

static int valid_id(const Field *id, size_t n_bytes)
{
    if (id->len != n_bytes)
        return 0;
    for (size_t i = 0; i < n_bytes; i++)
        if (id->data[i])
            return 1;
    return 0;
}

#define TRACE_ID_RULE "32 hex digits (16 bytes), not all zero" /* otlp._ID_RULE */
#define SPAN_ID_RULE "16 hex digits (8 bytes), not all zero"

/* {"time_ns": ..., "name": ..., "attributes": {...}} appended to the JSON array d->events. */
static int emit_event(Decoder *d, const Field *event, size_t n_before)
{
    Reader r = {event->data, event->data + event->len, d->ctx.base};
    Field f, name = {0};
    uint64_t time_ns = 0;
    size_t base = d->ctx.kvs.len;
    int rc;
    while ((rc = next_field(&r, &f, 0)) > 0) {
        if (is_field(&f, 1, WT_I64))
            time_ns = f.u;
        else if (is_field(&f, 2, WT_LEN))
            name = f;
        else if (is_field(&f, 3, WT_LEN) && kv_push(&d->ctx.kvs, d->ctx.base, &f) < 0)
            rc = -1;
        if (rc < 0)
            break;
    }
    Buf *out = &d->events;
    if (rc == 0)
        rc = buf_putc(out, n_before ? ',' : '[') < 0 || buf_put(out, "{\"time_ns\":", 11) < 0 ||
             put_uint(out, time_ns) < 0 || buf_put(out, ",\"name\":", 8) < 0 ||
             put_json_str(out, name.data, name.len) < 0 || buf_put(out, ",\"attributes\":", 14) < 0 ||
             emit_object(&d->ctx, out, base, 1) < 0 || buf_putc(out, '}') < 0 ? -1 : 0;
    d->ctx.kvs.len = base;
    return rc;
}

/* {"trace_id": hex, "span_id": hex, "trace_state": ..., "attributes": {...}} appended to d->links; the
 * first invalid link id is noted in s. */
static int emit_link(Decoder *d, const Field *link, Span *s)
{
    size_t n_before = s->n_links++;
    Reader r = {link->data, link->data + link->len, d->ctx.base};
    Field f, trace_id = {0}, span_id = {0}, trace_state = {0};
    size_t base = d->ctx.kvs.len;
    int rc;
    while ((rc = next_field(&r, &f, 0)) > 0) {
        if (is_field(&f, 1, WT_LEN))
            trace_id = f;
        else if (is_field(&f, 2, WT_LEN))
            span_id = f;
        else if (is_field(&f, 3, WT_LEN))
            trace_state = f;
        else if (is_field(&f, 4, WT_LEN) && kv_push(&d->ctx.kvs, d->ctx.base, &f) < 0)
            rc = -1;
        if (rc < 0)
            break;
    }
    if (rc == 0 && !s->bad_link_what && !valid_id(&trace_id, 16)) {
        s->bad_link_what = "link trace id";
        s->bad_link_rule = TRACE_ID_RULE;
        s->bad_link_id = trace_id;
    } else if (rc == 0 && !s->bad_link_what && !valid_id(&span_id, 8)) {
        s->bad_link_what = "link span id";
        s->bad_link_rule = SPAN_ID_RULE;
        s->bad_link_id = span_id;
    }
    Buf *out = &d->links;
    if (rc == 0)
        rc = buf_putc(out, n_before ? ',' : '[') < 0 || buf_put(out, "{\"trace_id\":", 12) < 0 ||
             put_hex(out, trace_id.data, trace_id.len) < 0 || buf_put(out, ",\"span_id\":", 11) < 0 ||
             put_hex(out, span_id.data, span_id.len) < 0 || buf_put(out, ",\"trace_state\":", 15) < 0 ||
             put_json_str(out, trace_state.data, trace_state.len) < 0 ||
             buf_put(out, ",\"attributes\":", 14) < 0 || emit_object(&d->ctx, out, base, 1) < 0 ||
             buf_putc(out, '}') < 0 ? -1 : 0;
    d->ctx.kvs.len = base;
    return rc;
}

static int read_status(Decoder *d, const Field *status, Span *s)
{
    Reader r = {status->data, status->data + status->len, d->ctx.base};
    Field f;
    int rc;
    while ((rc = next_field(&r, &f, 0)) > 0) {
        if (is_field(&f, 2, WT_LEN))
            s->status_message = f;
        else if (is_field(&f, 3, WT_VARINT))
            s->status_code = (int32_t)(uint32_t)f.u;
    }
    return rc;
}

/* One pass over a Span: scalars (last wins), attributes onto the stack, events and links as JSON. */
static int read_span(Decoder *d, const Field *span, Span *s)
{
    Reader r = {span->data, span->data + span->len, d->ctx.base};
    Field f;
    int rc;
    while ((rc = next_field(&r, &f, 0)) > 0) {
        if (f.wt == WT_LEN) {
            switch (f.num) {
            case 1: s->trace_id = f; break;
            case 2: s->span_id = f; break;
            case 3: s->trace_state = f; break;
            case 4: s->parent = f; break;
            case 5: s->name = f; break;
            case 9: rc = kv_push(&d->ctx.kvs, d->ctx.base, &f); break;
            case 11: rc = emit_event(d, &f, s->n_events++); break;
            case 13: rc = emit_link(d, &f, s); break;
            case 15: rc = read_status(d, &f, s); break;
            }
        } else if (is_field(&f, 6, WT_VARINT)) {
            s->kind = (int32_t)(uint32_t)f.u;
        } else if (is_field(&f, 7, WT_I64)) {
            s->start = f.u;
        } else if (is_field(&f, 8, WT_I64)) {
            s->end = f.u;
        } else if (is_field(&f, 16, WT_I32)) {
            s->flags = f.u;
        }
        if (rc < 0)
            return -1;
    }
    return rc;
}

static int reject(Decoder *d, const Span *s, const Field *id, const char *what, const char *expected)
{
    d->rejected++;
    if (PyList_GET_SIZE(d->errors) >= MAX_ERRORS)
        return 0;
    PyObject *name = utf8_str(s->name.data, s->name.len);
    PyObject *hex = name ? hex_str(id->data, id->len) : NULL;
    PyObject *msg = hex ? PyUnicode_FromFormat("span %R: %s %R is not %s", name, what, hex, expected) : NULL;
    int rc = msg ? PyList_Append(d->errors, msg) : -1;
    Py_XDECREF(name);
    Py_XDECREF(hex);
    Py_XDECREF(msg);
    return rc;
}

/* A JSON array opened by emit_event/emit_link, or None when it has no items ("events or None"). */
static PyObject *json_array_or_none(Buf *b, size_t n_items)
{
    if (n_items == 0)
        Py_RETURN_NONE;
    return buf_putc(b, ']') < 0 ? NULL : buf_to_str(b);
}

/* The promoted columns: span attribute first, else the resource's (as _SpanColumns.add). */
static void promote(Decoder *d, size_t base, const Resource *res, PyObject **row)
{
    Ctx *c = &d->ctx;
    PyObject *rollout = attr_get(c, base, "lightning.rollout.id", NULL);
    PyObject *task = attr_get(c, base, "lightning.task.id", NULL);
    PyObject *attempt = attr_get(c, base, "lightning.attempt", NULL);
    if (rollout == Py_None) {
        Py_DECREF(rollout);
        rollout = Py_NewRef(res->rollout_id);
    }
    if (task == Py_None) {
        Py_DECREF(task);
        task = Py_NewRef(res->task_id);
    }
    if (attempt == Py_None) {
        Py_DECREF(attempt);
        attempt = Py_NewRef(res->attempt);
    }
    row[C_ROLLOUT_ID] = as_str(rollout);
    row[C_TASK_ID] = as_str(task);
    row[C_ATTEMPT] = as_int(attempt);
    row[C_OPERATION_NAME] = as_str(attr_get(c, base, "gen_ai.operation.name", "llm.request.type"));
    row[C_REQUEST_MODEL] = as_str(attr_get(c, base, "gen_ai.request.model", NULL));
    row[C_RESPONSE_MODEL] = as_str(attr_get(c, base, "gen_ai.response.model", NULL));
    row[C_INPUT_TOKENS] = as_int(attr_get(c, base, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"));
    row[C_OUTPUT_TOKENS] =
        as_int(attr_get(c, base, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"));
    row[C_RESPONSE_ID] = as_str(attr_get(c, base, "gen_ai.response.id", NULL));
}

/* ---- the agent, task or graph node a span stands for -------------------------------------------- */

static const char *const LLM_OR_TOOL_OPS[] = {"chat", "text_completion", "generate_content", "execute_tool", NULL};
static const char *const AGENT_KINDS[] = {"agent", "task", NULL};
static const char *const AGENT_OPS[] = {"invoke_agent", "create_agent", "execute_task", NULL};

static int str_in(PyObject *value, const char *const *names)
{
    if (!value || !PyUnicode_Check(value))
        return 0;
    for (; *names; names++)
        if (PyUnicode_CompareWithASCIIString(value, *names) == 0)
            return 1;
    return 0;
}

/* SQL `name LIKE '<pattern>%'`: pattern is ASCII, '_' matches any one character. */
static int like_prefix(PyObject *name, const char *pattern)
{
    Py_ssize_t n = (Py_ssize_t)strlen(pattern);
    if (PyUnicode_GET_LENGTH(name) < n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (pattern[i] != '_' && PyUnicode_READ_CHAR(name, i) != (Py_UCS4)(unsigned char)pattern[i])
            return 0;
    return 1;
}

/* name without the first of `affixes` it ends with (suffix) or starts with (prefix); a new reference. */
static PyObject *strip_affix(PyObject *name, const char *const *affixes, int suffix)
{
    Py_ssize_t len = PyUnicode_GET_LENGTH(name);
    for (; *affixes; affixes++) {
        PyObject *affix = PyUnicode_FromString(*affixes);
        if (!affix)
            return NULL;
        Py_ssize_t n = PyUnicode_GET_LENGTH(affix);
        Py_ssize_t match = n <= len ? PyUnicode_Tailmatch(name, affix, 0, len, suffix ? 1 : -1) : 0;
        Py_DECREF(affix);
        if (match < 0)
            return NULL;
        if (match)
            return suffix ? PyUnicode_Substring(name, 0, len - n) : PyUnicode_Substring(name, n, len);
    }
    return Py_NewRef(name);
}

static PyObject *first_set(PyObject *const *values, int n)
{
    for (int i = 0; i < n; i++)
        if (values[i] != Py_None)
            return values[i];
    return NULL;
}

/* agent_name_from (migration 0006) on the span's own attributes: the agent, task or graph node the span
 * stands for, or None. The SQL macro is the definition; otlp._agent_name is the Python twin, and
 * tests/test_trajectories.py checks both against it on recorded spans. */
static PyObject *agent_name(Ctx *c, size_t base, PyObject *name, PyObject *op)
{
    static const char *const SUFFIXES[] = {".agent", ".task", NULL};
    static const char *const PREFIXES[] = {"invoke_agent ", "execute_task ", "create_agent ", NULL};
    static const char *const KEYS[] = {"gen_ai.agent.name", "traceloop.span.kind", "crewai.agent.role",
                                       "traceloop.entity.name", "gen_ai.task.name"};
    PyObject *f[5] = {NULL};
    PyObject *out = NULL;
    for (int i = 0; i < 5; i++)
        if (!(f[i] = as_str(attr_get(c, base, KEYS[i], NULL))))
            goto done;
    PyObject *agent = f[0], *kind = f[1], *role = f[2], *entity = f[3], *task = f[4];
    if (agent != Py_None && !str_in(op, LLM_OR_TOOL_OPS)) {
        out = Py_NewRef(agent);
    } else if (str_in(kind, AGENT_KINDS)) {
        PyObject *order[] = {agent, role, entity, task};
        PyObject *pick = first_set(order, 4);
        out = pick ? Py_NewRef(pick) : strip_affix(name, SUFFIXES, 1);
    } else if (str_in(op, AGENT_OPS) || like_prefix(name, "invoke_agent ") || like_prefix(name, "execute_task ")) {
        PyObject *order[] = {agent, task, entity};
        PyObject *pick = first_set(order, 3);
        out = pick ? Py_NewRef(pick) : strip_affix(name, PREFIXES, 0);
    } else {
        out = Py_NewRef(Py_None);
    }
done:
    for (int i = 0; i < 5; i++)
        Py_XDECREF(f[i]);
    return out;
}

static int add_row(Decoder *d, const Span *s, size_t base, const Resource *res, PyObject *scope_name,
                   PyObject *scope_version)
{
    PyObject *row[N_COLS] = {NULL};
    int rc = 0;
    promote(d, base, res, row);
    row[C_TRACE_ID] = hex_str(s->trace_id.data, s->trace_id.len);
    row[C_SPAN_ID] = hex_str(s->span_id.data, s->span_id.len);
    row[C_PARENT_SPAN_ID] = s->parent.len ? hex_str(s->parent.data, s->parent.len) : Py_NewRef(Py_None);
    row[C_TRACE_STATE] = utf8_str_or_none(s->trace_state.data, s->trace_state.len);
    row[C_FLAGS] = PyLong_FromUnsignedLongLong(s->flags);
    row[C_NAME] = utf8_str(s->name.data, s->name.len);
    row[C_AGENT_NAME] = row[C_NAME] ? agent_name(&d->ctx, base, row[C_NAME], row[C_OPERATION_NAME]) : NULL;
    row[C_KIND] = enum_name(s->kind, SPAN_KINDS, 6);
    row[C_START_NS] = clamp_ns(s->start);
    row[C_END_NS] = clamp_ns(s->end);
    row[C_STATUS_CODE] = enum_name(s->status_code, STATUS_CODES, 3);
    row[C_STATUS_MESSAGE] = utf8_str_or_none(s->status_message.data, s->status_message.len);
    row[C_ATTRIBUTES] = buf_to_str(&d->attrs);
    row[C_RESOURCE] = Py_NewRef(res->json);
    row[C_SCOPE_NAME] = Py_NewRef(scope_name);
    row[C_SCOPE_VERSION] = Py_NewRef(scope_version);
    row[C_EVENTS] = json_array_or_none(&d->events, s->n_events);
    row[C_LINKS] = json_array_or_none(&d->links, s->n_links);
    row[C_SERVICE_NAME] = Py_NewRef(res->service_name);
    row[C_RECEIVED_NS] = Py_NewRef(d->received_ns);
    for (int i = 0; i < N_COLS; i++)
        if (!row[i] || (rc == 0 && PyList_Append(d->cols[i], row[i]) < 0))
            rc = -1;
    for (int i = 0; i < N_COLS; i++)
        Py_XDECREF(row[i]);
    return rc;
}

static int decode_span(Decoder *d, const Field *span, const Resource *res, PyObject *scope_name,
                       PyObject *scope_version)
{
    Span s;
    memset(&s, 0, sizeof s);
    size_t base = d->ctx.kvs.len;
    d->events.len = d->links.len = 0;
    int rc = read_span(d, span, &s);
    d->attrs.len = 0;
    /* The attributes first, as the reference builds them before it looks at the ids. */
    if (rc == 0)
        rc = emit_object(&d->ctx, &d->attrs, base, 1);
    if (rc == 0) {
        if (!valid_id(&s.trace_id, 16))
            rc = reject(d, &s, &s.trace_id, "trace id", TRACE_ID_RULE);
        else if (!valid_id(&s.span_id, 8))
            rc = reject(d, &s, &s.span_id, "span id", SPAN_ID_RULE);
        else if (s.parent.len && !valid_id(&s.parent, 8))
            rc = reject(d, &s, &s.parent, "parent span id", SPAN_ID_RULE);
        else if (s.bad_link_what)
            rc = reject(d, &s, &s.bad_link_id, s.bad_link_what, s.bad_link_rule);
        else
            rc = add_row(d, &s, base, res, scope_name, scope_version);
    }
    d->ctx.kvs.len = base;
    return rc;
}

static int decode_scope_spans(Decoder *d, const Field *scope_spans, const Resource *res)
{
    Reader r = {scope_spans->data, scope_spans->data + scope_spans->len, d->ctx.base};
    Field f, g, name = {0}, version = {0};
    int rc;
    /* The scope may follow the spans and may occur several times (merged: last name/version win). */
    while ((rc = next_field(&r, &f, 0)) > 0) {
        if (!is_field(&f, 1, WT_LEN))
            continue;
        Reader scope = sub_reader(&r, &f);
        while ((rc = next_field(&scope, &g, 0)) > 0) {
            if (is_field(&g, 1, WT_LEN))
                name = g;
            else if (is_field(&g, 2, WT_LEN))
                version = g;
        }
        if (rc < 0)
            return -1;
    }
    if (rc < 0)
        return -1;
    PyObject *scope_name = utf8_str_or_none(name.data, name.len);
    PyObject *scope_version = scope_name ? utf8_str_or_none(version.data, version.len) : NULL;
    rc = scope_version ? 0 : -1;
    r.p = scope_spans->data;
    while (rc == 0 && (rc = next_field(&r, &f, 0)) > 0)
        rc = is_field(&f, 2, WT_LEN) ? decode_span(d, &f, res, scope_name, scope_version) : 0;
    Py_XDECREF(scope_name);
    Py_XDECREF(scope_version);
    return rc;
}

/* The resource of a ResourceSpans: the attributes of all its resource occurrences, in order. */
static int read_resource(Decoder *d, const Field *resource_spans, Resource *res)
{
    Reader r = {resource_spans->data, resource_spans->data + resource_spans->len, d->ctx.base};
    Ctx *c = &d->ctx;
    size_t base = c->kvs.len;
    Field f, g;
    int rc;
    while ((rc = next_field(&r, &f, 0)) > 0) {
        if (!is_field(&f, 1, WT_LEN))
            continue;
        Reader resource = sub_reader(&r, &f);
        while ((rc = next_field(&resource, &g, 0)) > 0)
            if (is_field(&g, 1, WT_LEN) && kv_push(&c->kvs, c->base, &g) < 0)
                return -1;
        if (rc < 0)
            return -1;
    }
    d->attrs.len = 0;
    if (rc < 0 || emit_object(c, &d->attrs, base, 1) < 0 || !(res->json = buf_to_str(&d->attrs)))
        return -1;
    res->service_name = as_str(attr_get(c, base, "service.name", NULL));
    res->rollout_id = as_str(attr_get(c, base, "lightning.rollout.id", NULL));
    res->task_id = as_str(attr_get(c, base, "lightning.task.id", NULL));
    res->attempt = as_int(attr_get(c, base, "lightning.attempt", NULL));
    c->kvs.len = base;
    return res->service_name && res->rollout_id && res->task_id && res->attempt ? 0 : -1;
}

static int decode_resource_spans(Decoder *d, const Field *resource_spans)
{
    Resource res = {NULL, NULL, NULL, NULL, NULL};
    int rc = read_resource(d, resource_spans, &res);
    Reader r = {resource_spans->data, resource_spans->data + resource_spans->len, d->ctx.base};
    Field f;
    while (rc == 0 && (rc = next_field(&r, &f, 0)) > 0)
        rc = is_field(&f, 2, WT_LEN) ? decode_scope_spans(d, &f, &res) : 0;
    Py_XDECREF(res.json);
    Py_XDECREF(res.service_name);
    Py_XDECREF(res.rollout_id);
    Py_XDECREF(res.task_id);
    Py_XDECREF(res.attempt);
    return rc;
}

static PyObject *columns_dict(Decoder *d)
{
    PyObject *columns = PyDict_New();
    for (int i = 0; columns && i < N_COLS; i++)
        if (PyDict_SetItemString(columns, COL_NAMES[i], d->cols[i]) < 0)
            Py_CLEAR(columns);
    return columns;
}

static PyObject *decode_body(Decoder *d, const uint8_t *body, size_t len)
{
    Reader r = {body, body + len, body};
    Field f;
    int rc = validate(r, M_REQUEST, 0);
    while (rc == 0 && (rc = next_field(&r, &f, 0)) > 0)
        rc = is_field(&f, 1, WT_LEN) ? decode_resource_spans(d, &f) : 0;
    if (rc < 0)
        return NULL;
    PyObject *columns = columns_dict(d);
    if (!columns)
        return NULL;
    return Py_BuildValue("(NnO)", columns, d->rejected, d->errors);
}

static PyObject *decode_traces(PyObject *module, PyObject *args)
{
    Py_buffer body;
    PyObject *received_ns, *result = NULL;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*O!:decode_traces", &body, &PyLong_Type, &received_ns))
        return NULL;
    Decoder d;
    memset(&d, 0, sizeof d);
    d.ctx.base = body.buf;
    d.received_ns = received_ns;
    int ok = (d.errors = PyList_New(0)) != NULL;
    for (int i = 0; ok && i < N_COLS; i++)
        ok = (d.cols[i] = PyList_New(0)) != NULL;
    if (ok)
        result = decode_body(&d, body.buf, (size_t)body.len);
    for (int i = 0; i < N_COLS; i++)
        Py_XDECREF(d.cols[i]);
    Py_XDECREF(d.errors);
    PyMem_Free(d.ctx.kvs.items);
    PyMem_Free(d.attrs.data);
    PyMem_Free(d.events.data);
    PyMem_Free(d.links.data);
    PyBuffer_Release(&body);
    return result;
}

static PyMethodDef METHODS[] = {
    {"decode_traces", decode_traces, METH_VARARGS,
     "decode_traces(body, received_ns) -> (columns, rejected, errors)\n\n"
     "Decode a protobuf ExportTraceServiceRequest into the span store's columns, exactly as\n"
     "otlp.decode_traces_protobuf_python does. Raises ValueError on a malformed body, RecursionError\n"
     "naming the attribute on a value nested more than otlp_values.MAX_VALUE_DEPTH levels."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_otlp_fast", "C decoder of OTLP protobuf trace requests (see otlp.py).", 0, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__otlp_fast(void)
{
    return PyModule_Create(&MODULE);
}
