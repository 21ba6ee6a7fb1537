#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const LEVEL_NAMES[] = {"error", "warning", "info", "debug"};

/* Read once: the level never changes while the process runs. */
static int threshold = -1;
static pthread_once_t threshold_once = PTHREAD_ONCE_INIT;

static void read_threshold(void) {
    const char *value = getenv("ACCELMIG_ICD_LOG");
    threshold = AM_LOG_WARNING;
    if (value == NULL)
        return;
    for (int i = 0; i <= AM_LOG_DEBUG; i++)
        if (strcmp(value, LEVEL_NAMES[i]) == 0)
            threshold = i;
}

int am_log_enabled(enum am_log_level level) {
    pthread_once(&threshold_once, read_threshold);
    return (int)level <= threshold;
}

void am_log(enum am_log_level level, const char *fmt, ...) {
    if (!am_log_enabled(level))
        return;
    char line[1024];
    va_list args;
    va_start(args, fmt);
    int n = vsnprintf(line, sizeof line, fmt, args);
    va_end(args);
    if (n < 0)
        return;
    /* one write per line, so lines of several threads do not interleave */
    fprintf(stderr, "accelmig-opencl: %s: %s\n", LEVEL_NAMES[level], line);
}
