#include "link.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/sha.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

double am_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* 1 ready, 0 the deadline passed, -1 an error or `abort_fd` readable (errno ECANCELED) */
static int wait_fd(int fd, short events, double deadline, int abort_fd) {
    for (;;) {
        double left = deadline - am_now();
        if (left <= 0)
            return 0;
        struct pollfd pfd[2] = {{.fd = fd, .events = events}, {.fd = abort_fd, .events = POLLIN}};
        int ms = left > 3600 ? 3600000 : (int)(left * 1000) + 1;
        int n = poll(pfd, abort_fd >= 0 ? 2 : 1, ms);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        if (abort_fd >= 0 && pfd[1].revents) {
            errno = ECANCELED;
            return -1;
        }
        if (n > 0)
            return 1;
    }
}

/* -- a socket BIO whose writes cannot raise SIGPIPE in the application -------------- */
static int bio_write(BIO *bio, const char *data, int len) {
    int fd = (int)(intptr_t)BIO_get_data(bio);
    BIO_clear_retry_flags(bio);
    ssize_t n = send(fd, data, (size_t)len, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        BIO_set_retry_write(bio);
    return (int)n;
}

static int bio_read(BIO *bio, char *data, int len) {
    int fd = (int)(intptr_t)BIO_get_data(bio);
    BIO_clear_retry_flags(bio);
    ssize_t n = recv(fd, data, (size_t)len, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        BIO_set_retry_read(bio);
    return (int)n;
}

static long bio_ctrl(BIO *bio, int cmd, long num, void *ptr) {
    (void)bio, (void)num, (void)ptr;
    return cmd == BIO_CTRL_FLUSH ? 1 : 0;
}

static int bio_create(BIO *bio) {
    BIO_set_init(bio, 1);
    return 1;
}

static BIO_METHOD *socket_bio_method(void) {
    BIO_METHOD *method = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "accelmig socket");
    if (method == NULL)
        return NULL;
    if (!BIO_meth_set_write(method, bio_write) || !BIO_meth_set_read(method, bio_read) ||
        !BIO_meth_set_ctrl(method, bio_ctrl) || !BIO_meth_set_create(method, bio_create)) {
        BIO_meth_free(method);
        return NULL;
    }
    return method;
}

static void ssl_reason(char *out, size_t size) {
    unsigned long code = ERR_get_error();
    if (code == 0)
        snprintf(out, size, "no reason given");
    else
        ERR_error_string_n(code, out, size);
    ERR_clear_error();
}

SSL_CTX *am_tls_context(const char *cafile, am_error *err) {
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    char why[200];
    if (ctx == NULL) {
        ssl_reason(why, sizeof why);
        am_error_set(err, "CONFIG_INVALID", "TLS: %s", why);
        return NULL;
    }
    if (!SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION))
        goto fail;
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    if (cafile != NULL && cafile[0] != 0) {
        if (SSL_CTX_load_verify_locations(ctx, cafile, NULL) != 1) {
            ssl_reason(why, sizeof why);
            am_error_set(err, "CONFIG_INVALID", "invalid configuration in %s: TLS: %s", cafile, why);
            SSL_CTX_free(ctx);
            return NULL;
        }
    } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
        goto fail;
    }
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    return ctx;
fail:
    ssl_reason(why, sizeof why);
    am_error_set(err, "CONFIG_INVALID", "TLS: %s", why);
    SSL_CTX_free(ctx);
    return NULL;
}

int am_parse_endpoint(const char *endpoint, char *host, size_t host_size, int *port) {
    const char *colon;
    size_t host_len;
    if (endpoint == NULL || endpoint[0] == 0 || strlen(endpoint) > 300)
        return -1;
    if (endpoint[0] == '[') {
        const char *close = strchr(endpoint, ']');
        if (close == NULL || close[1] != ':')
            return -1;
        host_len = (size_t)(close - endpoint - 1);
        if (host_len == 0 || host_len >= host_size)
            return -1;
        memcpy(host, endpoint + 1, host_len);
        host[host_len] = 0;
        struct in6_addr v6;
        if (inet_pton(AF_INET6, host, &v6) != 1)
            return -1;
        colon = close + 1;
    } else {
        colon = strrchr(endpoint, ':');
        if (colon == NULL)
            return -1;
        host_len = (size_t)(colon - endpoint);
        if (host_len == 0 || host_len >= host_size || memchr(endpoint, ':', host_len) != NULL)
            return -1;
        for (size_t i = 0; i < host_len; i++) {
            char c = endpoint[i];
            if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                  c == '-' || c == '_'))
                return -1;
        }
        memcpy(host, endpoint, host_len);
        host[host_len] = 0;
    }
    const char *digits = colon + 1;
    size_t n = strlen(digits);
    if (n == 0 || n > 5 || strspn(digits, "0123456789") != n)
        return -1;
    long value = strtol(digits, NULL, 10);
    if (value < 1 || value > 65535)
        return -1;
    *port = (int)value;
    return 0;
}

