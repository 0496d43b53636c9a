/*
 * kvoffload's CPU copy queue: a plain C library (no Python API), loaded with ctypes.
 *
 * A queue owns ``threads`` C threads. Python pushes jobs, each a list of pieces
 * (destination address, source address, bytes), and returns at once; the threads copy them
 * with no Python involved: no GIL to hand back and forth between pages, no Python thread to
 * wake. Threads take pieces in runs of about ``grab_bytes`` under one mutex, jobs in push
 * order; a thread that takes a run while more is left wakes another, so a small job keeps
 * one thread and a large one spreads over all. A push wakes a thread only when all sleep. Jobs finish in push order: ``completed``
 * is the sequence number of the last job whose pieces, and those of every job before it,
 * are all copied.
 *
 * The caller has checked every piece against the bounds of the registered memory, keeps
 * each job's pieces and its ``seconds`` cell alive until the job has completed, and never
 * pushes pieces that write memory another unfinished job of the queue writes.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAMING_STORES 1
#endif
#ifdef __linux__
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef struct kvo_job {
    const uint64_t *pieces;  /* count triples */
    uint64_t *owned;         /* ``pieces`` when the queue built them (freed with the job) */
    uint64_t count;
    uint64_t next;           /* first piece no thread has taken */
    uint64_t left;           /* pieces taken or not that are not yet copied */
    uint64_t seq;
    double start;            /* when a thread first took a piece; 0 before */
    double *seconds;         /* written once the job completes (may be NULL) */
    struct kvo_job *after;
} kvo_job;

typedef struct kvoffload_queue {
    pthread_mutex_t mutex;
    pthread_cond_t work;     /* a job was pushed, or stop */
    pthread_cond_t done;     /* ``completed`` advanced */
    kvo_job *head;           /* oldest job not completed */
    kvo_job *tail;
    kvo_job *claim;          /* oldest job with pieces no thread has taken */
    uint64_t pushed;
    uint64_t completed;
    uint64_t grab_bytes;
    double last_done;
    int stop;
    int held;                /* threads take no new pieces (kvoffload_queue_hold) */
    int waiting;             /* threads asleep on ``work`` */
    int waiters;             /* callers inside kvoffload_queue_wait */
    pthread_cond_t no_waiters; /* the last waiter left (kvoffload_queue_free waits for it) */
    int nthreads;
    pthread_t *threads;
} kvoffload_queue;

/* How long a thread that ran out of work keeps looking before it sleeps. Waking a sleeping
 * thread costs the pusher a system call (tens of microseconds on a VM); a planner pushing
 * a job every few tens of microseconds then finds a thread still looking. */
#define SPIN_SECONDS 100e-6
/* Nice value of the copy threads (Linux). */
#define COPY_THREAD_NICE 5

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/*
 * Copy n bytes. On x86-64, with streaming (non-temporal) stores: the destination is not
 * read into the cache first (a third less memory traffic than a plain copy) and does not
 * evict what the engine's own threads are working on. Call ``copy_done`` before another
 * thread may read what was copied.
 */
