#!/usr/bin/env bash
# Provides a real redis-server for the tests of the Redis session store, in DIR/bin/redis-server, without touching
# the system: one already on PATH is linked; otherwise Debian's package (the server binary is in redis-tools) and
# the two libraries it needs are downloaded with apt-get and unpacked with dpkg -x. `make test` runs it; when no
# server can be had, it says why and the Redis tests skip with that message (DIR/install.log).
#
#   scripts/redis_server.sh DIR
set -uo pipefail

dir=${1:?usage: redis_server.sh DIR}
mkdir -p "$dir/bin"
dir=$(cd "$dir" && pwd)
log=$dir/install.log
: >"$log"

if [ -x "$dir/bin/redis-server" ] && "$dir/bin/redis-server" --version >/dev/null 2>&1; then
  exit 0
fi
if found=$(command -v redis-server); then
  ln -sf "$found" "$dir/bin/redis-server"
  echo "==> redis: using $found" && exit 0
fi

echo "==> redis: downloading Debian's redis-server into $dir (no system install)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
packages="redis-tools libjemalloc2 liblzf1"
if ! (cd "$work" && apt-get download $packages >>"$log" 2>&1); then
  # The package lists may be missing (a fresh container): refresh them when we may.
  if [ "$(id -u)" = 0 ] && apt-get update >>"$log" 2>&1 && (cd "$work" && apt-get download $packages >>"$log" 2>&1); then
    :
  else
    echo "warning: could not download redis-server; the Redis store tests will skip (see $log)" >&2
    exit 0
  fi
fi
for deb in "$work"/*.deb; do dpkg -x "$deb" "$dir/root" >>"$log" 2>&1; done
server=$dir/root/usr/bin/redis-check-rdb  # Debian's redis-server is this binary under another name
libs=$(dirname "$(find "$dir/root" -name 'liblzf.so*' | head -1)")
cat >"$dir/bin/redis-server" <<WRAPPER
#!/usr/bin/env bash
# redis-server unpacked from Debian's packages by scripts/redis_server.sh
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec -a redis-server "$server" "\$@"
WRAPPER
chmod +x "$dir/bin/redis-server"
if "$dir/bin/redis-server" --version >>"$log" 2>&1; then
  echo "==> redis: $("$dir/bin/redis-server" --version)"
else
  rm -f "$dir/bin/redis-server"
  echo "warning: the downloaded redis-server does not run here; the Redis store tests will skip (see $log)" >&2
fi
