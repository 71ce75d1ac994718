#!/usr/bin/env bash
# The wheels the image installs (docker/.wheels), resolved for the image's own interpreter.
#
#   docker/wheels.sh PYTHON BASE_IMAGE [WHEEL_DIR]     (`make image` runs it)
#
# Why not `pip wheel` on the host alone: pip resolves environment markers for the interpreter it runs on. The
# host's Python (say 3.11.7) and the image's (Debian bookworm's 3.11.2, or python:3.11-slim's) differ in the patch
# version, and `redis` needs `async-timeout` only below 3.11.3: host-resolved wheels lack it and the image build
# fails with "No matching distribution found for async-timeout". So:
#   1. the host builds the project's wheel and pre-fetches its dependencies (with the host's pip settings, index
#      and caches), pinned to the versions in PYTHON's environment (`make install`'s .venv: what the tests ran);
#   2. the base image's python3 resolves `slime-gateway[chat,redis]` again from those wheels, under the same pins,
#      and fetches only what its own markers add. It runs with the host network and the host's CA bundle (pip in
#      a Debian container cannot verify a TLS-inspecting proxy's certificate with its own bundle).
# The image build itself (docker/Dockerfile) then installs from WHEEL_DIR with --no-index: no network there.
set -euo pipefail

PY=${1:?usage: docker/wheels.sh PYTHON BASE_IMAGE [WHEEL_DIR]}
BASE_IMAGE=${2:?usage: docker/wheels.sh PYTHON BASE_IMAGE [WHEEL_DIR]}
WHEELS=${3:-docker/.wheels}
EXTRAS=${IMAGE_EXTRAS:-chat,redis}

mkdir -p "$WHEELS"
WHEELS=$(cd "$WHEELS" && pwd)
rm -f "$WHEELS"/slime_gateway-*.whl
pins=$(mktemp "${TMPDIR:-/tmp}/image-pins.XXXXXX")
trap 'rm -f "$pins"' EXIT
"$PY" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9._-]+==' >"$pins" || true

echo "==> wheels: the host ($("$PY" -V)) builds slime-gateway and pre-fetches '.[$EXTRAS]' into $WHEELS"
"$PY" -m pip wheel --quiet --wheel-dir "$WHEELS" --constraint "$pins" ".[$EXTRAS]"
project=$(cd "$WHEELS" && ls slime_gateway-*.whl)

docker_args=(--rm --network host --user "$(id -u):$(id -g)" --env HOME=/tmp --env PIP_NO_CACHE_DIR=1
  --env PIP_DISABLE_PIP_VERSION_CHECK=1 --volume "$WHEELS:/wheels" --volume "$pins:/tmp/pins.txt:ro")
for ca in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" "${REQUESTS_CA_BUNDLE:-}" /etc/ssl/certs/ca-certificates.crt; do
  if [ -n "$ca" ] && [ -f "$ca" ]; then
    docker_args+=(--volume "$(readlink -f "$ca"):/tmp/host-ca.pem:ro" --env PIP_CERT=/tmp/host-ca.pem)
    break
  fi
done
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  if [ -n "${!name:-}" ]; then docker_args+=(--env "$name"); fi
done

echo "==> wheels: $BASE_IMAGE's python3 resolves slime-gateway[$EXTRAS] for itself (only what its markers add is fetched)"
docker run "${docker_args[@]}" "$BASE_IMAGE" sh -ec "
  python3 -m venv /tmp/venv
  echo \"    \$(/tmp/venv/bin/python -V) in the image\"
  /tmp/venv/bin/pip wheel --quiet --find-links /wheels --wheel-dir /wheels --constraint /tmp/pins.txt \
    '/wheels/$project[$EXTRAS]'
"
echo "==> wheels: $(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS"