static void copy_bytes(char *dst, const char *src, size_t n)
{
#ifdef HAVE_STREAMING_STORES
    if (n >= 4096) {
        size_t head = (size_t)(-(uintptr_t)dst & 15);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Order the streaming stores before what follows (publishing a finished copy). */
static void copy_done(void)
{
#ifdef HAVE_STREAMING_STORES
    _mm_sfence();
#endif
}

/* Move ``claim`` past jobs whose pieces are all taken. Under the mutex. */
static void skip_claimed(kvoffload_queue *q)
{
    kvo_job *claim = q->claim;
    while (claim != NULL && claim->next >= claim->count)
        claim = claim->after;
    __atomic_store_n(&q->claim, claim, __ATOMIC_RELEASE); /* read unlocked while spinning */
}

/* Spin (yielding the CPU) until there is work, stop, or SPIN_SECONDS pass. Unlocked. */
static void spin_for_work(kvoffload_queue *q)
{
    double until = now() + SPIN_SECONDS;
    while (__atomic_load_n(&q->claim, __ATOMIC_ACQUIRE) == NULL
           && !__atomic_load_n(&q->stop, __ATOMIC_ACQUIRE) && now() < until)
        sched_yield();
}

/* Complete, in order, the finished jobs at the head. Under the mutex. */
static void complete_finished(kvoffload_queue *q)
{
    int advanced = 0;
    while (q->head != NULL && q->head->left == 0 && q->head->next >= q->head->count) {
        kvo_job *job = q->head;
        double t = now();
        if (job->seconds != NULL) {
            /* Time this job alone held the queue: from its start, or from the previous
             * completion if later, to now. Summed over jobs, the queue's busy time. */
            double from = job->start > q->last_done ? job->start : q->last_done;
            *job->seconds = job->start > 0 && t > from ? t - from : 0.0;
        }
        q->last_done = t;
        q->completed = job->seq;
        q->head = job->after;
        if (q->head == NULL)
            q->tail = NULL;
        free(job->owned);
        free(job);
        advanced = 1;
    }
    if (advanced)
        pthread_cond_broadcast(&q->done);
}

static void *worker_main(void *arg)
{
    kvoffload_queue *q = arg;
#ifdef __linux__
    /* Background work: the engine's own threads (and the planner pushing the next job)
     * come first when cores are short. Best effort; an unprivileged thread may raise its
     * nice value. */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), COPY_THREAD_NICE);
#endif
    pthread_mutex_lock(&q->mutex);
    for (;;) {
        if (q->claim == NULL && !q->stop && !q->held) {
            pthread_mutex_unlock(&q->mutex);
            spin_for_work(q);
            pthread_mutex_lock(&q->mutex);
        }
        while ((q->claim == NULL || q->held) && !q->stop) {
            q->waiting++;
            pthread_cond_wait(&q->work, &q->mutex);
            q->waiting--;
        }
        if (q->claim == NULL)
            break; /* stopping, and nothing is left to take */
        kvo_job *job = q->claim;
        uint64_t first = job->next, end = first, bytes = 0;
        while (end < job->count && bytes < q->grab_bytes)
            bytes += job->pieces[3 * end++ + 2];
        job->next = end;
        if (job->start == 0)
            job->start = now();
        skip_claimed(q);
        if (q->claim != NULL && q->waiting > 0)
            pthread_cond_signal(&q->work); /* more to take: let another thread help */
        pthread_mutex_unlock(&q->mutex);

        for (uint64_t i = first; i < end; i++) {
            const uint64_t *piece = job->pieces + 3 * i;
            copy_bytes((char *)(uintptr_t)piece[0], (const char *)(uintptr_t)piece[1],
                       (size_t)piece[2]);
        }
        copy_done();

        pthread_mutex_lock(&q->mutex);
        job->left -= end - first;
        if (job->left == 0)
            complete_finished(q);
    }
    pthread_mutex_unlock(&q->mutex);
    return NULL;
}

/* Release a queue whose threads have stopped (or never started). */
static void destroy_queue(kvoffload_queue *q)
{
    pthread_cond_destroy(&q->no_waiters);
    pthread_cond_destroy(&q->done);
    pthread_cond_destroy(&q->work);
    pthread_mutex_destroy(&q->mutex);
    free(q->threads);
    free(q);
}

/* A queue with ``nthreads`` copy threads (at least one) taking runs of about
 * ``grab_bytes``. NULL if memory or the first thread cannot be had. */
kvoffload_queue *kvoffload_queue_new(int nthreads, uint64_t grab_bytes)
{
    if (nthreads < 1)
        nthreads = 1;
    kvoffload_queue *q = calloc(1, sizeof *q);
    if (q == NULL)
        return NULL;
    q->threads = calloc((size_t)nthreads, sizeof *q->threads);
    if (q->threads == NULL) {
        free(q);
        return NULL;
    }
    q->grab_bytes = grab_bytes > 0 ? grab_bytes : 1;
    pthread_mutex_init(&q->mutex, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->done, NULL);
    pthread_cond_init(&q->no_waiters, NULL);
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&q->threads[i], NULL, worker_main, q) != 0)
            break;
        q->nthreads++;
    }
    if (q->nthreads == 0) {
        destroy_queue(q);
        return NULL;
    }
    return q;
}

