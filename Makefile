# AENV-py: every target works on a fresh Debian/Ubuntu machine as root.
# `make run` and `make test` install what they need first (see `install`).

VENV ?= .venv
PY := $(VENV)/bin/python
PROTO_OUT := src/aenv/envd/proto
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# The dashboard's browser libraries, from npm: in the source tree, as each checkout serves its
# own (the environment's stamps may be shared by several).
DASHBOARD_ASSETS := src/aenv/dashboard/static/vendor/.built
# Editable installs of the project: a node's extras, and the tests' (a comma cannot stand in
# a `call` argument).
NODE_EXTRAS := .[host]
TEST_EXTRAS := .[host,dev]

.PHONY: install install-test system-deps run test test-fast lint docs bench proto envd-bundle clean

# What a node needs (`make run`): its system packages (apt) and the Python environment with the
# project in editable mode. `install-test` adds what only the tests, lint and benchmarks need.
install: $(STAMP) $(DASHBOARD_ASSETS)
install-test: $(TEST_STAMP) $(DASHBOARD_ASSETS)

system-deps:
	./scripts/install-system-deps.sh

# uv installs the environment: 41 s where pip took 109 (a quiet host; CI waits for it). Byte-
# compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing would write it
# later. uv reads none of pip's configuration: where it cannot be installed or reach an index
# (one set for pip only), pip installs.
define pip_install
	test -x $(PY) || python3 -m venv $(VENV)
	{ $(PY) -m pip install -q uv && \
		$(VENV)/bin/uv pip install --python $(PY) --system-certs --compile-bytecode -q -e '$(1)'; } \
		|| $(PY) -m pip install -q -e '$(1)'
endef

$(STAMP): pyproject.toml scripts/install-system-deps.sh
	./scripts/install-system-deps.sh
	$(call pip_install,$(NODE_EXTRAS))
	touch $(STAMP)

# After the system packages (npm).
$(DASHBOARD_ASSETS): src/aenv/dashboard/package-lock.json scripts/build-dashboard.sh | $(STAMP)
	./scripts/build-dashboard.sh
	touch $@

# The RL harnesses the integration tests drive get environments of their own under build/ (one
# not made, its tests skip saying why).
$(TEST_STAMP): $(STAMP)
	./scripts/install-system-deps.sh test
	$(call pip_install,$(TEST_EXTRAS))
	./scripts/install-integrations.sh || echo "some RL harnesses not installed: their tests skip"
	touch $(TEST_STAMP)

# One node on :3000 (API + data plane); the first start builds the `base` template.
run: install
	$(VENV)/bin/aenv server

# Two pytest processes side by side (scripts/test.sh); with PYTEST_ARGS, one run of those.
test: install-test
	PY=$(PY) ./scripts/test.sh $(PYTEST_ARGS)

# The tests that need no root, VM or aenv server (the orchestrator, saved states, builds and API
# routes run on the doubles in tests/doubles/): under a minute, in a pytest-xdist worker per core
# (at most 4: each imports the project first), without schemathesis's and hypothesis's plugins
# (none of them uses either; they take each process 1.5 s and 0.1 s of CPU to load), after
# byte-compiling src/ as `make test` does (for the CLI calls it makes). Checked to pass with no capabilities (setpriv
# --bounding-set=-all). `make test` runs these and everything else.
FAST_TESTS := tests/test_atomic.py tests/test_config.py tests/test_docs.py tests/test_claims.py tests/orchestrator tests/api tests/cli \
	tests/dashboard/test_sessions.py tests/dashboard/test_builds.py \
	tests/dashboard/test_saved_and_keys.py tests/dashboard/test_sandbox_page.py \
	tests/dashboard/test_nodes.py tests/dashboard/test_browser.py \
	tests/storage/test_layers.py tests/storage/test_repository_cache.py \
	tests/guest/test_cache.py tests/network/test_units.py tests/runtime/test_qemu_config.py \
	tests/runtime/test_qcow2.py tests/runtime/test_damon.py \
	tests/runtime/firecracker/test_firecracker_models.py \
	tests/runtime/firecracker/test_firecracker_host.py \
	tests/runtime/firecracker/test_firecracker_memfile.py \
	tests/runtime/firecracker/test_firecracker_api.py \
	tests/proxy/test_routing.py tests/proxy/test_app.py tests/proxy/test_websocket.py \
	tests/oci/test_auth.py tests/oci/test_pull.py

test-fast: install-test
	$(PY) -m compileall -q src > /dev/null
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses 4 -p no:schemathesis -p no:hypothesispytest $(FAST_TESTS) \
		$(PYTEST_ARGS)

lint: install-test
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy
	$(PY) -m aenv.docs --check

# The reference pages generated from the code: docs/configuration.md (config.Config's field
# descriptions) and docs/cli.md (the `aenv` command's help). `make lint` fails when they differ.
docs: install
	$(PY) -m aenv.docs

bench: install-test
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# envd, an interpreter, its libraries and glibc for guests without Python (src/aenv/envd_bundle/);
# rebuilt only when an input changed.
envd-bundle: install
	$(PY) -m aenv.envd_bundle

proto: install-test
	rm -rf $(PROTO_OUT) && mkdir -p $(PROTO_OUT)
	$(PY) -m grpc_tools.protoc -Iproto \
		--plugin=protoc-gen-py=$(VENV)/bin/protoc-gen-py \
		--plugin=protoc-gen-connectrpc=$(VENV)/bin/protoc-gen-connectrpc \
		--py_out=$(PROTO_OUT) --connectrpc_out=$(PROTO_OUT) \
		process/process.proto filesystem/filesystem.proto
	touch $(PROTO_OUT)/__init__.py

clean:
	rm -rf build dist $(VENV)
