/* The AddressSanitizer/UBSan build of span_store/_otlp_fast.c (`make test-asan`; -I names the folder that
 * holds the decoder, so a modified copy builds the same way).
 *
 * CPython serves PyMem_Malloc requests up to 512 bytes from its own arenas (pymalloc), where ASan sees no
 * bounds: a write past the end of a small output buffer would go unnoticed. PYTHONMALLOC=malloc would
 * route the whole interpreter through ASan's allocator, which makes the tests about three times slower,
 * so only the decoder's own allocations move to malloc here. The decoder frees one block it did not
 * allocate (PyOS_double_to_string's), which is copied into malloc'd memory first.
 */
#include <Python.h>
#include <stdlib.h>
#include <string.h>

static char *double_to_string_malloc(double d, char code, int precision, int flags, int *type)
{
    char *text = PyOS_double_to_string(d, code, precision, flags, type);
    if (!text)
        return NULL;
    char *copy = strdup(text);
    PyMem_Free(text);
    if (!copy)
        PyErr_NoMemory();
    return copy;
}

#define PyOS_double_to_string double_to_string_malloc
#define PyMem_Malloc malloc
#define PyMem_Calloc calloc
#define PyMem_Realloc realloc
#define PyMem_Free free

#include "_otlp_fast.c"
