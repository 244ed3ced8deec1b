/* ckptfix.core._scan: the NaN/Inf check fused into the copy (ckptfix/core/tensorcopy.py, filefill.py).

   An element of `width` bytes (1, 2, 4 or 8, little-endian) is NaN or Inf exactly when (x & mask) == value
   (tensorcopy's bit rules; mask 0: the kind has no such pattern, the copy checks nothing). Each function returns
   True when an element matched. The copies check each 64-byte block in registers between its load and its store:
   the check reads nothing a second time. With `stream`, the stores are non-temporal (AVX2 `vmovntdq`): they don't
   read the destination's old lines first, so a copy moves two bytes of memory per byte instead of three (the
   destination is not in the cache afterwards). The GIL is released for the work.

     copy(dst, src, width, mask, value, stream) -> bool      dst[:] = src, checked
     scan(src, width, mask, value) -> bool   the check alone
     widen_bf16(dst, src, check, stream) -> bool   bfloat16 src cast to float32 dst (each value's bits shifted left
                                                   16, as torch casts), checked on the way when `check`
     isa() -> str, set_isa(str) -> str        "avx2" where the CPU has it, else "portable" (tests force it)

   Built at install where a C compiler is (setup.py, optional); without it tensorcopy checks with numpy. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_KERNELS 1
#endif

static int use_avx2 = 0;

static inline uint64_t load_elem(const char *p, int width) {
    uint64_t x = 0;
    memcpy(&x, p, (size_t)width); /* little-endian: the element's value */
    return x;
}

/* The portable kernel: element by element (gcc vectorises the fixed-width loops). */
#define PORTABLE(T)                                                                                    \
    static int portable_##T(char *d, const char *s, size_t n, uint64_t m64, uint64_t v64) {          \
        const T m = (T)m64, v = (T)v64;                                                                \
        T bad = 0;                                                                                     \
        if (d != NULL)                                                                                 \
            memcpy(d, s, n * sizeof(T));                                                               \
        if (m != 0)                                                                                    \
            for (size_t i = 0; i < n; i++) {                                                           \
                T x;                                                                                   \
                memcpy(&x, s + i * sizeof(T), sizeof(T));                                              \
                bad |= (T)((x & m) == v);                                                              \
            }                                                                                          \
        return bad != 0;                                                                               \
    }
PORTABLE(uint8_t)
PORTABLE(uint16_t)
PORTABLE(uint32_t)
PORTABLE(uint64_t)

static int portable(char *d, const char *s, size_t nbytes, int width, uint64_t m, uint64_t v) {
    switch (width) {
    case 1: return portable_uint8_t(d, s, nbytes, m, v);
    case 2: return portable_uint16_t(d, s, nbytes / 2, m, v);
    case 4: return portable_uint32_t(d, s, nbytes / 4, m, v);
    default: return portable_uint64_t(d, s, nbytes / 8, m, v);
    }
}

#ifdef HAVE_AVX2_KERNELS
/* 64 bytes a step: two unaligned loads, each masked and compared in its lanes, two stores (streamed when asked and
   the destination is 32-byte aligned: the head is done element by element until it is). */