static void configure(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    /* a path that vanished (the guest moved to another subnet) fails
     * silently: let the kernel give up on it within ~15 s (as the Python driver) */
    int idle = 5, interval = 2, count = 3;
    unsigned int user_timeout = 15000;
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout);
}

static int connect_tcp(const char *host, int port, double deadline, int abort_fd, const char *endpoint,
                       am_error *err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *found = NULL;
    char service[8];
    snprintf(service, sizeof service, "%d", port);
    int rc = getaddrinfo(host, service, &hints, &found);
    if (rc != 0) {
        am_error_set(err, "UNAVAILABLE", "the pool at %s is unavailable: %s", endpoint, gai_strerror(rc));
        return -1;
    }
    int fd = -1, last = 0;
    for (struct addrinfo *ai = found; ai != NULL && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            last = errno;
            continue;
        }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
            last = errno;
            close(fd);
            fd = -1;
            continue;
        }
        int ready = wait_fd(fd, POLLOUT, deadline, abort_fd);
        int soerr = 0;
        socklen_t len = sizeof soerr;
        if (ready <= 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0 || soerr != 0) {
            last = ready == 0 ? ETIMEDOUT : soerr ? soerr : errno;
            close(fd);
            fd = -1;
            if (last == ECANCELED)
                break;
        }
    }
    freeaddrinfo(found);
    if (fd < 0)
        am_error_set(err, "UNAVAILABLE", "the pool at %s is unavailable: %s", endpoint, strerror(last));
    else
        configure(fd);
    return fd;
}

/* wire.tls.channel_binding, on the driver's side */
static int make_binding(am_link *link) {
    X509 *cert = SSL_get1_peer_certificate(link->ssl);
    if (cert == NULL)
        return -1;
    unsigned char *der = NULL;
    int der_len = i2d_X509(cert, &der);
    X509_free(cert);
    if (der_len <= 0)
        return -1;
    unsigned char digest[SHA256_DIGEST_LENGTH];
    SHA256(der, (size_t)der_len, digest);
    OPENSSL_free(der);
    static const char prefix[] = "tls-server-end-point:";
    size_t n = sizeof prefix - 1;
    memcpy(link->binding, prefix, n);
    memcpy(link->binding + n, digest, sizeof digest);
    n += sizeof digest;
    if (SSL_version(link->ssl) == TLS1_2_VERSION) {
        unsigned char finished[64];
        /* Python's get_channel_binding("tls-unique") on a client: its own
         * Finished, or the peer's on a resumed session */
        size_t len = SSL_session_reused(link->ssl) ? SSL_get_peer_finished(link->ssl, finished, sizeof finished)
                                                    : SSL_get_finished(link->ssl, finished, sizeof finished);
        static const char unique[] = "|tls-unique:";
        if (len > 0 && len <= sizeof finished && n + sizeof unique - 1 + len <= AM_BINDING_MAX) {
            memcpy(link->binding + n, unique, sizeof unique - 1);
            n += sizeof unique - 1;
            memcpy(link->binding + n, finished, len);
            n += len;
        }
    }
    link->binding_len = n;
    return 0;
}

