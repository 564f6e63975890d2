/*
 * kvtier native fast path: the TCP server's small-GET loop (docs/transport.md, "The native
 * small-GET loop"; native/README.md).
 *
 * Plain C, no Python headers: loaded with ctypes.CDLL (which releases the GIL for each call) by
 * kvstore/dataplane/native.py. Python stays the authority: this loop serves only GETs whose
 * answer is a plain copy of a chunk published in the daemon's read index, and hands every other
 * frame back (kvt_serve returns KVT_SLOW with the buffer positions at that frame's header).
 *
 * Two layouts meet here:
 *   - the read index (kvstore/dataplane/read_index.py, owned elsewhere): its header size, slot
 *     size and field offsets arrive in cfg[] from Python at start, never hard-coded here;
 *   - the data-plane frame (kvstore/dataplane/transport/frames.py): the fixed 64-byte header
 *     whose field offsets are below; magic, version, opcode and flag values arrive in cfg[].
 *
 * Memory ordering: the read index's seqlock protocol (read_index.py, "Memory ordering"; x86-64
 * TSO). Loads of seq, the fields and the key are acquire loads; an acquire fence separates the
 * copy from the second load of seq, so the compiler cannot sink a load of the copy below it.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

#include <errno.h>
#include <immintrin.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>

#define KVT_ABI 6  /* native.py: ABI; bump with any cfg[]/st[]/signature change */

/* cfg[] indexes (mirrored by kvstore/dataplane/native.py: _CFG_*). */
enum {
    CFG_ABI = 0,
    CFG_ARENA_ADDR, CFG_ARENA_BYTES,
    CFG_INDEX_ADDR, CFG_INDEX_SLOTS, CFG_INDEX_HEADER_BYTES, CFG_SLOT_BYTES,
    CFG_SEQ_AT, CFG_OFFSET_AT, CFG_SIZE_AT, CFG_STATE_AT, CFG_KLEN_AT, CFG_KEY_AT,
    CFG_STATE_LIVE, CFG_STATE_EMPTY, CFG_MAX_KEY_BYTES,
    CFG_FRAME_MAGIC, CFG_FRAME_VERSION, CFG_OP_GET, CFG_FLAG_ANY_SIZE, CFG_FLAG_MORE,
    CFG_COPY_READ_MAX, CFG_MAX_VALUE_BYTES, CFG_ATTEMPTS,
    CFG_RING_ENTRIES, CFG_RING_ENTRY_BYTES, CFG_DRAIN_WAIT_MS, CFG_RECV_TICK_US,
    CFG_HEADER_TIMEOUT_NS,
    CFG_TAG_LO_AT, CFG_TAG_HI_AT, CFG_OWNER_CHECK, CFG_OWNER_A, CFG_OWNER_B,
    CFG_COUNT
};

/* st[] indexes: per-connection state and counters (native.py: _ST_*). */
enum {
    ST_RPOS = 0,     /* in/out: first unparsed byte of rbuf */
    ST_REND,         /* in/out: end of received bytes in rbuf */
    ST_LAST_FLAGS,   /* in/out: flags of the last request served (MORE: the next is announced) */
    ST_GETS,         /* counter: GETs answered here */
    ST_BYTES_SENT,   /* counter: payload bytes sent by those answers */
    ST_RING_COUNT,   /* hit-ring entries not yet drained by Python */
    ST_RETRIES,      /* counter: copies retried because the slot changed */
    ST_FALLBACKS,    /* counter: hits handed back to Python after the retries ran out */
    ST_ERRNO,        /* errno of KVT_RECV_ERROR / KVT_SEND_ERROR */
    ST_SENT,         /* bytes of the failed response that were sent (KVT_SEND_ERROR) */
    ST_SHORT_TICK,   /* the socket's receive timeout is drain_wait_ms now (not the tick) */
    ST_FRAME_CLOCK,  /* in/out: CLOCK_MONOTONIC ns when the frame at rpos was first seen partial
                      * (its header_timeout_s runs from there), 0: not timed; the caller takes
                      * it over after any return but KVT_RING */
    ST_VERIFIED_ADDR,   /* in: a tenant-scoped connection's table of verified publishes (0:
                         * unscoped, every published chunk is served); see index_copy */
    ST_VERIFIED_MASK,   /* in: the table's entries - 1 (a power of two) */
    ST_DECLINED_SLOT,   /* out: slot + 1 of the hit handed back for want of verification
                         * (KVT_SLOW), 0: none; Python resets it */
    ST_DECLINED_SEQ,    /* out: that slot's seq when it was read */
    ST_COUNT
};

