/*
 * kvoffload's native planner: the layout table (handed over once, at bind) and the
 * planning of one job into copy pieces against it, with every page checked first. The
 * formats of both are in ``_copy.h``.
 *
 * Pages that continue the previous page of their segment on both sides merge into one
 * piece; pieces longer than the layout's ``chunk`` are cut; a job whose pieces average at
 * least ``sort_bytes`` is put in ascending source address order (reading memory front to
 * back). The Python planner of ``cpu_common.py`` builds the same pieces (the tests compare
 * the two).
 */
#include <stdlib.h>
#include <string.h>

#include "_copy.h"

typedef struct {
    int present;
    uint64_t factor;
    uint64_t num_blocks;
    uint64_t nsegments;
    uint64_t page_bytes;        /* one engine block's pages in all segments together */
    const uint64_t *segments;   /* nsegments quadruples, in the layout's copy of the table */
} kvo_group;

struct kvoffload_layout {
    uint64_t num_slots;
    uint64_t slot_bytes;
    uint64_t chunk;
    uint64_t sort_bytes;
    uint64_t ngroups;           /* entries of ``groups``: the largest group id + 1 */
    kvo_group *groups;
    uint64_t *table;
};

#define TABLE_HEADER 5
#define GROUP_HEADER 4
#define SEGMENT_FIELDS 4
#define PART_HEADER 4
#define MAX_GROUP_ID 65535

#define LAYOUT_MALFORMED 1

/* The largest group id of ``table``, or -1 if the table is malformed (lengths that do not
 * add up, a factor or group id out of range, a group id twice: later caught by
 * ``fill_groups``). */
static int64_t largest_group_id(const uint64_t *table, uint64_t len)
{
    if (len < TABLE_HEADER)
        return -1;
    int64_t largest = -1;
    uint64_t at = TABLE_HEADER;
    for (uint64_t g = 0; g < table[4]; g++) {
        if (len - at < GROUP_HEADER)
            return -1;
        uint64_t id = table[at], factor = table[at + 1], nsegments = table[at + 3];
        if (id > MAX_GROUP_ID || factor < 1 || factor > (uint64_t)INT64_MAX
            || nsegments > (len - at - GROUP_HEADER) / SEGMENT_FIELDS)
            return -1;
        if ((int64_t)id > largest)
            largest = (int64_t)id;
        at += GROUP_HEADER + SEGMENT_FIELDS * nsegments;
    }
    return at == len ? largest : -1;
}

/* Point ``layout->groups`` into ``layout->table``; LAYOUT_MALFORMED if an id repeats. */
static int fill_groups(kvoffload_layout *layout)
{
    const uint64_t *table = layout->table;
    uint64_t at = TABLE_HEADER;
    for (uint64_t g = 0; g < table[4]; g++) {
        kvo_group *group = &layout->groups[table[at]];
        if (group->present)
            return LAYOUT_MALFORMED;
        group->present = 1;
        group->factor = table[at + 1];
        group->num_blocks = table[at + 2];
        group->nsegments = table[at + 3];
        group->segments = table + at + GROUP_HEADER;
        for (uint64_t s = 0; s < group->nsegments; s++)
            group->page_bytes += group->segments[SEGMENT_FIELDS * s + 2];
        at += GROUP_HEADER + SEGMENT_FIELDS * group->nsegments;
    }
    return 0;
}

void kvoffload_layout_free(kvoffload_layout *layout)
{
    if (layout == NULL)
        return;
    free(layout->groups);
    free(layout->table);
    free(layout);
}

/* A layout from ``table`` (``len`` values, see ``_copy.h``; copied, so the caller may free
 * it) into ``*out``. Returns 0, 1 if the table is malformed, 2 if no memory was left (``*out``
 * NULL either way). */
int kvoffload_layout_new(const uint64_t *table, uint64_t len, kvoffload_layout **out)
{
    *out = NULL;
    int64_t largest = largest_group_id(table, len);
    if (largest < 0)
        return LAYOUT_MALFORMED;
    kvoffload_layout *layout = calloc(1, sizeof *layout);
    if (layout == NULL)
        return KVO_NO_MEMORY;
    layout->ngroups = (uint64_t)largest + 1;
    layout->groups = calloc(layout->ngroups, sizeof *layout->groups);
    layout->table = malloc(len * sizeof *table);
    if (layout->groups == NULL || layout->table == NULL) {
        kvoffload_layout_free(layout);
        return KVO_NO_MEMORY;
    }
    memcpy(layout->table, table, len * sizeof *table);
    layout->num_slots = table[0];
    layout->slot_bytes = table[1];
    layout->chunk = table[2] > 0 ? table[2] : UINT64_MAX;
    layout->sort_bytes = table[3];
    if (fill_groups(layout)) {
        kvoffload_layout_free(layout);
        return LAYOUT_MALFORMED;
    }
    *out = layout;
    return 0;
}

/* The group of a part, or NULL if the layout has none of that id. */
static const kvo_group *group_of(const kvoffload_layout *layout, int64_t id)
{
    if (id < 0 || (uint64_t)id >= layout->ngroups || !layout->groups[id].present)
        return NULL;
    return &layout->groups[id];
}

/* The sub-block of logical block ``index`` in its offloaded block: ``index % factor``,
 * never negative (as Python's ``%``). */
static uint64_t sub_block_of(int64_t index, uint64_t factor)
{
    int64_t sub = index % (int64_t)factor;
    return (uint64_t)(sub < 0 ? sub + (int64_t)factor : sub);
}

