/*
 * Where a disk-tier block store or load spends its time against raw file I/O, one step at a
 * time, single-threaded, in C (no Python, no GIL): each row adds one thing the tier does to
 * the row above, and prints its throughput as a ratio to the raw row (best of the
 * repetitions, the variants interleaved). It uses the checksum extension's own code
 * (src/kvoffload/tiers/_checksum.c, included) with its widest stripe loop.
 *
 *   cc -O3 -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 *      benchmarks/disk_breakdown.c -o /tmp/disk_breakdown \
 *      -L"$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')" \
 *      -lpython3.11 -Wl,-rpath,"$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
 *   /tmp/disk_breakdown 4096 /tmp/breakdown-dir     # block KiB, a scratch directory
 *
 * Stores write fresh files into the page cache (no fsync); loads read them back from it.
 */
#include "../src/kvoffload/tiers/_checksum.c"

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

static void empty_dir(const char *dir, int n) {
    char path[4096];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/%d.blk", dir, i);
        unlink(path);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s BLOCK_KIB DIR\n", argv[0]);
        return 2;
    }
    size_t size = (size_t)atoi(argv[1]) << 10;
    const char *dir = argv[2];
    int n = (int)((64u << 20) / size);
    if (n < 4)
        n = 4;
    mkdir(dir, 0755);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    uint8_t *arena = aligned_alloc(4096, size * n), *dest = aligned_alloc(4096, size * n);
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
    uint8_t fields_bytes[98] = {0};
    Py_buffer fields = {0}, payload = {0};
    fields.buf = fields_bytes;
    fields.len = sizeof fields_bytes;

    const char *stores[] = {
        "store: raw open, write, close",
        "  + payload at 128 in 1 MiB pieces, header last",
        "  + temporary file (O_EXCL) and rename",
        "  + checksum (the tier: store_frame)",
    };
    const char *loads[] = {
        "load: raw open, read, close",
        "  + header, payload at 128 in 256 KiB pieces",
        "  + checksum (the tier: read_frame)",
        "  (payload at 122, format 2, with checksum)",
    };
    double store_s[4], load_s[4];
    for (int v = 0; v < 4; v++)
        store_s[v] = load_s[v] = 1e9;
    char tmp[64], final[64];
    for (int rep = 0; rep < REPS; rep++) {
        for (int v = 0; v < 4; v++) {
            empty_dir(dir, n);
            sync();
            double t = now();
            for (int i = 0; i < n; i++) {
                const uint8_t *src = arena + (size_t)i * size;
                snprintf(tmp, sizeof tmp, "%d.tmp", i);
                snprintf(final, sizeof final, "%d.blk", i);
                int fd = openat(dfd, v >= 2 ? tmp : final,
                                O_WRONLY | O_CREAT | (v >= 2 ? O_EXCL : O_TRUNC), 0644);
                if (v == 0) {
                    write_hashed(fd, src, size, 0, NULL, size);
                } else if (v < 3) {
                    write_hashed(fd, src, size, 128, NULL, WRITE_PIECE);
                    write_hashed(fd, src, 128, 0, NULL, 128);
                } else {
                    payload.buf = (void *)src;
                    payload.len = (Py_ssize_t)size;
                    write_frame_fd(fd, &fields, &payload, 128, WRITE_PIECE);
                }
                close(fd);
                if (v >= 2)
                    renameat(dfd, tmp, dfd, final);
            }
            t = now() - t;
            if (t < store_s[v])
                store_s[v] = t;
        }
        /* Files for the loads: the frame at 128 (the last store left them) and at 122. */
        for (int v = 0; v < 4; v++) {
            double t = now();
            for (int i = 0; i < n; i++) {
                snprintf(final, sizeof final, "%d.blk", i);
                int fd = openat(dfd, final, O_RDONLY), error;
                uint8_t *out = dest + (size_t)i * size;
                xxh3_state st;
                state_init(&st);
                if (v == 0) {
                    pread_full(fd, out, size, 0, &error);
                } else if (v == 1) {
                    uint8_t head[128];
                    pread_full(fd, head, 128, 0, &error);
                    for (size_t d = 0; d < size; d += READ_PIECE)
                        pread_full(fd, out + d, size - d < READ_PIECE ? size - d : READ_PIECE,
                                   (long long)(128 + d), &error);
                } else {
                    size_t at = v == 2 ? 128 : 122;
                    uint8_t head[128];
                    pread_full(fd, head, at, 0, &error);
                    read_hashed(fd, out, size, (long long)at, &st, READ_PIECE, &error);
                }
                close(fd);
            }
            t = now() - t;
            if (t < load_s[v])
                load_s[v] = t;
        }
    }
    empty_dir(dir, n);
    printf("# %zu KiB blocks, %d per run, best of %d, checksum loop %s\n", size >> 10, n, REPS,
           ACTIVE.name);
    for (int v = 0; v < 4; v++)
        printf("%-50s %7.0f MB/s  %.2f\n", stores[v], (double)size * n / store_s[v] / 1e6,
               store_s[0] / store_s[v]);
    for (int v = 0; v < 4; v++)
        printf("%-50s %7.0f MB/s  %.2f\n", loads[v], (double)size * n / load_s[v] / 1e6,
               load_s[0] / load_s[v]);
    return 0;
}