static int handshake(am_link *link, SSL_CTX *tls, const char *host, double deadline, SSL_SESSION *offer,
                     const char *endpoint, am_error *err) {
    char why[256];
    link->bio_method = socket_bio_method();
    link->ssl = link->bio_method != NULL ? SSL_new(tls) : NULL;
    BIO *bio = link->ssl != NULL ? BIO_new(link->bio_method) : NULL;
    if (bio == NULL) {
        ssl_reason(why, sizeof why);
        am_error_set(err, "UNAVAILABLE", "TLS with %s: %s", endpoint, why);
        return -1;
    }
    BIO_set_data(bio, (void *)(intptr_t)link->fd);
    SSL_set_bio(link->ssl, bio, bio);
    unsigned char addr[16];
    X509_VERIFY_PARAM *param = SSL_get0_param(link->ssl);
    bool is_ip = inet_pton(AF_INET, host, addr) == 1 || inet_pton(AF_INET6, host, addr) == 1;
    if (is_ip ? X509_VERIFY_PARAM_set1_ip_asc(param, host) != 1
              : (SSL_set1_host(link->ssl, host) != 1 || SSL_set_tlsext_host_name(link->ssl, host) != 1)) {
        am_error_set(err, "UNAVAILABLE", "TLS with %s: cannot check the name %s", endpoint, host);
        return -1;
    }
    /* Resumption skips the certificate chain and the pool's signature (the
     * costly part of a reconnect in a guest that just moved); it proves the
     * pool knows the ticket's key, a verified pool's at the first handshake,
     * and the binding stays the certificate that handshake verified. */
    if (offer != NULL && SSL_set_session(link->ssl, offer) != 1)
        ERR_clear_error(); /* (offered nothing: a full handshake) */
    for (;;) {
        ERR_clear_error();
        int rc = SSL_connect(link->ssl);
        if (rc == 1)
            break;
        int code = SSL_get_error(link->ssl, rc);
        short want = code == SSL_ERROR_WANT_READ ? POLLIN : code == SSL_ERROR_WANT_WRITE ? POLLOUT : 0;
        if (want != 0) {
            int ready = wait_fd(link->fd, want, deadline, link->abort_fd);
            if (ready > 0)
                continue;
            am_error_set(err, ready == 0 ? "TIMEOUT" : "UNAVAILABLE", "the TLS handshake with %s %s", endpoint,
                         ready == 0 ? "did not complete in time" : errno == ECANCELED ? "was cut short" : "failed");
            return -1;
        }
        long verify = SSL_get_verify_result(link->ssl);
        if (verify != X509_V_OK) {
            am_error_set(err, "AUTH_FAILED",
                         "authentication failed: the certificate of the pool at %s does not verify (%s): "
                         "wrong CA (cafile / ACCELMIG_CAFILE), or no SAN for that address or name",
                         endpoint, X509_verify_cert_error_string(verify));
            return -1;
        }
        ssl_reason(why, sizeof why);
        if (strstr(why, "wrong version number") != NULL || strstr(why, "record layer failure") != NULL ||
            strstr(why, "packet length too long") != NULL)
            am_error_set(err, "AUTH_FAILED", "authentication failed: %s does not speak TLS (a pool started "
                         "with --insecure?); plain TCP needs insecure on both ends (%s)", endpoint, why);
        else
            am_error_set(err, code == SSL_ERROR_SYSCALL || code == SSL_ERROR_ZERO_RETURN ? "UNAVAILABLE"
                                                                                          : "AUTH_FAILED",
                         "TLS with %s failed: %s", endpoint, code == SSL_ERROR_SYSCALL ? "connection lost" : why);
        return -1;
    }
    link->tls_resumed = SSL_session_reused(link->ssl) != 0;
    if (make_binding(link) != 0) {
        am_error_set(err, "AUTH_FAILED", "TLS with %s: no certificate to bind to", endpoint);
        return -1;
    }
    return 0;
}

int am_link_dial(am_link *link, SSL_CTX *tls, const char *endpoint, double timeout, SSL_SESSION *offer,
                 int abort_fd, am_error *err) {
    memset(link, 0, sizeof *link);
    link->fd = -1;
    link->abort_fd = abort_fd;
    char host[256];
    int port;
    if (am_parse_endpoint(endpoint, host, sizeof host, &port) != 0) {
        am_error_set(err, "BAD_REQUEST", "invalid request: endpoint %.80s is not HOST:PORT", endpoint);
        return -1;
    }
    double deadline = am_now() + timeout;
    link->fd = connect_tcp(host, port, deadline, abort_fd, endpoint, err);
    if (link->fd < 0)
        return -1;
    if (tls != NULL && handshake(link, tls, host, deadline, offer, endpoint, err) != 0) {
        am_link_close(link);
        return -1;
    }
    return 0;
}

SSL_SESSION *am_link_tls_session(const am_link *link) {
    if (link->ssl == NULL)
        return NULL;
    SSL_SESSION *session = SSL_get1_session(link->ssl);
    if (session == NULL || !SSL_SESSION_is_resumable(session)) {
        SSL_SESSION_free(session);
        return NULL;
    }
    /* A copy: OpenSSL 3.0 offers the connection's own session object at the
     * next handshake without the pool resuming it (seen: never reused),
     * where a copy of it (what Python's ssl and s_client's -sess_in end up
     * with) is reused. */
    SSL_SESSION *copy = SSL_SESSION_dup(session);
    SSL_SESSION_free(session);
    return copy;
}

