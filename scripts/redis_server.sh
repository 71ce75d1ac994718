#!/usr/bin/env bash
# Provides a real redis-server and redis-cli (the Redis Cluster tests create their cluster with it) for the tests of
# the Redis session store, in DIR/bin/, without touching the system: ones already on PATH are linked; otherwise
# Debian's package (both binaries are in redis-tools) and the two libraries they need are downloaded with apt-get and
# unpacked with dpkg -x. `make test` runs it; when they cannot be had, it says why and the Redis tests skip with that
# message (DIR/install.log).
#
#   scripts/redis_server.sh DIR
set -uo pipefail

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
fi
libs=$(dirname "$(find "$dir/root" -name 'liblzf.so*' | head -1)")

wrap() {  # wrap NAME BINARY: DIR/bin/NAME runs BINARY (as NAME) with the unpacked libraries
  cat >"$dir/bin/$1" <<WRAPPER
#!/usr/bin/env bash
# $1 unpacked from Debian's packages by scripts/redis_server.sh
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec -a $1 "$2" "\$@"
WRAPPER
  chmod +x "$dir/bin/$1"
}
wrap redis-server "$dir/root/usr/bin/redis-check-rdb"
wrap redis-cli "$dir/root/usr/bin/redis-cli"
for name in redis-server redis-cli; do
  if runs "$name"; then
    echo "==> redis: $("$dir/bin/$name" --version)"
  else
    "$dir/bin/$name" --version >>"$log" 2>&1
    rm -f "$dir/bin/$name"
    echo "warning: the downloaded $name does not run here; the Redis store tests will skip (see $log)" >&2
  fi
done
