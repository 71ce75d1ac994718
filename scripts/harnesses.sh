#!/usr/bin/env bash
# The agent harnesses the chat tests drive (tests/test_harnesses.py), from the npm registry into a folder of the
# project: Claude Code and the Codex CLI at pinned versions, no global install. Idempotent: a stamp names what is
# installed. When they cannot be had (no npm, no registry), this warns and the harness tests skip, quoting the log.
#
#   bash scripts/harnesses.sh DIR SPEC...
set -uo pipefail
dir=${1:?usage: harnesses.sh DIR SPEC...}
shift
specs="$*"
mkdir -p "$dir"
stamp="$dir/.installed-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$specs" ]; then
  exit 0
fi
log="$dir/install.log"
rm -f "$stamp"
if ! command -v npm >/dev/null 2>&1; then
  echo "npm is not on PATH: install Node.js (20 or newer) to run the agent harness tests" >"$log"
  echo "warning: no npm; the agent harness tests will skip (see $log)" >&2
  exit 0
fi
echo "==> harnesses: npm install $specs into $dir"
# A package.json of its own, so npm installs here and not into a parent folder's project.
[ -f "$dir/package.json" ] || echo '{"name": "slime-gateway-harnesses", "private": true}' >"$dir/package.json"
if npm install --prefix "$dir" --no-audit --no-fund --no-save --loglevel=error $specs >"$log" 2>&1 \
    && "$dir/node_modules/.bin/claude" --version >>"$log" 2>&1 \
    && "$dir/node_modules/.bin/codex" --version >>"$log" 2>&1; then
  echo "$specs" >"$stamp"
  rm -f "$log"
else
  echo "warning: could not install $specs; the agent harness tests will skip (see $log)" >&2
fi
exit 0
