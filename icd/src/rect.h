/* Rectangles of OpenCL's rect transfers (clEnqueue{Read,Write,Copy}BufferRect):
 * origins and regions in bytes, rows, slices; pitches resolved as OpenCL
 * says (0: packed).  Checked with overflow in mind: every extent fits. */
#ifndef ACCELMIG_RECT_H
#define ACCELMIG_RECT_H

#include <CL/cl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct am_rect {
    size_t origin[3];
    size_t region[3];
    size_t row_pitch, slice_pitch;
    size_t offset;   /* of the first byte */
    size_t extent;   /* one past the last byte */
} am_rect;

/* CL_SUCCESS, or CL_INVALID_VALUE for a region with a zero, pitches that
 * break OpenCL's rules, or extents that overflow. */
cl_int am_rect_make(am_rect *rect, const size_t origin[3], const size_t region[3], size_t row_pitch,
                    size_t slice_pitch);
size_t am_rect_packed_size(const am_rect *rect);
/* Copy the host rectangle `host` at `base` into `packed` (rows then slices), or back. */
void am_rect_pack(const am_rect *host, const uint8_t *base, uint8_t *packed);
void am_rect_unpack(const am_rect *host, uint8_t *base, const uint8_t *packed);
/* OpenCL's CL_MEM_COPY_OVERLAP test for a copy within one buffer. */
bool am_rect_overlap(const am_rect *src, const am_rect *dst);

#endif
