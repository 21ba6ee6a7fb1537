/* Where the pool is and how to reach it, found as the Python driver finds
 * it (agent/driver/device.py, connect):
 *
 *   endpoint  the guest agent's answer to "where" (its local socket,
 *             $ACCELMIG_AGENT_SOCKET or /run/accelmig/agent.sock), else
 *             $ACCELMIG_ENDPOINT, else the config file's `endpoint`
 *   token     $ACCELMIG_TOKEN, else the file's `token` or `token_file`
 *   TLS       $ACCELMIG_INSECURE / $ACCELMIG_CAFILE, else the file's
 *             `insecure` / `cafile`; neither: TLS with the system's trust store
 *   timeout   $ACCELMIG_TIMEOUT, else the file's `timeout` (seconds a call
 *             waits for the pool, connected or not; default 60)
 *   domain    this guest's SMBIOS system UUID (/sys/class/dmi/id/product_uuid,
 *             root's), else the guest agent's (`where`): the domain told at
 *             open, which binding proofs are made for (agent/dmi.py)
 *
 * The config file is $ACCELMIG_DRIVER_CONFIG, else /etc/accelmig/driver.toml
 * (absent: fine): a TOML subset, `key = value` lines, values "strings",
 * true/false or numbers, # comments, a [driver] table or none. */
#ifndef ACCELMIG_CONFIG_H
#define ACCELMIG_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "errors.h"

#define AM_DEFAULT_CONFIG "/etc/accelmig/driver.toml"
#define AM_DEFAULT_AGENT_SOCKET "/run/accelmig/agent.sock"
#define AM_MAX_TOKEN 4096

typedef struct am_config {
    char endpoint[320];
    char token[AM_MAX_TOKEN + 1];
    char token_file[4096];
    char cafile[4096];
    int insecure;            /* -1 unset, 0, 1 */
    double timeout;          /* seconds a call waits for the pool */
    double connect_timeout;  /* seconds one connection attempt may take */
    char agent_socket[108];
    char domain[40];         /* this guest's SMBIOS system UUID ("" none): the domain told at open */
    char source[4096];       /* the config file read ("" if none) */
    uint32_t window_commands;
    uint64_t window_bytes;
} am_config;

/* Everything, from the environment, the file and the agent.  Fails
 * (CONFIG_INVALID) only for a file that is there and wrong; a missing
 * endpoint or token is said by am_config_ready. */
int am_config_load(am_config *cfg, am_error *err);
/* The file's text (what am_config_load reads; fuzzed). */
int am_config_parse(am_config *cfg, const char *text, size_t len, const char *source, am_error *err);
void am_config_defaults(am_config *cfg);
/* 0 when an endpoint and a token are known; else -1 and why. */
int am_config_ready(const am_config *cfg, am_error *err);
/* This guest's domain as the guest agent at `path` reads it (root reads
 * the SMBIOS UUID; a driver of another user asks the agent): "" none. */
void am_agent_domain(const char *path, char *out, size_t size);
/* A UUID as wire.dataplane.domain_claim takes it (case, surrounding space),
 * into canonical lower case, unless it is a firmware's placeholder: 0 or -1. */
int am_domain_claim(const char *text, size_t len, char out[40]);

#endif
