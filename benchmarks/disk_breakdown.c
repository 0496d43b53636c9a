/*
 * Where a disk-tier block store or load spends its time against raw file I/O, one step at a
 * time, in C (no Python, no GIL; one thread, or THREADS threads sharing the blocks as the
 * tier's I/O threads do): each row adds one thing the tier does to the row above, and
 * prints its time per block and its ratio to the raw row, in wall time and in CPU time of
 * the threads doing it. It uses the checksum extension's own code
 * (src/kvoffload/blockfile/_checksum.c, included) with its widest stripe loop.
 *
 *   cc -O3 -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 *      benchmarks/disk_breakdown.c -o /tmp/disk_breakdown \
 *      -L"$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')" \
 *      -lpython3.11 -pthread -Wl,-rpath,"$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
 *   /tmp/disk_breakdown 4096 /tmp/breakdown-dir     # block KiB, a scratch directory
 *   /tmp/disk_breakdown 4096 /tmp/breakdown-dir 4   # the same with 4 threads at once
 *
 * Stores write fresh files into the page cache (no fsync); loads read them back from it.
 * The rows are interleaved block by block (block i of repetition r takes row
 * (i / THREADS + r) % ROWS), so a change in the machine's speed during the run falls on
 * every row alike; each row's figure is its total over all repetitions. Rows in brackets
 * are alternatives measured beside the tier's: the layout of earlier releases (the header
 * first, the payload at offset 128, written in 1 MiB pieces), hashing each piece before it
 * is written, and hashing the whole payload on a second thread while this one writes it
 * (which only a machine with an idle core can pay for).
 */
#include "../src/kvoffload/blockfile/_checksum.c"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define REPS 12
#define WRITE_PIECE (512 << 10)
#define OLD_WRITE_PIECE (1 << 20)
#define READ_PIECE (256 << 10)
#define HEADER 128

static double now(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
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

/* The frame's header at ``at``: ``fields``, the digest of ``st`` (little-endian), zeros. */
static void write_header(int fd, const uint8_t *fields, size_t fields_len,
                         const xxh3_state *st, size_t at) {
    uint8_t header[HEADER] = {0};
    uint64_t digest = state_digest(st);
    memcpy(header, fields, fields_len);
    memcpy(header + fields_len, &digest, 8);
    check(write_hashed(fd, header, HEADER, (long long)at, NULL, HEADER), "write");
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
        check(write_hashed(fd, payload + done, want, (long long)done, NULL, want), "write");
    }
    write_header(fd, fields, fields_len, &st, size);
}

/* The frame of earlier releases: the payload at 128 in 1 MiB pieces, each hashed after it
 * is written, then the header at 0. */
static void write_frame_header_first(int fd, const uint8_t *fields, size_t fields_len,
                                     const uint8_t *payload, size_t size) {
    xxh3_state st;
    state_init(&st);
    state_update(&st, fields, fields_len);
    check(write_hashed(fd, payload, size, HEADER, &st, OLD_WRITE_PIECE), "write");
    write_header(fd, fields, fields_len, &st, 0);
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
    check(write_hashed(fd, payload, size, 0, NULL, WRITE_PIECE), "write");
    pthread_join(helper, NULL);
    write_header(fd, fields, fields_len, &job.st, size);
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
static int n, threads, rep;
static int dfd;
static uint8_t *arena, *dest;
static uint8_t fields_bytes[98];

enum { STORES = 7, LOADS = 4 };

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
        check(write_hashed(fd, src, size, 0, NULL, WRITE_PIECE), "write");
        check(write_hashed(fd, src, HEADER, (long long)size, NULL, HEADER), "write");
    } else if (v == 3) {
        Py_buffer fields = {.buf = fields_bytes, .len = sizeof fields_bytes};
        Py_buffer payload = {.buf = (void *)src, .len = (Py_ssize_t)size};
        check(write_frame_fd(fd, &fields, &payload, HEADER, WRITE_PIECE), "write");
    } else if (v == 4) {
        write_frame_header_first(fd, fields_bytes, sizeof fields_bytes, src, size);
    } else if (v == 5) {
        write_frame_hash_before(fd, fields_bytes, sizeof fields_bytes, src, size);
    } else {
        write_frame_hash_beside(fd, fields_bytes, sizeof fields_bytes, src, size);
    }
    close(fd);
    if (v >= 2 && renameat(dfd, tmp, dfd, final) < 0)
        fail("rename");
}

/* Load block ``i`` the way row ``v`` does (whichever row stored it: only the pattern of
 * reads is timed, not what they find). */
