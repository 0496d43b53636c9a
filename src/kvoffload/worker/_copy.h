/*
 * What the two halves of kvoffload's native copy library share: the copy queue
 * (``_copy.c``) and the planner that turns a job's pages into copy pieces (``_copy_plan.c``).
 *
 * The layout table. Handed over once, when the backend binds the engine caches and the host
 * arena (``kvoffload_layout_new``), as ``uint64`` values:
 *
 *     num_slots, slot_bytes, chunk, sort_bytes, ngroups,
 *     then per group: group id, factor, num_blocks, nsegments,
 *                     then per segment: engine, stride, page, host
 *
 * ``engine`` is the address of the segment's engine block 0, ``stride`` the bytes between
 * engine blocks, ``page`` the bytes of one page, ``host`` the arena address of the
 * segment's sub-block 0 in slot 0; sub-block ``k`` of slot ``s`` lies at
 * ``host + s * slot_bytes + k * page``. The caller guarantees that this memory holds
 * ``num_blocks`` engine blocks and ``num_slots`` slots, and stays where it is until the
 * layout is freed. Runs longer than ``chunk`` bytes are cut; a job whose pieces average at
 * least ``sort_bytes`` is copied in ascending source address order.
 *
 * A job. One per transfer job, as ``int64`` values:
 *
 *     held_ns, bytes, flags, nparts,
 *     then per part: group id, first_block_index, nblocks, nslots,
 *                    nblocks engine block ids, nslots slots
 *
 * ``held_ns`` and ``bytes`` are written by the library: ``bytes`` when the job is planned
 * (the bytes it moves), ``held_ns`` when a queued job completes (the nanoseconds it alone
 * held the queue). ``flags`` is ``KVO_STORE`` (engine to arena; else arena to engine) and
 * ``KVO_FAIL_MIDWAY`` (copy only the first half of the pieces: fault injection). Page ``i``
 * of a part is engine block ``block_ids[i]`` and sub-block ``p % factor`` of slot
 * ``slots[p / factor]``, ``p = first_block_index % factor + i`` (``%`` as in Python: never
 * negative). A job is planned whole or not at all: it is refused (``KVO_BAD_JOB``) if it
 * is malformed, names a group the layout lacks, a block id outside ``[0, num_blocks)``, a
 * slot outside ``[0, num_slots)``, or a slot count other than
 * ``ceil((first_block_index % factor + nblocks) / factor)``. A part of no blocks copies
 * nothing (its slots are not read).
 */
#ifndef KVOFFLOAD_COPY_H
#define KVOFFLOAD_COPY_H

#include <stdint.h>

#define KVO_STORE 1
#define KVO_FAIL_MIDWAY 2

/* Status of planning a job. */
#define KVO_OK 0
#define KVO_BAD_JOB 1
#define KVO_NO_MEMORY 2

/* Offsets of the fields of a job. */
#define KVO_JOB_HELD_NS 0
#define KVO_JOB_BYTES 1
#define KVO_JOB_FLAGS 2
#define KVO_JOB_NPARTS 3
#define KVO_JOB_HEADER 4

typedef struct kvoffload_layout kvoffload_layout;

/* A growing array of pieces: ``count`` triples (destination, source, bytes). */
typedef struct {
    uint64_t *at;
    uint64_t count;
    uint64_t capacity;
} kvo_pieces;

/* Plan ``job`` (``len`` values) against ``layout`` into ``out`` (empty on entry; the caller
 * frees ``out->at`` whatever the result) and write its ``bytes`` field. KVO_OK,
 * KVO_BAD_JOB (nothing planned) or KVO_NO_MEMORY. */
int kvo_plan_job(const kvoffload_layout *layout, int64_t *job, uint64_t len, kvo_pieces *out);

#endif
