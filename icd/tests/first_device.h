/* The test programs' first step: the first platform the loader lists (the
 * driver under test) and its first device; 0, or 2 after saying why. */
#ifndef ACCELMIG_TESTS_FIRST_DEVICE_H
#define ACCELMIG_TESTS_FIRST_DEVICE_H
#include <CL/cl.h>
#include <stdio.h>

static int first_device(cl_platform_id *platform, cl_device_id *dev) {
    if (clGetPlatformIDs(1, platform, NULL) != CL_SUCCESS ||
        clGetDeviceIDs(*platform, CL_DEVICE_TYPE_ALL, 1, dev, NULL) != CL_SUCCESS) {
        printf("no device\n");
        return 2;
    }
    return 0;
}
#endif
