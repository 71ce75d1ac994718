#!/usr/bin/env bash
# Provides HAProxy (the load balancer in front of gateway replicas, docker/haproxy.cfg) for the fleet and chaos
# tests, in DIR/bin/haproxy, without touching the system: one already on PATH is linked; otherwise Debian's package
# and the libraries it needs beyond a base system are downloaded with apt-get and unpacked with dpkg -x, as
# scripts/redis_server.sh does for redis-server. `make test` runs it (`make haproxy`); when it cannot be had, it says
# why and the tests that need it skip with that message (DIR/install.log).
#
#   scripts/haproxy.sh DIR
set -uo pipefail

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
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # haproxy's own libraries that a base Debian system lacks (libc, libssl, libpcre2, libsystemd, libcrypt it has).
  packages="haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1"
  if ! (cd "$work" && apt-get download $packages >>"$log" 2>&1); then
    # The package lists may be missing (a fresh container): refresh them when we may.
    if [ "$(id -u)" = 0 ] && apt-get update >>"$log" 2>&1 && (cd "$work" && apt-get download $packages >>"$log" 2>&1); then
      :
    else
      echo "warning: could not download haproxy; the fleet and chaos tests will skip (see $log)" >&2
      exit 0
    fi
  fi
  for deb in "$work"/*.deb; do dpkg -x "$deb" "$dir/root" >>"$log" 2>&1; done
fi
libs=$(dirname "$(find "$dir/root" -name 'liblua5.3.so*' | head -1)")

cat >"$dir/bin/haproxy" <<WRAPPER
#!/usr/bin/env bash
# haproxy unpacked from Debian's packages by scripts/haproxy.sh
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec -a haproxy "$dir/root/usr/sbin/haproxy" "\$@"
WRAPPER
chmod +x "$dir/bin/haproxy"
if runs; then
  echo "==> haproxy: $("$dir/bin/haproxy" -v | head -1)"
else
  "$dir/bin/haproxy" -v >>"$log" 2>&1
  rm -f "$dir/bin/haproxy"
  echo "warning: the downloaded haproxy does not run here; the fleet and chaos tests will skip (see $log)" >&2
fi
