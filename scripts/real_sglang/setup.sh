#!/usr/bin/env bash
# Installs a real SGLang engine (0.5.23) that runs on a CPU-only machine, plus a tiny random Qwen3-MoE to serve,
# into DIR. `make test-sglang` runs it (DIR = .sglang-cpu) before tests/test_real_sglang.py; so can you, then
# start the engine with run.sh.
#
#   scripts/real_sglang/setup.sh DIR      ~3 min and ~3 GB the first time; needs only the package registry
#
# What it makes:
#   DIR/venv      SGLang 0.5.23 with CPU torch 2.13.0 (SGLang targets GPUs: see the two edits below)
#   DIR/model     the tiny model of make_tiny_model.py (2 layers, 8 experts, top-2, token ids < 512)
#   DIR/.installed-stamp   what the venv was installed from; the pip step reruns when it differs
#
# Idempotent: a venv whose stamp matches is not touched by pip, the edits check before they change anything, and
# the model is built only when it is missing. A DIR from an older set-up (no stamp) is brought up to date in place.
# This is a verification tool, fragile by nature (SGLang is not meant for CPUs): it is not part of `make test`.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
dir=${1:?usage: setup.sh DIR}
PYTHON=${PYTHON:-python3}
SGLANG_SPEC=sglang==0.5.23
# The CPU wheel: a plain `torch` would pull a multi-GB CUDA build (same pin as the project's Makefile).
TORCH_SPEC=torch==2.13.0

step() { echo "==> real_sglang/setup: $*"; }
die() { echo "!! real_sglang/setup: $*" >&2; exit 1; }

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
py=$dir/venv/bin/python
stamp=$dir/.installed-stamp
fingerprint="$SGLANG_SPEC $TORCH_SPEC $(sha256sum "$here/requirements.txt" | cut -d' ' -f1)"

if [ -x "$py" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ]; then
  step "venv: $dir/venv is up to date ($SGLANG_SPEC, $TORCH_SPEC)"
else
  [ -x "$py" ] || { step "venv: creating $dir/venv"; "$PYTHON" -m venv "$dir/venv"; }
  rm -f "$stamp"  # written again only once every install below has succeeded
  step "venv: installing $TORCH_SPEC, $SGLANG_SPEC and its CPU dependencies (a few minutes the first time)"
  "$py" -m pip install --quiet "$TORCH_SPEC"
  # --no-deps: SGLang's declared dependencies include CUDA-only packages; requirements.txt lists the ones it needs.
  "$py" -m pip install --quiet --no-deps "$SGLANG_SPEC"
  # The constraint keeps every dependency from replacing the CPU torch (torchvision, compressed-tensors want one).
  echo "$TORCH_SPEC" >"$dir/constraints.txt"
  step "venv: pip will list sglang's CUDA requirements (and its torch pin) as not met: expected, left out on purpose"
  "$py" -m pip install --quiet -c "$dir/constraints.txt" -r "$here/requirements.txt"
  echo "$fingerprint" >"$stamp"
fi

site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# Edit 1: the registry's torchvision is a CUDA build whose native ops do not load beside CPU torch; its module
# registers fake (meta) kernels for those ops at import time and fails. Register them only when the ops loaded.
# The sed pattern only matches the unedited line, so a second run changes nothing.
meta=$site/torchvision/_meta_registrations.py
[ -f "$meta" ] || die "$meta not found: did the torchvision pin change?"
sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$meta"

# Edit 2: SGLang allocates the routed-experts host buffer with pin_memory=True, which needs CUDA. Pin only when
# CUDA is there. Without this, --enable-return-routed-experts fails at start-up on a CPU.
"$py" - "$site/sglang/srt/state_capturer/base.py" <<'PY'
import sys

path = sys.argv[1]
text = open(path).read()
old = 'device="cpu",\n            pin_memory=True,'
new = 'device="cpu",\n            pin_memory=torch.cuda.is_available(),'
if old in text:
    open(path, "w").write(text.replace(old, new))
elif new not in text:
    sys.exit(f"{path}: the pin_memory line to edit is not there: did the SGLang pin change?")
PY
step "edits: torchvision fake-op registrations and SGLang's pinned routing buffer are CPU-safe"

if [ -f "$dir/model/config.json" ]; then
  step "model: $dir/model already there"
else
  step "model: building the tiny Qwen3-MoE into $dir/model"
  "$py" "$here/make_tiny_model.py" "$dir/model"
fi
step "ready: bash $here/run.sh $dir PORT --enable-return-routed-experts"
