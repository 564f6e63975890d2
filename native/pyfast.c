/*
 * kvtier native fast path, CPython side: the two client calls whose Python overhead is as large
 * as the work they do (native/README.md, "pyfast.c"; docs/transport.md, "Small values").
 *
 *   IndexReader.get_into(key, dst)   a same-host lease-free read: probe the daemon's read index,
 *                                    seqlock-copy the chunk out of the mapped arena, check the
 *                                    daemon is alive, count and report the hit (~1 us at 4 KiB;
 *                                    the ctypes call alone cost as much as the copy).
 *   tcp_get(...)                     one small GET on a pooled data-plane connection: header and
 *                                    key in one send, header and value received straight into
 *                                    the caller's buffer, spinning briefly before sleeping.
 *
 * A CPython extension module (not ctypes) because the point is the call's own cost. It includes
 * fastpath.c so the read-index probe and the copier exist once (index_copy, copy_out, the frame
 * offsets); the plain library (ctypes, the daemon's loop) is built from the same file.
 *
 * Python stays the authority: each call either finishes the common case completely or returns
 * a code that sends the caller down its Python path, which makes every decision about errors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fastpath.c"

#include <poll.h>
#include <sched.h>
#include <sys/uio.h>
#include <time.h>

#define PYFAST_ABI 1  /* native.py: EXTENSION_ABI */
#define SPLIT_RECV_BYTES (128 << 10)  /* tcp_get: from this size, header and value apart */

/* IndexReader return codes (read_index.ReadResult, plus one of our own). */
#define RR_MISS (-1)
#define RR_CONFLICT (-2)
#define RR_DEAD (-3)
#define RR_UNSUPPORTED (-4) /* not tried: key not bytes, dst not a writable C-contiguous buffer */

/* --- IndexReader ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    int64_t cfg[CFG_COUNT];
    int64_t st[ST_COUNT];
    const uint32_t *owner;       /* the robust mutex's futex word in the index header */
    uint32_t owner_word;         /* its value while the daemon holds the index */
    int64_t max_key;
    int64_t gil_release_bytes;   /* copies at least this big run with the GIL released */
    int closed;
    PyObject *keepalive;         /* holds the mappings behind cfg's addresses */
    PyObject *append;            /* the read reporter's queue.append, or NULL */
    PyObject *queue;
    PyObject *wake;
    Py_ssize_t batch;
    long long hits, misses, conflicts;
} IndexReader;

static int reader_init(IndexReader *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"cfg", "owner_address", "owner_word", "max_key_bytes",
                             "gil_release_bytes", "keepalive", NULL};
    Py_buffer cfg;
    unsigned long long owner_address;
    unsigned int owner_word;
    long long max_key, gil_release;
    PyObject *keepalive;
    self->closed = 1;  /* until this succeeds: a failed (re-)init never reads */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*KILLO", kwlist, &cfg, &owner_address,
                                     &owner_word, &max_key, &gil_release, &keepalive))
        return -1;
    if (cfg.len != (Py_ssize_t)sizeof(self->cfg)) {
        PyBuffer_Release(&cfg);
        PyErr_Format(PyExc_ValueError, "cfg must be %d bytes", (int)sizeof(self->cfg));
        return -1;
    }
    memcpy(self->cfg, cfg.buf, sizeof(self->cfg));
    PyBuffer_Release(&cfg);
    if (self->cfg[CFG_ABI] != KVT_ABI || self->cfg[CFG_INDEX_SLOTS] < 1
            || (self->cfg[CFG_INDEX_SLOTS] & (self->cfg[CFG_INDEX_SLOTS] - 1))
            || self->cfg[CFG_ATTEMPTS] < 1 || max_key < 1 || max_key > 255 || owner_address == 0) {
        PyErr_SetString(PyExc_ValueError, "bad read-index configuration");
        return -1;
    }
    memset(self->st, 0, sizeof(self->st));
    self->owner = (const uint32_t *)(uintptr_t)owner_address;
    self->owner_word = owner_word;
    self->max_key = max_key;
    self->gil_release_bytes = gil_release;
    self->closed = 0;
    Py_INCREF(keepalive);
    Py_XSETREF(self->keepalive, keepalive);
    return 0;
}

static void reader_dealloc(IndexReader *self) {
    Py_CLEAR(self->append);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->wake);
    Py_CLEAR(self->keepalive);  /* last: may unmap what cfg points at */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Copy chunk `key` into `dst`: its size, or an RR_* code. */
