/*
 * Where a disk-tier block store or load spends its time against raw file I/O, one step at a
 * time, in C (no Python, no GIL; one thread, or THREADS threads sharing the blocks as the
 * tier's I/O threads do): each row adds one thing the tier does to
 * the row above, and prints its throughput as a ratio to the raw row (best of the
 * repetitions, the variants interleaved). It uses the checksum extension's own code
 * (src/kvoffload/tiers/_checksum.c, included) with its widest stripe loop.
 *
 *   cc -O3 -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 *      benchmarks/disk_breakdown.c -o /tmp/disk_breakdown \
 *      -L"$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')" \
 *      -lpython3.11 -pthread -Wl,-rpath,"$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
 *   /tmp/disk_breakdown 4096 /tmp/breakdown-dir     # block KiB, a scratch directory
 *   /tmp/disk_breakdown 4096 /tmp/breakdown-dir 4   # the same with 4 threads at once
 *
 * Stores write fresh files into the page cache (no fsync); loads read them back from it.
 * Two store rows in brackets are other places for the checksum, measured beside the tier's
 * (which hashes each piece right after writing it, while the copy into the page cache has
 * left it in this core's cache): hashing each piece before it is written, and hashing the
 * whole payload on a second thread while this one writes it (which only a machine with an
 * idle core can pay for).
 */
#include "../src/kvoffload/tiers/_checksum.c"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define REPS 10
#define WRITE_PIECE (1 << 20)
#define READ_PIECE (256 << 10)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Stop the run: a step failed, and its timing would mean nothing. */
static void fail(const char *what) {
    perror(what);
    exit(1);
}

/* ``error``: 0, or the errno a write step returned. */
static void check(int error, const char *what) {
    if (error) {
        errno = error;
        fail(what);
    }
}

/* The frame's header at 0: ``fields``, the digest of ``st`` (little-endian), zeros to 128. */
static void write_header(int fd, const uint8_t *fields, size_t fields_len,
                         const xxh3_state *st) {
    uint8_t header[128] = {0};
    uint64_t digest = state_digest(st);
    memcpy(header, fields, fields_len);
    memcpy(header + fields_len, &digest, 8);
    check(write_hashed(fd, header, 128, 0, NULL, 128), "write");
}

/* The frame of write_frame_fd with each piece hashed before it is written, not after. */
static void write_frame_hash_before(int fd, const uint8_t *fields, size_t fields_len,
                                   const uint8_t *payload, size_t size) {
    xxh3_state st;
    state_init(&st);
    state_update(&st, fields, fields_len);
    for (size_t done = 0; done < size; done += WRITE_PIECE) {
        size_t want = size - done < WRITE_PIECE ? size - done : WRITE_PIECE;
        state_update(&st, payload + done, want);
        check(write_hashed(fd, payload + done, want, (long long)(128 + done), NULL, want),
              "write");
    }
    write_header(fd, fields, fields_len, &st);
}

typedef struct {
    xxh3_state st;
    const uint8_t *payload;
    size_t size;
} hash_job;

static void *hash_payload(void *arg) {
    hash_job *job = arg;
    state_update(&job->st, job->payload, job->size);
    return NULL;
}

/* The frame with the payload hashed on a second thread while this one writes it. */
static void write_frame_hash_beside(int fd, const uint8_t *fields, size_t fields_len,
                                    const uint8_t *payload, size_t size) {
    hash_job job = {.payload = payload, .size = size};
    pthread_t helper;
    state_init(&job.st);
    state_update(&job.st, fields, fields_len);
    if (pthread_create(&helper, NULL, hash_payload, &job) != 0)
        fail("pthread_create");
    check(write_hashed(fd, payload, size, 128, NULL, WRITE_PIECE), "write");
    pthread_join(helper, NULL);
    write_header(fd, fields, fields_len, &job.st);
}

