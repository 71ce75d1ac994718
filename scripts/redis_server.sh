#!/usr/bin/env bash
# Provides a real redis-server and redis-cli (the Redis Cluster tests create their cluster with it) for the tests of
# the Redis session store, in DIR/bin/, without touching the system: ones already on PATH are linked; otherwise
# Debian's package (both binaries are in redis-tools) and the two libraries they need are downloaded with apt-get and
# unpacked with dpkg -x. `make test` runs it; when they cannot be had, it says why and the Redis tests skip with that
# message (DIR/install.log).
#
#   scripts/redis_server.sh DIR
set -uo pipefail
source "$(dirname "$0")/debian_package.sh"

dir=${1:?usage: redis_server.sh DIR}
mkdir -p "$dir/bin"
dir=$(cd "$dir" && pwd)
log=$dir/install.log

runs() { [ -x "$dir/bin/$1" ] && "$dir/bin/$1" --version >/dev/null 2>&1; }

if runs redis-server && runs redis-cli; then
  exit 0
fi
: >"$log"
if server=$(command -v redis-server) && cli=$(command -v redis-cli); then
  ln -sf "$server" "$dir/bin/redis-server"
  ln -sf "$cli" "$dir/bin/redis-cli"
  echo "==> redis: using $server and $cli" && exit 0
fi

# Debian's redis-server is redis-check-rdb under another name; redis-cli is itself.
if [ ! -x "$dir/root/usr/bin/redis-cli" ] || [ ! -x "$dir/root/usr/bin/redis-check-rdb" ]; then
  echo "==> redis: downloading Debian's redis-server and redis-cli into $dir (no system install)"
  if ! debian_unpack "$dir/root" "$log" redis-tools libjemalloc2 liblzf1; then
    echo "warning: could not download redis-server; the Redis store tests will skip (see $log)" >&2
    exit 0
  fi
fi
libs=$(dirname "$(find "$dir/root" -name 'liblzf.so*' | head -1)")
debian_wrap "$dir/bin" redis-server "$dir/root/usr/bin/redis-check-rdb" "$libs" scripts/redis_server.sh
debian_wrap "$dir/bin" redis-cli "$dir/root/usr/bin/redis-cli" "$libs" scripts/redis_server.sh
for name in redis-server redis-cli; do
  if runs "$name"; then
    echo "==> redis: $("$dir/bin/$name" --version)"
  else
    "$dir/bin/$name" --version >>"$log" 2>&1
    rm -f "$dir/bin/$name"
    echo "warning: the downloaded $name does not run here; the Redis store tests will skip (see $log)" >&2
  fi
done