static void load_one(int v, int i) {
    char final[64];
    snprintf(final, sizeof final, "%d.blk", i);
    int fd = openat(dfd, final, O_RDONLY), error = 0;
    if (fd < 0)
        fail("open");
    uint8_t *out = dest + (size_t)i * size, head[HEADER];
    xxh3_state st;
    if (v == 0) {
        pread_full(fd, out, size, 0, &error);
    } else if (v == 1) {
        for (size_t d = 0; d < size; d += READ_PIECE)
            pread_full(fd, out + d, size - d < READ_PIECE ? size - d : READ_PIECE,
                       (long long)d, &error);
        pread_full(fd, head, HEADER, (long long)size, &error);
    } else if (v == 2) {
        Py_buffer fields = {.buf = fields_bytes, .len = sizeof fields_bytes};
        Py_buffer header = {.buf = head, .len = HEADER};
        Py_buffer payload = {.buf = out, .len = (Py_ssize_t)size};
        read_frame_at(fd, &fields, &header, &payload, READ_PIECE, &st, &error);
    } else {
        pread_full(fd, head, HEADER, 0, &error);
        check(error, "read");
        state_init(&st);
        state_update(&st, head, sizeof fields_bytes);
        read_hashed(fd, out, size, HEADER, &st, READ_PIECE, &error);
    }
    check(error, "read");
    close(fd);
}

/* Seconds of wall and of thread CPU per row, summed over the blocks of all threads. */
static double wall_s[64][STORES], cpu_s[64][STORES];
static int is_store;

/* Thread ``k``'s blocks k, k + threads, ... of this repetition, each in its row. */
static void *run_share(void *arg) {
    int k = (int)(intptr_t)arg, rows = is_store ? STORES : LOADS;
    for (int i = k; i < n; i += threads) {
        int v = (i / threads + rep) % rows;
        double w = now(CLOCK_MONOTONIC), c = now(CLOCK_THREAD_CPUTIME_ID);
        (is_store ? store_one : load_one)(v, i);
        wall_s[k][v] += now(CLOCK_MONOTONIC) - w;
        cpu_s[k][v] += now(CLOCK_THREAD_CPUTIME_ID) - c;
    }
    return NULL;
}

/* Every block on ``threads`` threads (one: on this thread, with no thread started). */
static void run_all(void) {
    pthread_t ids[64];
    if (threads == 1) {
        run_share(0);
        return;
    }
    for (int k = 0; k < threads; k++)
        if (pthread_create(&ids[k], NULL, run_share, (void *)(intptr_t)k) != 0)
            fail("pthread_create");
    for (int k = 0; k < threads; k++)
        pthread_join(ids[k], NULL);
}

/* Print rows ``names``: wall time per block (with more threads than cores, time waiting
 * for a core included), and the wall and CPU ratios of row 0's time per block to each's. */
static void report(const char **names, int rows) {
    double wall[STORES] = {0}, cpu[STORES] = {0};
    for (int k = 0; k < threads; k++)
        for (int v = 0; v < rows; v++) {
            wall[v] += wall_s[k][v];
            cpu[v] += cpu_s[k][v];
        }
    /* Each row had the same number of blocks, give or take one per thread and repetition:
     * compare per-block times. */
    int blocks[STORES] = {0};
    for (rep = 0; rep < REPS; rep++)
        for (int i = 0; i < n; i++)
            blocks[(i / threads + rep) % rows]++;
    for (int v = 0; v < rows; v++) {
        double per_wall = wall[v] / blocks[v], per_cpu = cpu[v] / blocks[v];
        printf("%-58s %7.3f ms  wall %.2f  cpu %.2f\n", names[v], per_wall * 1e3,
               wall[0] / blocks[0] / per_wall, cpu[0] / blocks[0] / per_cpu);
    }
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
    n = (int)(((size_t)threads * (96u << 20)) / size); /* 96 MiB per thread */
    if (n < 2 * STORES * threads)
        n = 2 * STORES * threads;
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
    init_kernels();

    const char *stores[STORES] = {
        "store: raw open, write, close",
        "  + payload in 512 KiB pieces, header after it",
        "  + temporary file (O_EXCL) and rename",
        "  + checksum (the tier: store_frame)",
        "  (header first, payload at 128 in 1 MiB pieces, checksum)",
        "  (checksum before each piece is written)",
        "  (checksum on a second thread)",
    };
    const char *loads[LOADS] = {
        "load: raw open, read, close",
        "  + payload in 256 KiB pieces, header after it",
        "  + checksum (the tier: read_frame)",
        "  (header first, payload at 128, checksum)",
    };
    for (rep = 0; rep < REPS; rep++) {
        empty_dir(dir, n);
        sync();
        is_store = 1;
        run_all();
    }
    printf("# %zu KiB blocks, %d per repetition, %d thread%s, %d repetitions, rows "
           "interleaved block by block, checksum loop %s\n",
           size >> 10, n, threads, threads == 1 ? "" : "s", REPS, ACTIVE.name);
    report(stores, STORES);
    memset(wall_s, 0, sizeof wall_s);
    memset(cpu_s, 0, sizeof cpu_s);
    is_store = 0;
    for (rep = 0; rep < REPS; rep++)
        run_all();
    report(loads, LOADS);
    empty_dir(dir, n);
    return 0;
}
