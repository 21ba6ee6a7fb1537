/* The one dispatch table every object of this driver points at: the
 * Khronos loader calls each API function through it (cl_icd.h's layout).
 * Filled when the library is loaded, from each API file's share; the
 * sharing extensions of other systems (Direct3D, DX9 media) have no entry
 * on Linux, and GL, EGL and the rest answer CL_INVALID_OPERATION or their
 * own "not supported" code (api_stubs.c): never a missing entry. */
#include "icd.h"

cl_icd_dispatch am_dispatch;

void am_platform_functions(cl_icd_dispatch *d);
void am_context_functions(cl_icd_dispatch *d);
void am_queue_functions(cl_icd_dispatch *d);
void am_memory_functions(cl_icd_dispatch *d);
void am_program_functions(cl_icd_dispatch *d);
void am_event_functions(cl_icd_dispatch *d);
void am_enqueue_functions(cl_icd_dispatch *d);
void am_stub_functions(cl_icd_dispatch *d);

__attribute__((constructor)) static void fill_dispatch(void) {
    am_stub_functions(&am_dispatch);
    am_platform_functions(&am_dispatch);
    am_context_functions(&am_dispatch);
    am_queue_functions(&am_dispatch);
    am_memory_functions(&am_dispatch);
    am_program_functions(&am_dispatch);
    am_event_functions(&am_dispatch);
    am_enqueue_functions(&am_dispatch);
}