void am_link_close(am_link *link) {
    if (link->ssl != NULL) {
        SSL_free(link->ssl); /* (frees its BIO) */
        link->ssl = NULL;
    }
    if (link->bio_method != NULL) {
        BIO_meth_free(link->bio_method);
        link->bio_method = NULL;
    }
    if (link->fd >= 0) {
        shutdown(link->fd, SHUT_RDWR);
        close(link->fd);
        link->fd = -1;
    }
}

static ssize_t ssl_result(am_link *link, int rc, short *want, am_error *err, bool reading) {
    int code = SSL_get_error(link->ssl, rc);
    if (code == SSL_ERROR_WANT_READ) {
        *want = POLLIN;
        return AM_LINK_AGAIN;
    }
    if (code == SSL_ERROR_WANT_WRITE) {
        *want = POLLOUT;
        return AM_LINK_AGAIN;
    }
    if (code == SSL_ERROR_ZERO_RETURN && reading)
        return 0;
    char why[200];
    if (code == SSL_ERROR_SYSCALL) {
        if (reading && rc == 0 && ERR_peek_error() == 0)
            return 0; /* an unclean close: a close all the same */
        snprintf(why, sizeof why, "%s", errno ? strerror(errno) : "connection lost");
    } else {
        ssl_reason(why, sizeof why);
    }
    ERR_clear_error();
    am_error_set(err, "UNAVAILABLE", "the pool is unavailable: %s", why);
    return -1;
}

ssize_t am_link_read(am_link *link, void *buf, size_t len, short *want, am_error *err) {
    if (len > INT32_MAX)
        len = INT32_MAX;
    if (link->ssl != NULL) {
        ERR_clear_error();
        errno = 0;
        int rc = SSL_read(link->ssl, buf, (int)len);
        if (rc > 0)
            return rc;
        return ssl_result(link, rc, want, err, true);
    }
    ssize_t n = recv(link->fd, buf, len, 0);
    if (n >= 0)
        return n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        *want = POLLIN;
        return AM_LINK_AGAIN;
    }
    am_error_set(err, "UNAVAILABLE", "the pool is unavailable: %s", strerror(errno));
    return -1;
}

ssize_t am_link_write(am_link *link, const void *buf, size_t len, short *want, am_error *err) {
    if (len > INT32_MAX)
        len = INT32_MAX;
    if (link->ssl != NULL) {
        ERR_clear_error();
        errno = 0;
        int rc = SSL_write(link->ssl, buf, (int)len);
        if (rc > 0)
            return rc;
        return ssl_result(link, rc, want, err, false);
    }
    ssize_t n = send(link->fd, buf, len, MSG_NOSIGNAL);
    if (n >= 0)
        return n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        *want = POLLOUT;
        return AM_LINK_AGAIN;
    }
    am_error_set(err, "UNAVAILABLE", "the pool is unavailable: %s", strerror(errno));
    return -1;
}

bool am_link_buffered(const am_link *link) {
    return link->ssl != NULL && SSL_pending(link->ssl) > 0;
}

int am_link_send_all(am_link *link, const void *data, size_t len, double deadline, am_error *err) {
    const unsigned char *p = data;
    while (len > 0) {
        short want = 0;
        ssize_t n = am_link_write(link, p, len, &want, err);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n == AM_LINK_AGAIN) {
            int ready = wait_fd(link->fd, want, deadline, link->abort_fd);
            if (ready > 0)
                continue;
            if (ready < 0 && errno == ECANCELED)
                am_error_set(err, "UNAVAILABLE", "the pool is unavailable: the handshake was cut short");
            else
                am_error_set(err, "TIMEOUT", "the pool did not take a frame in time");
        }
        return -1;
    }
    return 0;
}

ssize_t am_link_recv(am_link *link, void *buf, size_t len, double deadline, am_error *err) {
    for (;;) {
        short want = 0;
        ssize_t n = am_link_read(link, buf, len, &want, err);
        if (n != AM_LINK_AGAIN)
            return n;
        int ready = wait_fd(link->fd, want, deadline, link->abort_fd);
        if (ready < 0 && errno == ECANCELED) {
            am_error_set(err, "UNAVAILABLE", "the pool is unavailable: the handshake was cut short");
            return -1;
        }
        if (ready <= 0) {
            am_error_set(err, "TIMEOUT", "the pool's answer did not come in time");
            return -1;
        }
    }
}
