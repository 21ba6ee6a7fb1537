# /etc/accelmig/lib.sh: helpers for /init, rc and the init.d scripts.
export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
export HOME=/root PYTHONUNBUFFERED=1 LANG=C.UTF-8
ACCELMIG_SITE=@SITE@
log() { echo "accelmig-guest[${0##*/}]: $*" >/dev/console; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }

# Settings: guest.conf (baked into the image), then accelmig.* words of the
# kernel command line (accelmig.net=... -> ACCELMIG_NET=...).
load_settings() {
    [ -f /etc/accelmig/guest.conf ] && . /etc/accelmig/guest.conf
    [ -f /run/accelmig/settings ] && . /run/accelmig/settings
    # How applications reach the pool, for every service and application
    # started after /init: the pool's CA (TLS), else plain TCP said explicitly.
    if [ -s /run/accelmig/pool-ca.crt ]; then
        export ACCELMIG_CAFILE=/run/accelmig/pool-ca.crt
    fi
    case "${ACCELMIG_INSECURE:-}" in 1|on|yes|true) export ACCELMIG_INSECURE=1;; *) unset ACCELMIG_INSECURE;; esac
    return 0
}
# The pool's CA from the kernel command line (accelmig.pool_ca=<base64 DER>,
# put there by the host at each boot: no per-run CA in the cached image)
# as a PEM file; called by /init after parse_cmdline.
write_pool_ca() {
    [ -n "${ACCELMIG_POOL_CA:-}" ] || return 0
    {
        echo "-----BEGIN CERTIFICATE-----"
        echo "$ACCELMIG_POOL_CA" | fold -w 64
        echo "-----END CERTIFICATE-----"
    } > /run/accelmig/pool-ca.crt.tmp && mv /run/accelmig/pool-ca.crt.tmp /run/accelmig/pool-ca.crt
}
parse_cmdline() {
    mkdir -p /run/accelmig
    : > /run/accelmig/settings
    for word in $(cat /proc/cmdline); do
        case "$word" in
            accelmig.*=*)
                key=${word%%=*}; value=${word#*=}
                key=$(echo "$key" | tr 'a-z.-' 'A-Z__')
                case "$value" in *"'"*) log "ignoring $key: quote in value"; continue;; esac
                echo "$key='$value'" >> /run/accelmig/settings;;
        esac
    done
}

# udev's job, done by hand: /dev/virtio-ports/<name> -> ../vportNpM.
link_ports() {
    mkdir -p /dev/virtio-ports
    for port in /sys/class/virtio-ports/*; do
        [ -r "$port/name" ] || continue
        name=$(cat "$port/name")
        [ -n "$name" ] && ln -sfn "../${port##*/}" "/dev/virtio-ports/$name"
    done
}
# wait_port NAME SECONDS: the host announces port names asynchronously.
wait_port() {
    tries=$(( ${2:-10} * 20 ))
    while [ ! -e "/dev/virtio-ports/$1" ]; do
        link_ports
        [ -e "/dev/virtio-ports/$1" ] && break
        tries=$((tries - 1))
        [ "$tries" -le 0 ] && return 1
        usleep 50000
    done
    return 0
}
