/*
 * kvoffload's CPU copy queue: a plain C library (no Python API), loaded with ctypes.
 *
 * A queue owns ``threads`` C threads. Python pushes jobs, each a list of pieces
 * (destination address, source address, bytes), and returns at once; the threads copy them
 * with no Python involved: no GIL to hand back and forth between pages, no Python thread to
 * wake. Threads take pieces in runs of about ``grab_bytes`` under one mutex, jobs in push
 * order; a thread that takes a run while more is left wakes another, so a small job keeps
 * one thread and a large one spreads over all. A push wakes a thread only when all sleep.
 * Jobs finish in push order: ``completed`` is the sequence number of the last job whose
 * pieces, and those of every job before it, are all copied.
 *
 * A job comes as ready-made pieces (``kvoffload_queue_push``: the caller has checked them
 * against the bounds of the registered memory) or as pages, which the planner of
 * ``_copy_plan.c`` checks against the layout table and turns into pieces
 * (``kvoffload_queue_push_job``, formats in ``_copy.h``). The caller keeps each job's
 * pieces and its ``held_ns`` cell alive until the job has completed, and never pushes
 * pieces that write memory another unfinished job of the queue writes.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_copy.h"
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
    int64_t start;           /* when a thread first took a piece (ns); 0 before */
    int64_t *held_ns;        /* written once the job completes (may be NULL) */
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
    int64_t last_done;
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
#define SPIN_NS 100000
/* Nice value of the copy threads (Linux). */
#define COPY_THREAD_NICE 5

/* Monotonic time in nanoseconds (never 0). */
static int64_t now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + 1;
}

/*
 * Copy n bytes. On x86-64, with streaming (non-temporal) stores: the destination is not
 * read into the cache first (a third less memory traffic than a plain copy) and does not
 * evict what the engine's own threads are working on. Meanwhile the first n bytes of
 * ``next`` (``next_n`` bytes: the source of the piece copied next; NULL: none) are
 * prefetched, line for line: a scattered piece then starts with its first lines, and the
 * translation of its first pages, already on the way instead of waiting for memory (the
 * hardware prefetchers stop at 4 KiB page boundaries and start over for every piece). Call
 * ``copy_done`` before another thread may read what was copied.
 */
static void copy_bytes(char *dst, const char *src, size_t n, const char *next, size_t next_n)
{
#ifdef HAVE_STREAMING_STORES
    if (n >= 4096) {
        size_t head = (size_t)(-(uintptr_t)dst & 15);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        size_t ahead = next != NULL ? (next_n < body ? next_n : body) : 0;
        for (size_t i = 0; i < body; i += 64) {
            if (i < ahead)
                __builtin_prefetch(next + i, 0, 0);
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
    (void)next;
    (void)next_n;
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

/* Spin (yielding the CPU) until there is work, stop, or SPIN_NS pass. Unlocked. */
static void spin_for_work(kvoffload_queue *q)
{
    int64_t until = now() + SPIN_NS;
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
        int64_t t = now();
        if (job->held_ns != NULL) {
            /* Time this job alone held the queue: from its start, or from the previous
             * completion if later, to now. Summed over jobs, the queue's busy time. */
            int64_t from = job->start > q->last_done ? job->start : q->last_done;
            *job->held_ns = job->start > 0 && t > from ? t - from : 0;
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
            const uint64_t *next = i + 1 < end ? piece + 3 : NULL;
            copy_bytes((char *)(uintptr_t)piece[0], (const char *)(uintptr_t)piece[1],
                       (size_t)piece[2], next ? (const char *)(uintptr_t)next[1] : NULL,
                       next ? (size_t)next[2] : 0);
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

/* Append ``job`` (pieces, count, left and held_ns set) and return its sequence number. */
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
 * memory was left (nothing queued). ``held_ns`` (may be NULL) receives, at completion,
 * the nanoseconds the job alone held the queue. */
uint64_t kvoffload_queue_push(kvoffload_queue *q, const uint64_t *pieces, uint64_t count,
                              int64_t *held_ns)
{
    kvo_job *job = calloc(1, sizeof *job);
    if (job == NULL)
        return 0;
    job->pieces = pieces;
    job->count = count;
    job->left = count;
    job->held_ns = held_ns;
    return push_job(q, job);
}

/* Queue ``job`` (``len`` values, see ``_copy.h``) planned against ``layout``; the queue
 * builds and owns its pieces and writes the job's ``bytes`` now and ``held_ns`` at
 * completion (``job`` must stay alive until then). Returns the sequence number; 0 if no
 * memory was left, UINT64_MAX if the job is refused: malformed, or a page outside the
 * layout (nothing queued either way). */
uint64_t kvoffload_queue_push_job(kvoffload_queue *q, const kvoffload_layout *layout,
                                  int64_t *job, uint64_t len)
{
    kvo_pieces list = {0};
    int status = kvo_plan_job(layout, job, len, &list);
    if (status != KVO_OK) {
        free(list.at);
        return status == KVO_BAD_JOB ? UINT64_MAX : 0;
    }
    kvo_job *queued = calloc(1, sizeof *queued);
    if (queued == NULL) {
        free(list.at);
        return 0;
    }
    queued->owned = list.at;
    queued->pieces = list.at;
    queued->count = job[KVO_JOB_FLAGS] & KVO_FAIL_MIDWAY ? list.count / 2 : list.count;
    queued->left = queued->count;
    queued->held_ns = &job[KVO_JOB_HELD_NS];
    return push_job(q, queued);
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