#define AVX2(W, SET1, CMPEQ)                                                                           \
    __attribute__((target("avx2"))) static int avx2_##W(char *d, const char *s, size_t nbytes,       \
                                                        uint64_t m, uint64_t v, int stream) {          \
        size_t i = 0;                                                                                  \
        int bad = 0;                                                                                   \
        if (d != NULL && stream)                                                                       \
            for (; i + W <= nbytes && ((uintptr_t)(d + i) & 31); i += W) {                             \
                uint64_t x = load_elem(s + i, W);                                                      \
                memcpy(d + i, s + i, W);                                                               \
                bad |= m != 0 && (x & m) == v;                                                         \
            }                                                                                          \
        const int streamed = d != NULL && stream && ((uintptr_t)(d + i) & 31) == 0;                   \
        const __m256i M = SET1(m), V = SET1(v);                                                        \
        __m256i B = _mm256_setzero_si256();                                                            \
        for (; i + 64 <= nbytes; i += 64) {                                                            \
            __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));                                  \
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));                             \
            B = _mm256_or_si256(B, CMPEQ(_mm256_and_si256(a, M), V));                                  \
            B = _mm256_or_si256(B, CMPEQ(_mm256_and_si256(b, M), V));                                  \
            if (streamed) {                                                                            \
                _mm256_stream_si256((__m256i *)(d + i), a);                                            \
                _mm256_stream_si256((__m256i *)(d + i + 32), b);                                       \
            } else if (d != NULL) {                                                                    \
                _mm256_storeu_si256((__m256i *)(d + i), a);                                            \
                _mm256_storeu_si256((__m256i *)(d + i + 32), b);                                       \
            }                                                                                          \
        }                                                                                              \
        for (; i + W <= nbytes; i += W) {                                                              \
            uint64_t x = load_elem(s + i, W);                                                          \
            if (d != NULL)                                                                             \
                memcpy(d + i, s + i, W);                                                               \
            bad |= (x & m) == v;                                                                       \
        }                                                                                              \
        if (streamed)                                                                                  \
            _mm_sfence();                                                                              \
        return bad || (m != 0 && !_mm256_testz_si256(B, B));                                           \
    }
AVX2(1, _mm256_set1_epi8, _mm256_cmpeq_epi8)
AVX2(2, _mm256_set1_epi16, _mm256_cmpeq_epi16)
AVX2(4, _mm256_set1_epi32, _mm256_cmpeq_epi32)
AVX2(8, _mm256_set1_epi64x, _mm256_cmpeq_epi64)
#endif

/* d may be NULL (the check alone); nbytes is a multiple of width. With mask 0 nothing matches: a plain copy. */
static int kernel(char *d, const char *s, size_t nbytes, int width, uint64_t m, uint64_t v, int stream) {
    if (m == 0)
        v = 1; /* (x & 0) == 1 never holds */
#ifdef HAVE_AVX2_KERNELS
    if (use_avx2) {
        switch (width) {
        case 1: return avx2_1(d, s, nbytes, (uint8_t)m, (uint8_t)v, stream);
        case 2: return avx2_2(d, s, nbytes, (uint16_t)m, (uint16_t)v, stream);
        case 4: return avx2_4(d, s, nbytes, (uint32_t)m, (uint32_t)v, stream);
        default: return avx2_8(d, s, nbytes, m, v, stream);
        }
    }
#endif
    (void)stream;
    return portable(d, s, nbytes, width, m, v);
}

/* bfloat16 -> float32: the 16 bits become the high half (torch's cast, NaN payloads kept); NaN/Inf when the exponent
   bits are all ones. The portable kernel element by element; the AVX2 one 16 elements a step (two zero-extending
   loads, a shift, a compare), the stores streamed when asked once the destination is 32-byte aligned. */
static int portable_widen(char *d, const char *s, size_t n) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t x;
        memcpy(&x, s + 2 * i, 2);
        uint32_t y = (uint32_t)x << 16;
        memcpy(d + 4 * i, &y, 4);
        bad |= (uint32_t)((y & 0x7F800000u) == 0x7F800000u);
    }
    return bad != 0;
}

#ifdef HAVE_AVX2_KERNELS
__attribute__((target("avx2"))) static int avx2_widen(char *d, const char *s, size_t n, int stream) {
    size_t i = 0;
    int bad = 0;
    if (stream)
        for (; i < n && ((uintptr_t)(d + 4 * i) & 31); i++)
            bad |= portable_widen(d + 4 * i, s + 2 * i, 1);
    const int streamed = stream && ((uintptr_t)(d + 4 * i) & 31) == 0;
    const __m256i M = _mm256_set1_epi32(0x7F800000);
    __m256i B = _mm256_setzero_si256();
    for (; i + 16 <= n; i += 16) {
        __m256i a = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 2 * i))), 16);
        __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 2 * i + 16))), 16);
        B = _mm256_or_si256(B, _mm256_cmpeq_epi32(_mm256_and_si256(a, M), M));
        B = _mm256_or_si256(B, _mm256_cmpeq_epi32(_mm256_and_si256(b, M), M));
        if (streamed) {
            _mm256_stream_si256((__m256i *)(d + 4 * i), a);
            _mm256_stream_si256((__m256i *)(d + 4 * i + 32), b);
        } else {
            _mm256_storeu_si256((__m256i *)(d + 4 * i), a);
            _mm256_storeu_si256((__m256i *)(d + 4 * i + 32), b);
        }
    }
    if (i < n)
        bad |= portable_widen(d + 4 * i, s + 2 * i, n - i);
    if (streamed)
        _mm_sfence();
    return bad || !_mm256_testz_si256(B, B);
}
#endif