/* Return codes (native.py: NativeReturn). */
enum {
    KVT_SLOW = 1,        /* a complete header at rpos that Python must serve */
    KVT_IDLE = 2,        /* rbuf needs bytes and none came within the receive tick (or closing) */
    KVT_EOF = 3,         /* the peer closed (rpos..rend may hold a partial frame) */
    KVT_RING = 4,        /* the hit ring needs draining (half full, or the peer went quiet) */
    KVT_RECV_ERROR = 5,  /* recv failed: st[ST_ERRNO] */
    KVT_SEND_ERROR = 6,  /* send failed or timed out: st[ST_ERRNO] */
    KVT_BAD_CONFIG = 7,
    KVT_HEADER_TIMEOUT = 8  /* the frame at rpos was not whole cfg[CFG_HEADER_TIMEOUT_NS] after
                             * ST_FRAME_CLOCK while bytes kept trickling in */
};

/* The frame header (frames.py). */
#define FRAME_BYTES 64
#define F_MAGIC 0
#define F_VERSION 4
#define F_OPCODE 5
#define F_FLAGS 6
#define F_STATUS 8
#define F_KEY_LEN 10
#define F_RESERVED 12
#define F_REQUEST_ID 16
#define F_TRANSFER_ID 24
#define F_OFFSET 32
#define F_LENGTH 40
#define F_TOTAL_SIZE 48
#define F_PAYLOAD_LEN 56

static inline uint16_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t ld64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void st16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void st32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void st64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static inline uint64_t aload64(const uint8_t *p) {
    return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
}
static inline uint8_t aload8(const uint8_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline uint16_t aload16(const uint8_t *p) {
    return __atomic_load_n((const uint16_t *)p, __ATOMIC_ACQUIRE);
}
static inline uint32_t aload32(const uint8_t *p) {
    return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE);
}

int kvt_abi(void) { return KVT_ABI; }

uint64_t kvt_xxh3_64(const void *data, size_t len) { return XXH3_64bits(data, len); }

/* Copy out of the arena. glibc's memcpy (rep movsb on this class of CPU) runs at about half
 * speed for 4 KiB - 1 MiB copies when the destination's offset within a page differs from the
 * source's: arena chunks start on a page boundary, engine buffers rarely do (measured: 64 KiB
 * 8.3-8.7 us at a 16-byte offset, 4.3 us with this loop, 3.2-4.7 us for glibc when aligned). */
__attribute__((target("avx2")))
static void copy_avx2(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t i = (32 - ((uintptr_t)dst & 31)) & 31;  /* align the stores */
    if (i > n) i = n;
    memcpy(dst, src, i);
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_store_si256((__m256i *)(dst + i), a);
        _mm256_store_si256((__m256i *)(dst + i + 32), b);
        _mm256_store_si256((__m256i *)(dst + i + 64), c);
        _mm256_store_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
}

