#include "rect.h"

#include <string.h>

static bool mul(size_t a, size_t b, size_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}

static bool add(size_t a, size_t b, size_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

cl_int am_rect_make(am_rect *rect, const size_t origin[3], const size_t region[3], size_t row_pitch,
                    size_t slice_pitch) {
    if (region[0] == 0 || region[1] == 0 || region[2] == 0)
        return CL_INVALID_VALUE;
    if (row_pitch == 0)
        row_pitch = region[0];
    if (row_pitch < region[0])
        return CL_INVALID_VALUE;
    size_t rows_bytes;
    if (!mul(row_pitch, region[1], &rows_bytes))
        return CL_INVALID_VALUE;
    if (slice_pitch == 0)
        slice_pitch = rows_bytes;
    if (slice_pitch < rows_bytes || slice_pitch % row_pitch != 0)
        return CL_INVALID_VALUE;
    size_t a, b, offset, extent;
    if (!mul(origin[2], slice_pitch, &a) || !mul(origin[1], row_pitch, &b) || !add(a, b, &offset) ||
        !add(offset, origin[0], &offset))
        return CL_INVALID_VALUE;
    if (!mul(region[2] - 1, slice_pitch, &a) || !mul(region[1] - 1, row_pitch, &b) || !add(offset, a, &extent) ||
        !add(extent, b, &extent) || !add(extent, region[0], &extent) || extent > (size_t)INT64_MAX)
        return CL_INVALID_VALUE;
    size_t packed;
    if (!mul(region[0], region[1], &packed) || !mul(packed, region[2], &packed))
        return CL_INVALID_VALUE;
    memcpy(rect->origin, origin, sizeof rect->origin);
    memcpy(rect->region, region, sizeof rect->region);
    rect->row_pitch = row_pitch;
    rect->slice_pitch = slice_pitch;
    rect->offset = offset;
    rect->extent = extent;
    return CL_SUCCESS;
}

size_t am_rect_packed_size(const am_rect *rect) {
    return rect->region[0] * rect->region[1] * rect->region[2];
}

void am_rect_pack(const am_rect *host, const uint8_t *base, uint8_t *packed) {
    for (size_t z = 0; z < host->region[2]; z++)
        for (size_t y = 0; y < host->region[1]; y++) {
            memcpy(packed, base + host->offset + z * host->slice_pitch + y * host->row_pitch, host->region[0]);
            packed += host->region[0];
        }
}

void am_rect_unpack(const am_rect *host, uint8_t *base, const uint8_t *packed) {
    for (size_t z = 0; z < host->region[2]; z++)
        for (size_t y = 0; y < host->region[1]; y++) {
            memcpy(base + host->offset + z * host->slice_pitch + y * host->row_pitch, packed, host->region[0]);
            packed += host->region[0];
        }
}

/* The OpenCL specification's check_copy_overlap (1.2, appendix "CL_MEM_COPY_OVERLAP"),
 * for a copy within one buffer whose two sides share their pitches; sides
 * with pitches of their own overlap when their byte ranges do (a bound). */
bool am_rect_overlap(const am_rect *src, const am_rect *dst) {
    if (src->row_pitch != dst->row_pitch || src->slice_pitch != dst->slice_pitch)
        return !(dst->extent <= src->offset || src->extent <= dst->offset);
    const size_t *region = src->region;
    const size_t row_pitch = src->row_pitch, slice_pitch = src->slice_pitch;
    const size_t slice_size = (region[1] - 1) * row_pitch + region[0];
    const size_t block_size = (region[2] - 1) * slice_pitch + slice_size;
    const size_t src_start = src->offset, src_end = src_start + block_size;
    const size_t dst_start = dst->offset, dst_end = dst_start + block_size;
    if (dst_end <= src_start || src_end <= dst_start)
        return false;
    const size_t src_dx = src->origin[0] % row_pitch, dst_dx = dst->origin[0] % row_pitch;
    if ((dst_dx >= src_dx + region[0] && dst_dx + region[0] <= src_dx + row_pitch) ||
        (src_dx >= dst_dx + region[0] && src_dx + region[0] <= dst_dx + row_pitch))
        return false;
    const size_t src_dy = (src->origin[1] * row_pitch + src->origin[0]) % slice_pitch;
    const size_t dst_dy = (dst->origin[1] * row_pitch + dst->origin[0]) % slice_pitch;
    if ((dst_dy >= src_dy + slice_size && dst_dy + slice_size <= src_dy + slice_pitch) ||
        (src_dy >= dst_dy + slice_size && src_dy + slice_size <= dst_dy + slice_pitch))
        return false;
    return true;
}