/* Remove the blocks and any temporary file an interrupted run left. */
static void empty_dir(const char *dir, int n) {
    char path[4096];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/%d.blk", dir, i);
        unlink(path);
        snprintf(path, sizeof path, "%s/%d.tmp", dir, i);
        unlink(path);
    }
}

/* One run's shared inputs: block size, blocks, their bytes and where loads land. */
static size_t size;
static int n, threads;
static int dfd;
static uint8_t *arena, *dest;
static uint8_t fields_bytes[98];

enum { STORES = 6, LOADS = 4 };

/* Store block ``i`` the way row ``v`` does. */
static void store_one(int v, int i) {
    char tmp[64], final[64];
    const uint8_t *src = arena + (size_t)i * size;
    snprintf(tmp, sizeof tmp, "%d.tmp", i);
    snprintf(final, sizeof final, "%d.blk", i);
    int fd = openat(dfd, v >= 2 ? tmp : final, O_WRONLY | O_CREAT | (v >= 2 ? O_EXCL : O_TRUNC),
                    0644);
    if (fd < 0)
        fail("create");
    if (v == 0) {
        check(write_hashed(fd, src, size, 0, NULL, size), "write");
    } else if (v < 3) {
        check(write_hashed(fd, src, size, 128, NULL, WRITE_PIECE), "write");
        check(write_hashed(fd, src, 128, 0, NULL, 128), "write");
    } else if (v == 3) {
        Py_buffer fields = {.buf = fields_bytes, .len = sizeof fields_bytes};
        Py_buffer payload = {.buf = (void *)src, .len = (Py_ssize_t)size};
        check(write_frame_fd(fd, &fields, &payload, 128, WRITE_PIECE), "write");
    } else if (v == 4) {
        write_frame_hash_before(fd, fields_bytes, sizeof fields_bytes, src, size);
    } else {
        write_frame_hash_beside(fd, fields_bytes, sizeof fields_bytes, src, size);
    }
    close(fd);
    if (v >= 2 && renameat(dfd, tmp, dfd, final) < 0)
        fail("rename");
}

/* Load block ``i`` the way row ``v`` does (the frame at 128 the last store left, or for
 * the format-2 row the same file read as if its payload began at 122). */
static void load_one(int v, int i) {
    char final[64];
    snprintf(final, sizeof final, "%d.blk", i);
    int fd = openat(dfd, final, O_RDONLY), error = 0;
    if (fd < 0)
        fail("open");
    uint8_t *out = dest + (size_t)i * size, head[128];
    xxh3_state st;
    state_init(&st);
    if (v == 0) {
        pread_full(fd, out, size, 0, &error);
    } else if (v == 1) {
        pread_full(fd, head, 128, 0, &error);
        for (size_t d = 0; d < size; d += READ_PIECE)
            pread_full(fd, out + d, size - d < READ_PIECE ? size - d : READ_PIECE,
                       (long long)(128 + d), &error);
    } else {
        size_t at = v == 2 ? 128 : 122;
        pread_full(fd, head, at, 0, &error);
        check(error, "read");
        read_hashed(fd, out, size, (long long)at, &st, READ_PIECE, &error);
    }
    check(error, "read");
    close(fd);
}

typedef struct {
    int first, store, v;
} share;

/* Blocks first, first + threads, ... of one row. */
static void *run_share(void *arg) {
    share *part = arg;
    for (int i = part->first; i < n; i += threads)
        (part->store ? store_one : load_one)(part->v, i);
    return NULL;
}

/* Seconds for every block of row ``v`` on ``threads`` threads (one: on this thread, with
 * no thread started). */
