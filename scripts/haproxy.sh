#!/usr/bin/env bash
# Provides HAProxy (the load balancer in front of gateway replicas, docker/haproxy.cfg) for the fleet and chaos
# tests, in DIR/bin/haproxy, without touching the system: one already on PATH is linked; otherwise Debian's package
# and the libraries it needs beyond a base system are downloaded with apt-get and unpacked with dpkg -x
# (scripts/debian_package.sh, as for scripts/redis_server.sh). `make test` runs it (`make haproxy`); when it cannot
# be had, it says why and the tests that need it skip with that message (DIR/install.log).
#
#   scripts/haproxy.sh DIR
set -uo pipefail
source "$(dirname "$0")/debian_package.sh"

dir=${1:?usage: haproxy.sh DIR}
mkdir -p "$dir/bin"
dir=$(cd "$dir" && pwd)
log=$dir/install.log

runs() { [ -x "$dir/bin/haproxy" ] && "$dir/bin/haproxy" -v >/dev/null 2>&1; }

if runs; then
  exit 0
fi
: >"$log"
if found=$(command -v haproxy); then
  ln -sf "$found" "$dir/bin/haproxy"
  echo "==> haproxy: using $found" && exit 0
fi

if [ ! -x "$dir/root/usr/sbin/haproxy" ]; then
  echo "==> haproxy: downloading Debian's haproxy into $dir (no system install)"
  # haproxy's own libraries that a base Debian system lacks (libc, libssl, libpcre2, libsystemd, libcrypt it has).
  if ! debian_unpack "$dir/root" "$log" haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1; then
    echo "warning: could not download haproxy; the fleet and chaos tests will skip (see $log)" >&2
    exit 0
  fi
fi
libs=$(dirname "$(find "$dir/root" -name 'liblua5.3.so*' | head -1)")
debian_wrap "$dir/bin" haproxy "$dir/root/usr/sbin/haproxy" "$libs" scripts/haproxy.sh
if runs; then
  echo "==> haproxy: $("$dir/bin/haproxy" -v | head -1)"
else
  "$dir/bin/haproxy" -v >>"$log" 2>&1
  rm -f "$dir/bin/haproxy"
  echo "warning: the downloaded haproxy does not run here; the fleet and chaos tests will skip (see $log)" >&2
fi
