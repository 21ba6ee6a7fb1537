/* One connection to the pool: TCP, and TLS over it unless insecure
 * (OpenSSL, the Python driver's rules: wire/tls.py).  The pool's
 * certificate must verify against the CA file (else the system's trust
 * store) and name the endpoint's host (an IP endpoint: an IP SAN); TLS 1.2
 * at least.  `binding` is what ownership proofs are bound to: the pool's
 * certificate's SHA-256 (tls-server-end-point), and under TLS 1.2 the
 * handshake's tls-unique, exactly as wire.tls.channel_binding makes it.
 *
 * The socket is non-blocking.  Only one thread uses a link at a time (the
 * handshake's caller, then the session's I/O thread): OpenSSL's SSL object
 * must not be used by two threads at once.  Writes never raise SIGPIPE. */
#ifndef ACCELMIG_LINK_H
#define ACCELMIG_LINK_H

#include <openssl/ssl.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "errors.h"

#define AM_BINDING_MAX 160

typedef struct am_link {
    int fd;
    int abort_fd;             /* readable: give up waiting (an explicit resume preempts a reconnect); -1 none */
    SSL *ssl;                 /* NULL: plain TCP */
    BIO_METHOD *bio_method;   /* owned: the MSG_NOSIGNAL socket BIO */
    unsigned char binding[AM_BINDING_MAX];
    size_t binding_len;
    bool tls_resumed;
} am_link;

/* The client context: verification as described above (owned by the caller). */
SSL_CTX *am_tls_context(const char *cafile, am_error *err);
/* Split "HOST:PORT" / "[V6]:PORT" (wire.dataplane.parse_endpoint's rules). */
int am_parse_endpoint(const char *endpoint, char *host, size_t host_size, int *port);

/* Connect and, with `tls`, handshake, within `timeout` seconds.  `offer`
 * (may be NULL): a TLS session of an earlier connection to the same
 * endpoint, offered for resumption (a ticket the pool no longer takes is a
 * full handshake).  `abort_fd` (-1: none): while it is readable every wait
 * of this link gives up (UNAVAILABLE), the handshake's and its frames'. */
int am_link_dial(am_link *link, SSL_CTX *tls, const char *endpoint, double timeout, SSL_SESSION *offer,
                 int abort_fd, am_error *err);
/* The TLS session to offer the next connection to the same endpoint (the
 * caller owns it: SSL_SESSION_free), or NULL (plain TCP, none resumable:
 * under TLS 1.3 the pool's ticket comes after the handshake, so ask once
 * a frame was read). */
SSL_SESSION *am_link_tls_session(const am_link *link);
void am_link_close(am_link *link);

/* Blocking until `deadline` (am_now()): the handshake's frames. */
int am_link_send_all(am_link *link, const void *data, size_t len, double deadline, am_error *err);
/* Some bytes (>0), 0 at the peer's close, -1 on error or at the deadline. */
ssize_t am_link_recv(am_link *link, void *buf, size_t len, double deadline, am_error *err);

/* Non-blocking: >0 bytes moved, 0 (read only) the peer closed, -1 an error
 * (`err` says), AM_LINK_AGAIN: wait for `*want` (POLLIN or POLLOUT) and retry. */
#define AM_LINK_AGAIN (-2)
ssize_t am_link_read(am_link *link, void *buf, size_t len, short *want, am_error *err);
ssize_t am_link_write(am_link *link, const void *buf, size_t len, short *want, am_error *err);
/* Bytes TLS holds already decrypted (poll does not see them). */
bool am_link_buffered(const am_link *link);

double am_now(void);

#endif