static double run_row(int store, int v) {
    pthread_t ids[64];
    share parts[64];
    double t = now();
    if (threads == 1) {
        parts[0] = (share){0, store, v};
        run_share(&parts[0]);
        return now() - t;
    }
    for (int k = 0; k < threads; k++) {
        parts[k] = (share){k, store, v};
        if (pthread_create(&ids[k], NULL, run_share, &parts[k]) != 0)
            fail("pthread_create");
    }
    for (int k = 0; k < threads; k++)
        pthread_join(ids[k], NULL);
    return now() - t;
}

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s BLOCK_KIB DIR [THREADS]\n", argv[0]);
        return 2;
    }
    size = (size_t)atoi(argv[1]) << 10;
    const char *dir = argv[2];
    threads = argc == 4 ? atoi(argv[3]) : 1;
    if (size == 0 || threads < 1 || threads > 64) {
        fprintf(stderr, "BLOCK_KIB must be > 0 and THREADS in [1, 64]\n");
        return 2;
    }
    n = (int)(((size_t)threads * (64u << 20)) / size); /* 64 MiB per thread */
    if (n < 4 * threads)
        n = 4 * threads;
    mkdir(dir, 0755);
    dfd = open(dir, O_RDONLY | O_DIRECTORY);
    arena = aligned_alloc(4096, size * n);
    dest = aligned_alloc(4096, size * n);
    if (dfd < 0 || !arena || !dest) {
        perror(dir);
        return 1;
    }
    for (size_t i = 0; i < size * n; i++)
        arena[i] = (uint8_t)((i * 2654435761u) >> 13);
    NUM_KERNELS = 0;
    KERNELS[NUM_KERNELS++] = (kernel_entry){"scalar", consume_scalar};
#ifdef XXH_X86
    __builtin_cpu_init();
    KERNELS[NUM_KERNELS++] = (kernel_entry){"sse2", consume_sse2};
    if (__builtin_cpu_supports("avx2"))
        KERNELS[NUM_KERNELS++] = (kernel_entry){"avx2", consume_avx2};
    if (__builtin_cpu_supports("avx512f"))
        KERNELS[NUM_KERNELS++] = (kernel_entry){"avx512", consume_avx512};
#endif
    ACTIVE = KERNELS[NUM_KERNELS - 1];

    const char *stores[STORES] = {
        "store: raw open, write, close",
        "  + payload at 128 in 1 MiB pieces, header last",
        "  + temporary file (O_EXCL) and rename",
        "  + checksum (the tier: store_frame)",
        "  (checksum before each piece is written)",
        "  (checksum on a second thread)",
    };
    const char *loads[LOADS] = {
        "load: raw open, read, close",
        "  + header, payload at 128 in 256 KiB pieces",
        "  + checksum (the tier: read_frame)",
        "  (payload at 122, format 2, with checksum)",
    };
    double store_s[STORES], load_s[LOADS];
    for (int v = 0; v < STORES; v++)
        store_s[v] = 1e9;
    for (int v = 0; v < LOADS; v++)
        load_s[v] = 1e9;
    for (int rep = 0; rep < REPS; rep++) {
        for (int v = 0; v < STORES; v++) {
            empty_dir(dir, n);
            sync();
            double t = run_row(1, v);
            if (t < store_s[v])
                store_s[v] = t;
        }
        for (int v = 0; v < LOADS; v++) {
            double t = run_row(0, v);
            if (t < load_s[v])
                load_s[v] = t;
        }
    }
    empty_dir(dir, n);
    printf("# %zu KiB blocks, %d per run, %d thread%s, best of %d, checksum loop %s\n",
           size >> 10, n, threads, threads == 1 ? "" : "s", REPS, ACTIVE.name);
    for (int v = 0; v < STORES; v++)
        printf("%-50s %7.0f MB/s  %.2f\n", stores[v], (double)size * n / store_s[v] / 1e6,
               store_s[0] / store_s[v]);
    for (int v = 0; v < LOADS; v++)
        printf("%-50s %7.0f MB/s  %.2f\n", loads[v], (double)size * n / load_s[v] / 1e6,
               load_s[0] / load_s[v]);
    return 0;
}
