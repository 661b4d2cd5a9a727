# AENV-py: every target works on a fresh Debian/Ubuntu machine as root.
# `make run` and `make test` install what they need first (see `install`).

VENV ?= .venv
PY := $(VENV)/bin/python
PROTO_OUT := src/aenv/envd/proto
STAMP := $(VENV)/.installed

.PHONY: install system-deps run test lint bench proto envd-bundle clean

# System packages (apt) and the Python environment with the project in editable mode.
install: $(STAMP)

system-deps:
	./scripts/install-system-deps.sh

$(STAMP): pyproject.toml scripts/install-system-deps.sh
	./scripts/install-system-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[host,dev]'
	touch $(STAMP)

# One node on :3000 (API + data plane); the first start builds the `base` template.
run: install
	$(VENV)/bin/aenv server

test: install
	$(PY) -m pytest -ra $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

bench: install
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# envd, an interpreter, its libraries and glibc for guests without Python (src/aenv/envd_bundle/);
# rebuilt only when an input changed.
envd-bundle: install
	$(PY) -m aenv.envd_bundle

proto: install
	rm -rf $(PROTO_OUT) && mkdir -p $(PROTO_OUT)
	$(PY) -m grpc_tools.protoc -Iproto \
		--plugin=protoc-gen-py=$(VENV)/bin/protoc-gen-py \
		--plugin=protoc-gen-connectrpc=$(VENV)/bin/protoc-gen-connectrpc \
		--py_out=$(PROTO_OUT) --connectrpc_out=$(PROTO_OUT) \
		process/process.proto filesystem/filesystem.proto
	touch $(PROTO_OUT)/__init__.py

clean:
	rm -rf build dist $(VENV)
