#!/usr/bin/env bash
# Provides Debian's chromium for the session inspector's browser tests (tests/test_ui.py, driven by Playwright with
# executable_path: Playwright's own browser builds are never downloaded). One on PATH is used as it is; otherwise,
# as root, `apt-get install chromium` (with the fonts its pages need, without the desktop extras it recommends).
# `make test` runs it; when no chromium can be had, it says why and the browser tests skip with that message
# (DIR/install.log). It writes the browser's path to DIR/path.
#
#   scripts/chromium.sh DIR
set -uo pipefail

dir=${1:?usage: chromium.sh DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
log=$dir/install.log

found() {
  local binary
  binary=$(command -v chromium || command -v chromium-browser) || return 1
  "$binary" --version >/dev/null 2>&1 || return 1
  echo "$binary" >"$dir/path"
}

if found; then
  rm -f "$log"
  exit 0
fi
: >"$log"
rm -f "$dir/path"
if [ "$(id -u)" != 0 ]; then
  echo "no chromium on PATH and not root: install Debian's chromium (apt-get install chromium)" >>"$log"
  echo "warning: no chromium; the inspector's browser tests will skip (see $log)" >&2
  exit 0
fi
packages="chromium fonts-liberation fonts-dejavu-core"
echo "==> chromium: apt-get install $packages"
install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 \
    $packages >>"$log" 2>&1
}
# The package lists may be missing or stale (a fresh container): refresh them once and try again.
if ! install && ! { apt-get update >>"$log" 2>&1 && install; }; then
  echo "warning: could not install chromium; the inspector's browser tests will skip (see $log)" >&2
  exit 0
fi
if found; then
  echo "==> chromium: $("$(cat "$dir/path")" --version 2>/dev/null)"
  rm -f "$log"
else
  echo "apt-get installed $packages, but no chromium runs" >>"$log"
  echo "warning: chromium does not run here; the inspector's browser tests will skip (see $log)" >&2
fi