/* Append ``job`` (pieces, count, left and seconds set) and return its sequence number. */
static uint64_t push_job(kvoffload_queue *q, kvo_job *job)
{
    pthread_mutex_lock(&q->mutex);
    job->seq = ++q->pushed;
    if (q->tail != NULL)
        q->tail->after = job;
    else
        q->head = job;
    q->tail = job;
    if (q->claim == NULL)
        __atomic_store_n(&q->claim, job, __ATOMIC_RELEASE);
    skip_claimed(q);
    uint64_t seq = job->seq; /* an empty job may be completed, and freed, right below */
    if (job->count == 0)
        complete_finished(q);
    else if (q->waiting == q->nthreads && !q->held)
        /* All asleep: wake one. A thread awake takes the job before it sleeps, and wakes
         * the others if there is more to take; waking costs the pusher a system call. */
        pthread_cond_signal(&q->work);
    pthread_mutex_unlock(&q->mutex);
    return seq;
}

/* Queue ``count`` pieces as one job; returns its sequence number (1, 2, ...), or 0 if no
 * memory was left (nothing queued). ``seconds`` (may be NULL) receives, at completion,
 * the time the job alone held the queue. */
uint64_t kvoffload_queue_push(kvoffload_queue *q, const uint64_t *pieces, uint64_t count,
                              double *seconds)
{
    kvo_job *job = calloc(1, sizeof *job);
    if (job == NULL)
        return 0;
    job->pieces = pieces;
    job->count = count;
    job->left = count;
    job->seconds = seconds;
    return push_job(q, job);
}

typedef struct {
    uint64_t *at;
    uint64_t count;
    uint64_t capacity;
} piece_list;

static int append_piece(piece_list *list, uint64_t dst, uint64_t src, uint64_t n)
{
    if (list->count == list->capacity) {
        uint64_t capacity = list->capacity ? 2 * list->capacity : 64;
        uint64_t *at = realloc(list->at, 3 * capacity * sizeof *at);
        if (at == NULL)
            return -1;
        list->at = at;
        list->capacity = capacity;
    }
    uint64_t *piece = list->at + 3 * list->count++;
    piece[0] = dst;
    piece[1] = src;
    piece[2] = n;
    return 0;
}

/* Append ``dst <- src`` (n bytes), cut into pieces of at most ``chunk`` bytes. */
static int append_run(piece_list *list, uint64_t dst, uint64_t src, uint64_t n,
                      uint64_t chunk)
{
    for (uint64_t off = 0; off < n; off += chunk)
        if (append_piece(list, dst + off, src + off, n - off < chunk ? n - off : chunk))
            return -1;
    return 0;
}

static int by_source(const void *a, const void *b)
{
    uint64_t x = ((const uint64_t *)a)[1], y = ((const uint64_t *)b)[1];
    return (x > y) - (x < y);
}

/*
 * One job given as pages. Every field is 64 bits wide, so Python fills it as an array of
 * uint64 (one ctypes argument instead of thirteen: converting each costs ~0.2 us).
 *
 * ``segments`` holds ``nsegments`` quadruples (engine address of block 0, bytes between
 * engine blocks, page bytes, arena address of the segment's sub-block 0 in slot 0). Page
 * i is engine block ``block_ids[i]``, and sub-block ``p % factor`` of slot
 * ``slots[p / factor]`` with ``p = skip + i`` (a job may start in the middle of an
 * offloaded block). Of segment s it is ``page`` bytes at ``engine + block_ids[i] * stride``
 * and at ``host + slot * slot_bytes + sub * page``. Every block id must lie in
 * ``[0, num_blocks)`` and every slot in ``[0, num_slots)``, or nothing is queued; the
 * segments must describe memory that holds that many blocks and slots. ``store`` copies
 * engine to arena, else arena to engine. Pages that continue the
 * previous one of their segment on both sides merge; runs longer than ``chunk`` are cut;
 * pieces that average at least ``sort_bytes`` are put in ascending source address order
 * (reading memory front to back). ``fail_midway`` copies only the first half of the
 * pieces (fault injection). ``seconds`` (may be NULL) receives, at completion, the time
 * the job alone held the queue.
 */
