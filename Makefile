# slime-gateway: `make demo` runs the whole thing end to end, `make test` runs the suite. Both set up .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of torch that lies on this machine's disk: a plain `torch` requirement would pull a multi-GB
# CUDA build. Only the client SDK and its tests use torch; the gateway itself needs none.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test lint format demo bench clean routers redis haproxy chromium harnesses test-sglang test-chaos docs

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev,chat,redis]'
	@touch $(STAMP)

install: $(STAMP)

# The suite in TEST_WORKERS processes (pytest-xdist), each running whole test files, so that a file's services start
# once: most tests wait on the gateway and simulator processes they start, and two workers keep two cores busy.
TEST_WORKERS ?= 2

test: install routers redis haproxy chromium harnesses
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The router tier of `make test`: the real SGLang routers from the package registry, each in its own venv (no
# torch). An install failure only warns: tests/test_router.py then skips, naming .routers/<name>/install.log.
ROUTERS_DIR ?= .routers
ROUTER_SPEC_smg ?= smg==1.13.0
ROUTER_SPEC_sglang-router ?= sglang-router==0.3.2
ROUTER_STAMPS := $(ROUTERS_DIR)/smg/.installed-stamp $(ROUTERS_DIR)/sglang-router/.installed-stamp

$(ROUTERS_DIR)/%/.installed-stamp: Makefile
	@mkdir -p $(ROUTERS_DIR)/$*
	@if { test -x $(ROUTERS_DIR)/$*/bin/python || $(PYTHON) -m venv $(ROUTERS_DIR)/$*; } >$(ROUTERS_DIR)/$*/install.log 2>&1 \
		&& $(ROUTERS_DIR)/$*/bin/python -m pip install --quiet --retries 2 --timeout 30 "$(ROUTER_SPEC_$*)" >>$(ROUTERS_DIR)/$*/install.log 2>&1; \
	then rm -f $(ROUTERS_DIR)/$*/install.log && touch $@; \
	else echo "warning: could not install $(ROUTER_SPEC_$*); router tests will skip (see $(ROUTERS_DIR)/$*/install.log)" >&2; fi

routers: $(ROUTER_STAMPS)

# A real redis-server for the Redis session store's tests, unpacked into .redis/ (scripts/redis_server.sh: one on
# PATH, or Debian's package without a system install). When none can be had, those tests skip and say why.
redis:
	@bash scripts/redis_server.sh .redis

# HAProxy, the load balancer in front of gateway replicas (docker/haproxy.cfg), for the fleet and chaos tests: the one
# on PATH, or Debian's package unpacked into .haproxy/ without a system install (scripts/haproxy.sh). When none can
# be had, those tests skip and say why (.haproxy/install.log).
haproxy:
	@bash scripts/haproxy.sh .haproxy

# The long chaos runs (tests/test_chaos.py, marker `chaos`, not part of `make test`, which runs a short one): several
# minutes of real Claude Code / Codex runs and SDK rollouts through HAProxy under each fault, counted.
# CHAOS_SECONDS sets each run's length.
CHAOS_SECONDS ?= 180

test-chaos: install redis haproxy harnesses
	CHAOS_SECONDS=$(CHAOS_SECONDS) $(PY) -m pytest -v -s -m chaos tests/test_chaos.py

# The agent harnesses the chat tests drive (tests/test_harnesses.py): Claude Code and the Codex CLI from the npm
# registry, pinned, into .harnesses/ (no global install). When they cannot be had, those tests skip and say why
# (.harnesses/install.log).
HARNESS_DIR ?= .harnesses
CLAUDE_CODE_SPEC ?= @anthropic-ai/claude-code@2.1.332
CODEX_SPEC ?= @openai/codex@0.171.0

harnesses:
	@bash scripts/harnesses.sh $(HARNESS_DIR) $(CLAUDE_CODE_SPEC) $(CODEX_SPEC)

# Debian's chromium for the session inspector's browser tests (Playwright drives it; no browser is downloaded): the
# one on PATH, else `apt-get install chromium` as root. When none can be had, tests/test_ui.py's browser tests skip
# and say why (.chromium/install.log).
chromium:
	@bash scripts/chromium.sh .chromium

# Opt-in: a real SGLang engine on the CPU serving a tiny MoE (scripts/real_sglang/), installed into SGLANG_DIR;
# ~3 min and ~3 GB on the first run, seconds afterwards (setup.sh is idempotent).
SGLANG_DIR ?= .sglang-cpu

test-sglang: install
	bash scripts/real_sglang/setup.sh $(SGLANG_DIR)
	SGLANG_DIR=$(abspath $(SGLANG_DIR)) $(PY) -m pytest -m sglang tests/test_real_sglang.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pre-commit validate-config

# The documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link or anchor, a page left out of the
# nav or a setting without a description fails it (tests/test_docs.py builds it the same way in `make test`).
# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2, printed on every build, says nothing about this site.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: install
	PYTHON=$(PY) bash examples/demo.sh

bench: install
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info site

# ---- the sidecar image (docker/) ----------------------------------------------------------------------------------
# `make image`: wheels into docker/.wheels (so the image build needs no network), resolved for the image's own
# interpreter (docker/wheels.sh), then the image.
# `make test-docker`: the opt-in Docker tier (not part of `make test`): a Docker engine (scripts/docker_engine.sh
# installs and starts one on machines without a daemon or Docker Hub), the image, then tests/test_docker.py and the
# agent rollouts' Docker sandbox (tests/test_agent_docker_sandbox.py: Claude Code and Codex in containers).
IMAGE ?= slime-gateway:latest
LOCAL_BASE_IMAGE ?= local/debian-python:bookworm
# python:3.11-slim (pulled if need be); on a machine without Docker Hub, the debootstrap-built local base when it
# exists (scripts/docker_engine.sh).
BASE_IMAGE ?= $(shell docker image inspect python:3.11-slim >/dev/null 2>&1 && echo python:3.11-slim \
  || { docker image inspect $(LOCAL_BASE_IMAGE) >/dev/null 2>&1 && echo $(LOCAL_BASE_IMAGE); } || echo python:3.11-slim)
DOCKER_BUILD_FLAGS ?=

.PHONY: image test-docker

image: install
	@# Resolved by the image's own python3, whose markers may differ from the host's (docker/wheels.sh says why).
	bash docker/wheels.sh $(PY) $(BASE_IMAGE) docker/.wheels
	@echo "==> image: docker build $(IMAGE) from base $(BASE_IMAGE)"
	DOCKER_BUILDKIT=0 docker build --network host --build-arg BASE_IMAGE=$(BASE_IMAGE) $(DOCKER_BUILD_FLAGS) \
	  -f docker/Dockerfile -t $(IMAGE) docker
	@echo "==> image: removing this project's untagged images (the build stage, earlier builds of $(IMAGE))"
	@docker image prune --force --filter label=slime-gateway.stage=build >/dev/null
	@docker image prune --force --filter label=org.opencontainers.image.title=slime-gateway >/dev/null
	@echo "==> image: $(IMAGE) is $$(docker image inspect -f '{{.Size}}' $(IMAGE)) bytes"

test-docker: install
	bash scripts/docker_engine.sh up
	$(MAKE) --no-print-directory image
	@echo "==> test-docker: pytest -m docker tests/test_docker.py tests/test_agent_docker_sandbox.py (image $(IMAGE))"
	GATEWAY_IMAGE=$(IMAGE) $(PY) -m pytest -v -s -m docker tests/test_docker.py tests/test_agent_docker_sandbox.py