static void copy_out(uint8_t *dst, const uint8_t *src, size_t n) {
    static int avx2 = -1;
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (avx2 && n >= 4096 && n <= ((size_t)1 << 20)
            && (((uintptr_t)dst ^ (uintptr_t)src) & 4095) != 0)
        copy_avx2(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* Copy chunk `key` out of the arena into dst (room for cap bytes). Returns its size, -1 when
 * not published (miss), -2 when its size does not fit `want` (want < 0: any size <= cap), -3
 * when the slot kept changing (conflict), -4 when `verified` is given and does not hold this
 * publish (then declined[0] = slot + 1, declined[1] = its seq).
 *
 * Owner tags (read_index.py, "Owners"): with cfg[CFG_OWNER_CHECK], a slot whose 48-bit owner
 * tag (low 16 bits at CFG_TAG_LO_AT, high 32 at CFG_TAG_HI_AT) is neither cfg[CFG_OWNER_A] nor
 * cfg[CFG_OWNER_B] is a miss (another tenant's chunk: the caller's leased path refuses it).
 *
 * Tenant-scoped connections (verified != NULL): the read index knows no tenant, so such a
 * connection serves only publishes Python verified for its tenant: `verified` is a direct-mapped
 * table of (slot + 1, seq) pairs indexed by slot & vmask, shared by the tenant's connections.
 * A slot's seq changes with every write to it and never repeats, so one (slot, seq) names one
 * publish of one chunk, whose owner never changes: a chunk removed and replaced by another
 * tenant's is another publish, absent from the table, and goes to Python
 * (kvstore/dataplane/transport/tcp/server.py, "Tenants"). Python writes an entry as
 * word 0 = 0, word 1 = seq, word 0 = slot + 1 (writers serialized by a lock; x86-64 keeps stores
 * in order); reading word 0, word 1, word 0 again and taking the pair only when both reads of
 * word 0 agree never takes one entry's slot with another's seq. */
static int64_t index_copy(const int64_t *cfg, int64_t *st, const uint8_t *key, uint32_t klen,
                          int64_t want, uint8_t *dst, int64_t cap, const uint64_t *verified,
                          uint64_t vmask, int64_t *declined) {
    const uint8_t *index = (const uint8_t *)(uintptr_t)cfg[CFG_INDEX_ADDR];
    const uint8_t *arena = (const uint8_t *)(uintptr_t)cfg[CFG_ARENA_ADDR];
    const uint64_t arena_bytes = (uint64_t)cfg[CFG_ARENA_BYTES];
    const uint64_t slots = (uint64_t)cfg[CFG_INDEX_SLOTS], mask = slots - 1;
    const int64_t hdr = cfg[CFG_INDEX_HEADER_BYTES], slot_bytes = cfg[CFG_SLOT_BYTES];
    const int64_t seq_at = cfg[CFG_SEQ_AT], off_at = cfg[CFG_OFFSET_AT];
    const int64_t size_at = cfg[CFG_SIZE_AT], state_at = cfg[CFG_STATE_AT];
    const int64_t klen_at = cfg[CFG_KLEN_AT], key_at = cfg[CFG_KEY_AT];
    const uint8_t live = (uint8_t)cfg[CFG_STATE_LIVE], empty = (uint8_t)cfg[CFG_STATE_EMPTY];
    const uint64_t start = XXH3_64bits(key, klen) & mask;
    for (int64_t attempt = 0; attempt < cfg[CFG_ATTEMPTS]; attempt++) {
        uint64_t i = start;
        int torn = 0;
        for (uint64_t probe = 0; probe < slots; probe++, i = (i + 1) & mask) {
            const uint8_t *slot = index + hdr + (int64_t)i * slot_bytes;
            uint64_t seq = aload64(slot + seq_at);
            if (seq & 1) { torn = 1; break; }
            uint8_t state = aload8(slot + state_at);
            if (state == empty) return -1;
            if (state != live) continue;
            if (aload8(slot + klen_at) != klen) continue;
            uint8_t k[256];
            for (uint32_t j = 0; j < klen; j++) k[j] = aload8(slot + key_at + j);
            if (memcmp(k, key, klen) != 0) continue;
            if (cfg[CFG_OWNER_CHECK]) {
                const int64_t tag = (int64_t)aload16(slot + cfg[CFG_TAG_LO_AT])
                    | ((int64_t)aload32(slot + cfg[CFG_TAG_HI_AT]) << 16);
                if (tag != cfg[CFG_OWNER_A] && tag != cfg[CFG_OWNER_B]) return -1;
            }
            uint64_t offset = aload64(slot + off_at), size = aload64(slot + size_at);
            if (aload64(slot + seq_at) != seq) { torn = 1; break; }
            if (verified) {
                const uint64_t *v = verified + 2 * (i & vmask);
                const uint64_t v_slot = __atomic_load_n(&v[0], __ATOMIC_ACQUIRE);
                const uint64_t v_seq = __atomic_load_n(&v[1], __ATOMIC_ACQUIRE);
                if (v_slot != i + 1 || v_seq != seq
                        || __atomic_load_n(&v[0], __ATOMIC_ACQUIRE) != v_slot) {
                    declined[0] = (int64_t)(i + 1);
                    declined[1] = (int64_t)seq;
                    return -4;
                }
            }
            if ((want >= 0 && size != (uint64_t)want) || size > (uint64_t)cap
                    || offset > arena_bytes || size > arena_bytes - offset)
                return -2;
            copy_out(dst, arena + offset, size);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (aload64(slot + seq_at) != seq) { torn = 1; break; }
            return (int64_t)size;
        }
        if (!torn) return -1;  /* a full circle without an empty slot */
        st[ST_RETRIES]++;
    }
    return -3;
}

/* Exported for tests: the loop's lookup and copy alone. */
int64_t kvt_index_read(const int64_t *cfg, int64_t *st, const uint8_t *key, uint32_t klen,
                       int64_t want, uint8_t *dst, int64_t cap) {
    if (cfg[CFG_ABI] != KVT_ABI || klen == 0 || klen > 255) return -1;
    return index_copy(cfg, st, key, klen, want, dst, cap, NULL, 0, NULL);
}

static int send_all(int fd, const uint8_t *buf, size_t n, int flags, int64_t *st) {
    size_t sent = 0;
    while (sent < n) {
        ssize_t got = send(fd, buf + sent, n - sent, flags | MSG_NOSIGNAL);
        if (got < 0) {
            if (errno == EINTR) continue;
            st[ST_ERRNO] = errno;
            st[ST_SENT] = (int64_t)sent;
            return -1;
        }
        sent += (size_t)got;
    }
    return 0;
}

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* vDSO: no system call; time.monotonic()'s clock */
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int set_rcvtimeo(int fd, int64_t us) {
    struct timeval tv = {.tv_sec = (time_t)(us / 1000000), .tv_usec = (suseconds_t)(us % 1000000)};
    return setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

/* Have at least `need` unparsed bytes at rpos (compacting when they would not fit). Returns 0,
 * or a KVT_* code to return with. Waits for the socket's receive tick (SO_RCVTIMEO: KVT_IDLE),
 * but while the hit ring holds keys, at most drain_wait_ms (KVT_RING: Python accounts them
 * while the peer is quiet, so hits land within about that long of their answers). That shorter
 * wait is the socket's receive timeout too, switched when the ring gets its first key and back
 * by kvt_serve before it returns (two setsockopt per drain instead of a poll per request: a
 * poll before each receive cost ~2 us per 4 KiB GET here).
 * A frame partly in rbuf is on the clock (ST_FRAME_CLOCK, started at the first receive it
 * needs after its first bytes, as Python's _fill does): before each further receive the clock
 * is read, and once header_timeout_ns passed the loop returns KVT_HEADER_TIMEOUT, so bytes
 * trickling in within a tick each cannot hold the connection. A frame that arrives whole with
 * the receive that brought its first bytes reads no clock. */
static int fill(int fd, int64_t *st, uint8_t *rbuf, int64_t rbuf_bytes, int64_t need,
                int drain_wait_ms, int64_t header_timeout_ns, const volatile int32_t *closing) {
    int64_t rpos = st[ST_RPOS], rend = st[ST_REND];
    if (rend - rpos >= need) return 0;
    if (rpos == rend) {
        rpos = rend = 0;
    } else if (rpos + need > rbuf_bytes) {
        memmove(rbuf, rbuf + rpos, (size_t)(rend - rpos));
        rend -= rpos;
        rpos = 0;
    }
    st[ST_RPOS] = rpos;
    st[ST_REND] = rend;
    while (rend - rpos < need) {
        if (rend > rpos) {  /* a partial frame */
            const int64_t now = monotonic_ns();
            if (!st[ST_FRAME_CLOCK])
                st[ST_FRAME_CLOCK] = now;
            else if (now - st[ST_FRAME_CLOCK] >= header_timeout_ns)
                return KVT_HEADER_TIMEOUT;
        }
        int flags = 0;
        if (*closing) {
            flags = MSG_DONTWAIT;
        } else if (st[ST_RING_COUNT] > 0 && !st[ST_SHORT_TICK]) {
            if (set_rcvtimeo(fd, (int64_t)drain_wait_ms * 1000) == 0) {
                st[ST_SHORT_TICK] = 1;
            } else {  /* cannot switch: wait in poll first, as before */
                struct pollfd pfd = {.fd = fd, .events = POLLIN, .revents = 0};
                int ready = poll(&pfd, 1, drain_wait_ms);
                if (ready == 0) return KVT_RING;
                if (ready < 0 && errno == EINTR) continue;
            }
        }
        ssize_t got = recv(fd, rbuf + rend, (size_t)(rbuf_bytes - rend), flags);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return (st[ST_SHORT_TICK] && !*closing) ? KVT_RING : KVT_IDLE;
            st[ST_ERRNO] = errno;
            return KVT_RECV_ERROR;
        }
        if (got == 0) return KVT_EOF;
        rend += got;
        st[ST_REND] = rend;
    }
    return 0;
}

/*
 * Serve GETs from rbuf and the socket until something needs Python (return codes above).
 * rbuf: the connection's receive buffer (rbuf_bytes); out: the send buffer (a frame header and
 * up to cfg[CFG_COPY_READ_MAX] bytes); ring: cfg[CFG_RING_ENTRIES] entries of
 * cfg[CFG_RING_ENTRY_BYTES] (a key-length byte, then the key) naming each key served;
 * closing: nonzero once the server is shutting down (receive only what is there).
 */
static int serve_frames(const int64_t *cfg, int64_t *st, int fd, uint8_t *rbuf,
                        int64_t rbuf_bytes, uint8_t *out, int64_t out_bytes, uint8_t *ring,
                        const volatile int32_t *closing) {
    if (cfg[CFG_ABI] != KVT_ABI || out_bytes < FRAME_BYTES + cfg[CFG_COPY_READ_MAX]
            || cfg[CFG_RING_ENTRY_BYTES] < 1 + cfg[CFG_MAX_KEY_BYTES]
            || rbuf_bytes < FRAME_BYTES + cfg[CFG_MAX_KEY_BYTES]
            || cfg[CFG_HEADER_TIMEOUT_NS] < 1)
        return KVT_BAD_CONFIG;
    const uint32_t magic = (uint32_t)cfg[CFG_FRAME_MAGIC];
    const uint8_t version = (uint8_t)cfg[CFG_FRAME_VERSION], op_get = (uint8_t)cfg[CFG_OP_GET];
    const uint16_t any_size = (uint16_t)cfg[CFG_FLAG_ANY_SIZE];
    const uint16_t more = (uint16_t)cfg[CFG_FLAG_MORE];
    const uint64_t max_value = (uint64_t)cfg[CFG_MAX_VALUE_BYTES];
    const int64_t copy_max = cfg[CFG_COPY_READ_MAX], max_key = cfg[CFG_MAX_KEY_BYTES];
    const int64_t ring_entries = cfg[CFG_RING_ENTRIES], ring_stride = cfg[CFG_RING_ENTRY_BYTES];
    const int drain_wait_ms = (int)cfg[CFG_DRAIN_WAIT_MS];
    const int64_t header_timeout_ns = cfg[CFG_HEADER_TIMEOUT_NS];
    const uint64_t *verified = (const uint64_t *)(uintptr_t)st[ST_VERIFIED_ADDR];
    const uint64_t vmask = (uint64_t)st[ST_VERIFIED_MASK];
    for (;;) {
        if (st[ST_RING_COUNT] * 2 >= ring_entries) return KVT_RING;
        int rc = fill(fd, st, rbuf, rbuf_bytes, FRAME_BYTES, drain_wait_ms, header_timeout_ns,
                      closing);
        if (rc) return rc;
        const uint8_t *h = rbuf + st[ST_RPOS];
        const uint16_t flags = ld16(h + F_FLAGS), key_len = ld16(h + F_KEY_LEN);
        const uint64_t offset = ld64(h + F_OFFSET), length = ld64(h + F_LENGTH);
        const uint64_t total = ld64(h + F_TOTAL_SIZE);
        if (ld32(h + F_MAGIC) != magic || h[F_VERSION] != version || h[F_OPCODE] != op_get
                || (flags & ~(any_size | more)) || ld16(h + F_STATUS) || ld32(h + F_RESERVED)
                || key_len < 1 || key_len > max_key || ld64(h + F_PAYLOAD_LEN)
                || total > max_value || offset > max_value || length > max_value
                || offset + length > max_value
                || (!(flags & any_size) && (int64_t)total > copy_max))
            return KVT_SLOW;  /* anything but a plain small GET, or a bad header: Python */
        rc = fill(fd, st, rbuf, rbuf_bytes, FRAME_BYTES + key_len, drain_wait_ms,
                  header_timeout_ns, closing);
        if (rc) return rc;
        h = rbuf + st[ST_RPOS];  /* fill may have compacted the buffer */
        const uint8_t *key = h + FRAME_BYTES;
        int64_t size = index_copy(cfg, st, key, key_len, (flags & any_size) ? -1 : (int64_t)total,
                                  out + FRAME_BYTES, copy_max, verified, vmask,
                                  st + ST_DECLINED_SLOT);
        if (size < 0) {
            if (size == -3) st[ST_FALLBACKS]++;
            return KVT_SLOW;  /* miss, other size, conflict or not verified: Python answers */
        }
        /* The answer pack_header makes for a GET (frames.py): status OK, no key. */
        memset(out, 0, FRAME_BYTES);
        st32(out + F_MAGIC, magic);
        out[F_VERSION] = version;
        out[F_OPCODE] = op_get;
        st64(out + F_REQUEST_ID, ld64(h + F_REQUEST_ID));
        st64(out + F_LENGTH, (uint64_t)size);
        st64(out + F_TOTAL_SIZE, (uint64_t)size);
        st64(out + F_PAYLOAD_LEN, (uint64_t)size);
        uint8_t *entry = ring + st[ST_RING_COUNT] * ring_stride;
        entry[0] = (uint8_t)key_len;
        memcpy(entry + 1, key, key_len);
        st[ST_RPOS] += FRAME_BYTES + key_len;
        st[ST_FRAME_CLOCK] = 0;  /* whole: the next frame is not on the clock yet */
        st[ST_LAST_FLAGS] = flags;
        st[ST_RING_COUNT]++;
        st[ST_GETS]++;
        if (send_all(fd, out, (size_t)(FRAME_BYTES + size), (flags & more) ? MSG_MORE : 0, st))
            return KVT_SEND_ERROR;
        st[ST_BYTES_SENT] += size;
    }
}

int kvt_serve(const int64_t *cfg, int64_t *st, int fd, uint8_t *rbuf, int64_t rbuf_bytes,
              uint8_t *out, int64_t out_bytes, uint8_t *ring, const volatile int32_t *closing) {
    int rc = serve_frames(cfg, st, fd, rbuf, rbuf_bytes, out, out_bytes, ring, closing);
    /* Python drains the ring after every return and reads with the tick as its timeout. */
    if (st[ST_SHORT_TICK]) {
        set_rcvtimeo(fd, cfg[CFG_RECV_TICK_US]);
        st[ST_SHORT_TICK] = 0;
    }
    return rc;
}