typedef struct kvoffload_pages {
    const uint64_t *segments;
    uint64_t nsegments;
    const int64_t *block_ids;
    const int64_t *slots;
    uint64_t npages;
    uint64_t num_blocks;
    uint64_t num_slots;
    uint64_t slot_bytes;
    uint64_t factor;
    uint64_t skip;
    uint64_t store;
    uint64_t chunk;
    uint64_t sort_bytes;
    uint64_t fail_midway;
    double *seconds;
} kvoffload_pages;

_Static_assert(sizeof(kvoffload_pages) == 15 * sizeof(uint64_t),
               "kvoffload_pages must be fifteen 64-bit fields (64-bit pointers)");

#define OUT_OF_BOUNDS 1
#define NO_MEMORY 2

/* OUT_OF_BOUNDS unless every block id and slot of ``pages`` is in range; 0 otherwise. The
 * slots must be as many as the pages need (the caller checks). */
static int check_bounds(const kvoffload_pages *pages)
{
    uint64_t factor = pages->factor > 0 ? pages->factor : 1;
    if (pages->skip >= factor)
        return OUT_OF_BOUNDS;
    for (uint64_t i = 0; i < pages->npages; i++)
        if (pages->block_ids[i] < 0 || (uint64_t)pages->block_ids[i] >= pages->num_blocks)
            return OUT_OF_BOUNDS;
    uint64_t nslots = pages->npages ? (pages->skip + pages->npages + factor - 1) / factor : 0;
    for (uint64_t k = 0; k < nslots; k++)
        if (pages->slots[k] < 0 || (uint64_t)pages->slots[k] >= pages->num_slots)
            return OUT_OF_BOUNDS;
    return 0;
}

/* The pieces of ``pages`` into ``list``; 0, NO_MEMORY, or OUT_OF_BOUNDS (nothing built). */
static int build_pieces(piece_list *list, const kvoffload_pages *pages)
{
    const uint64_t *segments = pages->segments;
    const int64_t *block_ids = pages->block_ids, *slots = pages->slots;
    uint64_t npages = pages->npages, chunk = pages->chunk, slot_bytes = pages->slot_bytes;
    uint64_t factor = pages->factor > 0 ? pages->factor : 1, skip = pages->skip;
    int store = pages->store != 0;
    uint64_t total = 0;
    if (check_bounds(pages))
        return OUT_OF_BOUNDS;
    if (chunk == 0)
        chunk = UINT64_MAX;
    for (uint64_t s = 0; s < pages->nsegments; s++) {
        uint64_t engine = segments[4 * s], stride = segments[4 * s + 1];
        uint64_t page = segments[4 * s + 2], host = segments[4 * s + 3];
        uint64_t run_dst = 0, run_src = 0, run = 0;
        for (uint64_t i = 0; i < npages; i++) {
            uint64_t e = engine + (uint64_t)block_ids[i] * stride;
            uint64_t p = skip + i;
            uint64_t h = host + (uint64_t)slots[p / factor] * slot_bytes + (p % factor) * page;
            uint64_t dst = store ? h : e, src = store ? e : h;
            if (run > 0 && dst == run_dst + run && src == run_src + run) {
                run += page;
                continue;
            }
            if (run > 0 && append_run(list, run_dst, run_src, run, chunk))
                return NO_MEMORY;
            run_dst = dst;
            run_src = src;
            run = page;
        }
        if (run > 0 && append_run(list, run_dst, run_src, run, chunk))
            return NO_MEMORY;
        total += npages * page;
    }
    if (list->count > 0 && total / list->count >= pages->sort_bytes) /* average piece */
        qsort(list->at, list->count, 3 * sizeof *list->at, by_source);
    return 0;
}