static int64_t reader_copy(IndexReader *self, PyObject *key, PyObject *dst) {
    if (self->closed || !PyBytes_CheckExact(key))
        return self->closed ? RR_MISS : RR_UNSUPPORTED;
    Py_ssize_t klen = PyBytes_GET_SIZE(key);
    if (klen < 1 || klen > self->max_key) return RR_UNSUPPORTED;
    Py_buffer view;
    if (PyObject_GetBuffer(dst, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();  /* torch tensors, read-only or strided buffers: the Python path says */
        return RR_UNSUPPORTED;
    }
    const uint8_t *k = (const uint8_t *)PyBytes_AS_STRING(key);
    int64_t n;
    if (view.len >= self->gil_release_bytes) {
        Py_BEGIN_ALLOW_THREADS
        n = index_copy(self->cfg, self->st, k, (uint32_t)klen, view.len, view.buf, view.len,
                       NULL, 0, NULL);
        Py_END_ALLOW_THREADS
    } else {
        n = index_copy(self->cfg, self->st, k, (uint32_t)klen, view.len, view.buf, view.len,
                       NULL, 0, NULL);
    }
    PyBuffer_Release(&view);
    if (n >= 0) {
        /* read_index.py, "Liveness": a copy from a dead daemon's frozen mapping is never used */
        if (__atomic_load_n(self->owner, __ATOMIC_ACQUIRE) != self->owner_word) return RR_DEAD;
        return n;
    }
    return n == -1 ? RR_MISS : RR_CONFLICT;  /* -2 (size does not fit) and -3 (kept changing) */
}

static PyObject *reader_read_into(IndexReader *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_into(key, dst)");
        return NULL;
    }
    return PyLong_FromLongLong(reader_copy(self, args[0], args[1]));
}

/* read_into, plus what StoreClient does with a read: count it, queue the key for the read
 * reporter (waking it when a batch is full). */
static PyObject *reader_get_into(IndexReader *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get_into(key, dst)");
        return NULL;
    }
    int64_t n = reader_copy(self, args[0], args[1]);
    if (n >= 0) {
        self->hits++;
        if (self->append != NULL) {
            PyObject *res = PyObject_CallOneArg(self->append, args[0]);
            if (res == NULL) return NULL;
            Py_DECREF(res);
            if (PyObject_Size(self->queue) == self->batch) {
                res = PyObject_CallNoArgs(self->wake);
                if (res == NULL) return NULL;
                Py_DECREF(res);
            }
        }
    } else if (n == RR_MISS) {
        self->misses++;
    } else if (n == RR_CONFLICT) {
        self->conflicts++;
    }
    return PyLong_FromLongLong(n);
}

static PyObject *reader_set_report(IndexReader *self, PyObject *args) {
    PyObject *queue, *wake;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "OnO", &queue, &batch, &wake)) return NULL;
    PyObject *append = PyObject_GetAttrString(queue, "append");
    if (append == NULL) return NULL;
    if (!PyCallable_Check(wake)) {
        Py_DECREF(append);
        PyErr_SetString(PyExc_TypeError, "wake must be callable");
        return NULL;
    }
    Py_XSETREF(self->append, append);
    Py_INCREF(queue);
    Py_XSETREF(self->queue, queue);
    Py_INCREF(wake);
    Py_XSETREF(self->wake, wake);
    self->batch = batch;
    Py_RETURN_NONE;
}

static PyObject *reader_counters(IndexReader *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(LLLL)", self->hits, self->misses, self->conflicts,
                         (long long)self->st[ST_RETRIES]);
}

static PyObject *reader_close(IndexReader *self, PyObject *Py_UNUSED(ignored)) {
    self->closed = 1;  /* later calls miss; the mappings live until this object goes */
    Py_RETURN_NONE;
}