static int check_width(int width, Py_ssize_t nbytes) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8, not %d", width);
        return -1;
    }
    if (nbytes % width) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole elements of %d bytes", nbytes, width);
        return -1;
    }
    return 0;
}

static PyObject *scan_copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    int width, stream;
    unsigned long long mask, value;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*iKKp", &dst, &src, &width, &mask, &value, &stream))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len)
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into %zd", src.len, dst.len);
    else if (check_width(width, dst.len) == 0) {
        int bad;
        Py_BEGIN_ALLOW_THREADS
        bad = kernel((char *)dst.buf, (const char *)src.buf, (size_t)dst.len, width, mask, value, stream);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(bad);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *scan_scan(PyObject *self, PyObject *args) {
    Py_buffer src;
    int width;
    unsigned long long mask, value;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iKK", &src, &width, &mask, &value))
        return NULL;
    PyObject *result = NULL;
    if (check_width(width, src.len) == 0) {
        int bad;
        Py_BEGIN_ALLOW_THREADS
        bad = kernel(NULL, (const char *)src.buf, (size_t)src.len, width, mask, value, 0);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(bad);
    }
    PyBuffer_Release(&src);
    return result;
}

static PyObject *scan_widen_bf16(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    int check, stream;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*pp", &dst, &src, &check, &stream))
        return NULL;
    PyObject *result = NULL;
    if (src.len % 2 || dst.len != 2 * src.len)
        PyErr_Format(PyExc_ValueError, "%zd bytes of bfloat16 widen into %zd bytes, not %zd", src.len,
                     src.len % 2 ? (Py_ssize_t)-1 : 2 * src.len, dst.len);
    else {
        int bad;
        size_t n = (size_t)src.len / 2;
        Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_AVX2_KERNELS
        bad = use_avx2 ? avx2_widen((char *)dst.buf, (const char *)src.buf, n, stream)
                       : portable_widen((char *)dst.buf, (const char *)src.buf, n);
#else
        bad = portable_widen((char *)dst.buf, (const char *)src.buf, n);
#endif
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(check && bad);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *scan_isa(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(use_avx2 ? "avx2" : "portable");
}

static int cpu_has_avx2(void) {
#ifdef HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static PyObject *scan_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    PyObject *before = PyUnicode_FromString(use_avx2 ? "avx2" : "portable");
    if (strcmp(name, "portable") == 0)
        use_avx2 = 0;
    else if (strcmp(name, "avx2") == 0 && cpu_has_avx2())
        use_avx2 = 1;
    else {
        Py_XDECREF(before);
        return PyErr_Format(PyExc_ValueError, "no %s kernels here", name);
    }
    return before;
}

static PyMethodDef methods[] = {
    {"copy", scan_copy, METH_VARARGS, "copy(dst, src, width, mask, value, stream) -> any element NaN/Inf"},
    {"scan", scan_scan, METH_VARARGS, "scan(src, width, mask, value) -> any element NaN/Inf"},
    {"widen_bf16", scan_widen_bf16, METH_VARARGS, "widen_bf16(dst, src, check, stream) -> any element NaN/Inf"},
    {"isa", scan_isa, METH_NOARGS, "isa() -> the kernels in use"},
    {"set_isa", scan_set_isa, METH_VARARGS, "set_isa(name) -> the kernels used before"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__scan(void) {
    use_avx2 = cpu_has_avx2();
    return PyModule_Create(&module);
}