/* Queue one job given as pages (see kvoffload_pages); the queue builds and owns its
 * pieces. Returns the sequence number; 0 if no memory was left, UINT64_MAX if a page lies
 * outside the registered memory (nothing queued either way). */
uint64_t kvoffload_queue_push_pages(kvoffload_queue *q, const kvoffload_pages *pages)
{
    piece_list list = {0};
    int error = build_pieces(&list, pages);
    if (error) {
        free(list.at);
        return error == OUT_OF_BOUNDS ? UINT64_MAX : 0;
    }
    kvo_job *job = calloc(1, sizeof *job);
    if (job == NULL) {
        free(list.at);
        return 0;
    }
    job->owned = list.at;
    job->pieces = list.at;
    job->count = pages->fail_midway ? list.count / 2 : list.count;
    job->left = job->count;
    job->seconds = pages->seconds;
    return push_job(q, job);
}

/* The pieces kvoffload_queue_push_pages would queue for ``pages`` (all of them, whatever
 * ``fail_midway``), written to ``out`` (room for ``capacity`` triples); returns their
 * number (more than ``capacity``: nothing written), UINT64_MAX - 1 if no memory was left,
 * UINT64_MAX if a page lies outside the registered memory. */
uint64_t kvoffload_plan_pages(const kvoffload_pages *pages, uint64_t *out, uint64_t capacity)
{
    piece_list list = {0};
    int error = build_pieces(&list, pages);
    if (error) {
        free(list.at);
        return error == OUT_OF_BOUNDS ? UINT64_MAX : UINT64_MAX - 1;
    }
    uint64_t count = list.count;
    if (count <= capacity && count > 0)
        memcpy(out, list.at, 3 * count * sizeof *out);
    free(list.at);
    return count;
}

/* Hold (``held`` 1) or release (0) the queue: while held, its threads take no new pieces
 * (those already taken are finished). For tests that need jobs to stay in flight. */
void kvoffload_queue_hold(kvoffload_queue *q, int held)
{
    pthread_mutex_lock(&q->mutex);
    q->held = held;
    if (!held)
        pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->mutex);
}

/* Sequence number of the last completed job (0: none yet). */
uint64_t kvoffload_queue_completed(kvoffload_queue *q)
{
    pthread_mutex_lock(&q->mutex);
    uint64_t completed = q->completed;
    pthread_mutex_unlock(&q->mutex);
    return completed;
}

/* Block until job ``seq`` (and every job before it) has completed. */
void kvoffload_queue_wait(kvoffload_queue *q, uint64_t seq)
{
    pthread_mutex_lock(&q->mutex);
    if (seq > q->pushed)
        seq = q->pushed;
    q->waiters++;
    while (q->completed < seq)
        pthread_cond_wait(&q->done, &q->mutex);
    if (--q->waiters == 0)
        pthread_cond_broadcast(&q->no_waiters);
    pthread_mutex_unlock(&q->mutex);
}

/* Copy every queued job, stop and join the threads, let callers still inside
 * kvoffload_queue_wait return (every job is complete by then), free the queue. No call may
 * start on the queue once this one has. */
void kvoffload_queue_free(kvoffload_queue *q)
{
    if (q == NULL)
        return;
    pthread_mutex_lock(&q->mutex);
    __atomic_store_n(&q->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->mutex);
    for (int i = 0; i < q->nthreads; i++)
        pthread_join(q->threads[i], NULL);
    pthread_mutex_lock(&q->mutex);
    pthread_cond_broadcast(&q->done);
    while (q->waiters > 0)
        pthread_cond_wait(&q->no_waiters, &q->mutex);
    pthread_mutex_unlock(&q->mutex);
    destroy_queue(q);
}