static PyMethodDef reader_methods[] = {
    {"read_into", (PyCFunction)(void (*)(void))reader_read_into, METH_FASTCALL,
     "read_into(key, dst) -> size, or a negative ReadResult (-4: not tried)"},
    {"get_into", (PyCFunction)(void (*)(void))reader_get_into, METH_FASTCALL,
     "read_into, counting the read and queueing its key for the read reporter"},
    {"set_report", (PyCFunction)reader_set_report, METH_VARARGS,
     "set_report(queue, batch, wake): where get_into reports hits"},
    {"counters", (PyCFunction)reader_counters, METH_NOARGS,
     "(hits, misses, conflicts, retries) of get_into / read_into"},
    {"close", (PyCFunction)reader_close, METH_NOARGS, "every later read misses"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier_native.IndexReader",
    .tp_basicsize = sizeof(IndexReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Lease-free reads through a daemon's read index (kvstore/dataplane/read_index.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)reader_init,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_methods = reader_methods,
};

/* --- tcp_get ---------------------------------------------------------------------------------- */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wait until fd is ready for `events`: spin (a non-blocking check and a yield of the CPU to any
 * runnable thread) until spin_until_ns, then sleep in poll up to timeout_ms. With
 * timeout_ms < 0 (a blocking fd with kernel timeouts) return once the spin is over: the caller
 * then sleeps in a blocking call. 0, or -1 with errno (ETIMEDOUT). */
static int wait_fd(int fd, short events, int64_t spin_until_ns, int timeout_ms) {
    struct pollfd pfd = {.fd = fd, .events = events, .revents = 0};
    while (spin_until_ns && now_ns() < spin_until_ns) {
        int ready = poll(&pfd, 1, 0);
        if (ready > 0) return 0;
        if (ready < 0 && errno != EINTR) return -1;
        sched_yield();
    }
    if (timeout_ms < 0) return 0;
    for (;;) {
        int ready = poll(&pfd, 1, timeout_ms);
        if (ready > 0) return 0;
        if (ready == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (errno != EINTR) return -1;
    }
}

/*
 * tcp_get(fd, request_id, key, dst, template, header, spin_ns, timeout_ms) -> int
 *
 * One GET of exactly len(dst) bytes on a connected stream socket. timeout_ms >= 0: how long to
 * sleep in poll for progress (any fd); timeout_ms < 0: the fd is blocking with kernel timeouts
 * (SO_RCVTIMEO / SO_SNDTIMEO, as TcpClient's), so after any spin it sleeps in the receive itself
 * (two system calls per get, as a bare socket pair). `template` is a 64-byte GET request header with magic, version and opcode set
 * (frames.py packs it); this fills in the key length, request id and sizes. The answer's header
 * lands in `header` (64 bytes), its payload in `dst`.
 *
 * Returns len(dst) when the answer was a plain OK of exactly that size (everything checked here),
 * otherwise -1 - got, where got is the bytes received so far (header first, then into dst): the
 * caller continues as after its own recvmsg_into and decides (a refusal, a short read, EOF).
 * Raises OSError for a failed send or receive, TimeoutError after timeout_ms without progress.
 */
static PyObject *py_tcp_get(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "tcp_get(fd, request_id, key, dst, template, header, spin_ns, timeout_ms)");
        return NULL;
    }
    int fd = _PyLong_AsInt(args[0]);
    unsigned long long request_id = PyLong_AsUnsignedLongLong(args[1]);
    long long spin_ns = PyLong_AsLongLong(args[6]);
    if (spin_ns > 10000000LL) spin_ns = 10000000LL;  /* at most 10 ms (TcpClientConfig's cap) */
    int timeout_ms = _PyLong_AsInt(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) < 1
            || PyBytes_GET_SIZE(args[2]) > 255) {
        PyErr_SetString(PyExc_ValueError, "key must be 1..255 bytes");
        return NULL;
    }
    Py_ssize_t klen = PyBytes_GET_SIZE(args[2]);
    Py_buffer tpl, hdr, dst;
    if (PyObject_GetBuffer(args[4], &tpl, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[5], &hdr, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&tpl);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&hdr);
        PyBuffer_Release(&tpl);
        return NULL;
    }
    if (tpl.len != FRAME_BYTES || hdr.len != FRAME_BYTES) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&hdr);
        PyBuffer_Release(&tpl);
        PyErr_SetString(PyExc_ValueError, "template and header must be 64 bytes");
        return NULL;
    }
    uint8_t req[FRAME_BYTES + 256];
    memcpy(req, tpl.buf, FRAME_BYTES);
    memcpy(req + FRAME_BYTES, PyBytes_AS_STRING(args[2]), (size_t)klen);
    const uint64_t size = (uint64_t)dst.len;
    st16(req + F_KEY_LEN, (uint16_t)klen);
    st64(req + F_REQUEST_ID, request_id);
    st64(req + F_LENGTH, size);
    st64(req + F_TOTAL_SIZE, size);
    uint8_t *h = hdr.buf, *out = dst.buf;
    size_t want = FRAME_BYTES + (size_t)size, got = 0, sent = 0, req_len = FRAME_BYTES + klen;
    int err = 0, verified = 0;

    Py_BEGIN_ALLOW_THREADS
    const int64_t spin_until = spin_ns > 0 ? now_ns() + spin_ns : 0;
    const int blocking = timeout_ms < 0;
    while (sent < req_len) {
        ssize_t n = send(fd, req + sent, req_len - sent,
                         MSG_NOSIGNAL | (blocking ? 0 : MSG_DONTWAIT));
        if (n >= 0) { sent += (size_t)n; continue; }
        if (errno == EINTR) continue;
        if (blocking && (errno == EAGAIN || errno == EWOULDBLOCK)) { err = ETIMEDOUT; break; }
        if ((errno != EAGAIN && errno != EWOULDBLOCK)
                || wait_fd(fd, POLLOUT, 0, timeout_ms) < 0) { err = errno; break; }
    }
    while (!err && got < want) {
        struct iovec iov[2];
        int iovcnt = 0;
        if (got < FRAME_BYTES) {
            iov[iovcnt++] = (struct iovec){h + got, FRAME_BYTES - got};
            /* Small values: header and value in one receive. Large ones: the header alone,
             * then the whole value with MSG_WAITALL (measured ~10-20% faster at 1 MiB here
             * than a first receive that returns with the first segments). */
            if (size && size < SPLIT_RECV_BYTES) iov[iovcnt++] = (struct iovec){out, (size_t)size};
        } else {
            iov[iovcnt++] = (struct iovec){out + (got - FRAME_BYTES), want - got};
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)iovcnt};
        const int sleep_here = blocking && (!spin_until || now_ns() >= spin_until);
        /* Once the header is checked, the rest is exactly the value: a sleeping receive waits
         * for all of it (MSG_WAITALL: one wake-up instead of one per arriving segment). */
        ssize_t n = recvmsg(fd, &msg, !sleep_here ? MSG_DONTWAIT
                                      : (verified || iovcnt == 1) ? MSG_WAITALL : 0);
        if (n > 0) {
            size_t before = got;
            got += (size_t)n;
            if (before < FRAME_BYTES && got >= FRAME_BYTES) {
                /* The answer's header: a plain OK answer to this request, or the caller's. */
                if (memcmp(h + F_MAGIC, req + F_MAGIC, 4) != 0 || h[F_VERSION] != req[F_VERSION]
                        || h[F_OPCODE] != req[F_OPCODE] || ld16(h + F_FLAGS) != 0
                        || ld16(h + F_STATUS) != 0 || ld16(h + F_KEY_LEN) != 0
                        || ld32(h + F_RESERVED) != 0 || ld64(h + F_REQUEST_ID) != request_id
                        || ld64(h + F_OFFSET) != 0 || ld64(h + F_PAYLOAD_LEN) != size
                        || ld64(h + F_LENGTH) != size || ld64(h + F_TOTAL_SIZE) != size)
                    break;
                verified = 1;
            }
            continue;
        }
        if (n == 0) break;  /* EOF: the caller's path reports it */
        if (errno == EINTR) continue;
        if (sleep_here && (errno == EAGAIN || errno == EWOULDBLOCK)) { err = ETIMEDOUT; break; }
        if ((errno != EAGAIN && errno != EWOULDBLOCK)
                || wait_fd(fd, POLLIN, spin_until, timeout_ms) < 0) { err = errno; break; }
    }
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&dst);
    PyBuffer_Release(&hdr);
    PyBuffer_Release(&tpl);
    if (err) {
        if (err == ETIMEDOUT) {
            PyErr_SetString(PyExc_TimeoutError, "timed out");
            return NULL;
        }
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (verified && got == want) return PyLong_FromUnsignedLongLong(size);
    return PyLong_FromLongLong(-1 - (long long)got);
}

static PyObject *py_xxh3_64(PyObject *mod, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h = XXH3_64bits(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef module_methods[] = {
    {"tcp_get", (PyCFunction)(void (*)(void))py_tcp_get, METH_FASTCALL,
     "one small GET on a data-plane connection (pyfast.c)"},
    {"xxh3_64", (PyCFunction)py_xxh3_64, METH_O, "XXH3_64bits of a buffer (tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvtier_native",
    "kvtier's native client calls (native/pyfast.c); loaded by kvstore.dataplane.native.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit_kvtier_native(void) {
    if (PyType_Ready(&IndexReaderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&IndexReaderType);
    if (PyModule_AddObject(m, "IndexReader", (PyObject *)&IndexReaderType) < 0
            || PyModule_AddIntConstant(m, "ABI", PYFAST_ABI) < 0
            || PyModule_AddIntConstant(m, "KVT_ABI", KVT_ABI) < 0
            || PyModule_AddIntConstant(m, "UNSUPPORTED", RR_UNSUPPORTED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
