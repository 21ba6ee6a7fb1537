/* What the driver says on stderr: "accelmig-opencl: LEVEL: ...".
 * ACCELMIG_ICD_LOG=error|warning|info|debug (default warning). */
#ifndef ACCELMIG_LOG_H
#define ACCELMIG_LOG_H

enum am_log_level { AM_LOG_ERROR, AM_LOG_WARNING, AM_LOG_INFO, AM_LOG_DEBUG };

void am_log(enum am_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int am_log_enabled(enum am_log_level level);

#define am_error_log(...) am_log(AM_LOG_ERROR, __VA_ARGS__)
#define am_warn(...) am_log(AM_LOG_WARNING, __VA_ARGS__)
#define am_info(...) am_log(AM_LOG_INFO, __VA_ARGS__)
#define am_debug(...) am_log(AM_LOG_DEBUG, __VA_ARGS__)

#endif