/* Check the part at ``part`` (``room`` values left in the job) and return the values it
 * takes, or 0 if it is bad (see ``_copy.h``). Adds its bytes to ``*bytes``. */
static uint64_t check_part(const kvoffload_layout *layout, const int64_t *part, uint64_t room,
                           uint64_t *bytes)
{
    if (room < PART_HEADER)
        return 0;
    const kvo_group *group = group_of(layout, part[0]);
    int64_t first = part[1], nblocks = part[2], nslots = part[3];
    if (group == NULL || nblocks < 0 || nslots < 0)
        return 0;
    room -= PART_HEADER;
    if ((uint64_t)nblocks > room || (uint64_t)nslots > room - (uint64_t)nblocks)
        return 0;
    const int64_t *block_ids = part + PART_HEADER, *slots = block_ids + nblocks;
    if (nblocks > 0) {
        uint64_t skip = sub_block_of(first, group->factor);
        if ((uint64_t)nslots != (skip + (uint64_t)nblocks + group->factor - 1) / group->factor)
            return 0;
        for (int64_t i = 0; i < nblocks; i++)
            if (block_ids[i] < 0 || (uint64_t)block_ids[i] >= group->num_blocks)
                return 0;
        for (int64_t k = 0; k < nslots; k++)
            if (slots[k] < 0 || (uint64_t)slots[k] >= layout->num_slots)
                return 0;
    }
    *bytes += (uint64_t)nblocks * group->page_bytes;
    return PART_HEADER + (uint64_t)nblocks + (uint64_t)nslots;
}

static int append_piece(kvo_pieces *list, uint64_t dst, uint64_t src, uint64_t n)
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
static int append_run(kvo_pieces *list, uint64_t dst, uint64_t src, uint64_t n,
                      uint64_t chunk)
{
    for (uint64_t off = 0; off < n; off += chunk)
        if (append_piece(list, dst + off, src + off, n - off < chunk ? n - off : chunk))
            return -1;
    return 0;
}

/* Append the pieces of one checked part with blocks, segment after segment. */
static int plan_part(const kvoffload_layout *layout, const int64_t *part, int store,
                     kvo_pieces *out)
{
    const kvo_group *group = group_of(layout, part[0]);
    uint64_t factor = group->factor, skip = sub_block_of(part[1], factor);
    uint64_t npages = (uint64_t)part[2], slot_bytes = layout->slot_bytes, chunk = layout->chunk;
    const int64_t *block_ids = part + PART_HEADER, *slots = block_ids + npages;
    for (uint64_t s = 0; s < group->nsegments; s++) {
        const uint64_t *segment = group->segments + SEGMENT_FIELDS * s;
        uint64_t engine = segment[0], stride = segment[1], page = segment[2], host = segment[3];
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
            if (run > 0 && append_run(out, run_dst, run_src, run, chunk))
                return KVO_NO_MEMORY;
            run_dst = dst;
            run_src = src;
            run = page;
        }
        if (run > 0 && append_run(out, run_dst, run_src, run, chunk))
            return KVO_NO_MEMORY;
    }
    return KVO_OK;
}

static int by_source(const void *a, const void *b)
{
    uint64_t x = ((const uint64_t *)a)[1], y = ((const uint64_t *)b)[1];
    return (x > y) - (x < y);
}

int kvo_plan_job(const kvoffload_layout *layout, int64_t *job, uint64_t len, kvo_pieces *out)
{
    if (len < KVO_JOB_HEADER || job[KVO_JOB_NPARTS] < 0)
        return KVO_BAD_JOB;
    uint64_t nparts = (uint64_t)job[KVO_JOB_NPARTS], bytes = 0, at = KVO_JOB_HEADER;
    for (uint64_t k = 0; k < nparts; k++) { /* every part checked before any is planned */
        uint64_t taken = check_part(layout, job + at, len - at, &bytes);
        if (taken == 0)
            return KVO_BAD_JOB;
        at += taken;
    }
    if (at != len)
        return KVO_BAD_JOB;
    int store = (job[KVO_JOB_FLAGS] & KVO_STORE) != 0;
    at = KVO_JOB_HEADER;
    for (uint64_t k = 0; k < nparts; k++) {
        const int64_t *part = job + at;
        if (part[2] > 0 && plan_part(layout, part, store, out))
            return KVO_NO_MEMORY;
        at += PART_HEADER + (uint64_t)part[2] + (uint64_t)part[3];
    }
    if (out->count > 0 && bytes / out->count >= layout->sort_bytes) /* average piece */
        qsort(out->at, out->count, 3 * sizeof *out->at, by_source);
    job[KVO_JOB_BYTES] = (int64_t)bytes;
    return KVO_OK;
}

/* The pieces kvoffload_queue_push_job would queue for ``job`` (all of them, whatever
 * KVO_FAIL_MIDWAY), written to ``out`` (room for ``capacity`` triples); writes the job's
 * ``bytes``. Returns their number (more than ``capacity``: nothing written), UINT64_MAX - 1
 * if no memory was left, UINT64_MAX if the job is refused (see ``_copy.h``). */
uint64_t kvoffload_plan_job(const kvoffload_layout *layout, int64_t *job, uint64_t len,
                            uint64_t *out, uint64_t capacity)
{
    kvo_pieces list = {0};
    int status = kvo_plan_job(layout, job, len, &list);
    if (status != KVO_OK) {
        free(list.at);
        return status == KVO_BAD_JOB ? UINT64_MAX : UINT64_MAX - 1;
    }
    uint64_t count = list.count;
    if (count <= capacity && count > 0)
        memcpy(out, list.at, 3 * count * sizeof *out);
    free(list.at);
    return count;
}
