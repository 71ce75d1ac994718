# Sourced by the scripts that provide a test service from Debian's packages without a system install
# (scripts/redis_server.sh, scripts/haproxy.sh): download, unpack, and a wrapper that finds the unpacked libraries.

# debian_unpack ROOT LOG PACKAGE...: the packages downloaded with apt-get (the package lists refreshed first when
# they are missing and we are root) and unpacked into ROOT with dpkg -x; fails when they cannot be downloaded.
debian_unpack() {
  local root=$1 log=$2 work
  shift 2
  work=$(mktemp -d)
  if ! (cd "$work" && apt-get download "$@" >>"$log" 2>&1); then
    # The package lists may be missing (a fresh container): refresh them when we may.
    if ! { [ "$(id -u)" = 0 ] && apt-get update >>"$log" 2>&1 && (cd "$work" && apt-get download "$@" >>"$log" 2>&1); }; then
      rm -rf "$work"
      return 1
    fi
  fi
  for deb in "$work"/*.deb; do dpkg -x "$deb" "$root" >>"$log" 2>&1; done
  rm -rf "$work"
}

# debian_wrap BIN NAME BINARY LIBS BY: BIN/NAME runs BINARY (as NAME) with the unpacked libraries in LIBS (BY: the
# script that made it, named in the wrapper).
debian_wrap() {
  cat >"$1/$2" <<WRAPPER
#!/usr/bin/env bash
# $2 unpacked from Debian's packages by $5
export LD_LIBRARY_PATH="$4\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec -a $2 "$3" "\$@"
WRAPPER
  chmod +x "$1/$2"
}
