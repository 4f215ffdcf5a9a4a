# The build entry behind the README's two commands:
#   make run    installs what is needed, builds everything, runs the main job on its defaults
#   make test   the same set-up, then the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
CARGO ?= cargo
RELEASE := target/release
STAMP := build/.stamps
# Rust compilations are cached outside the checkout, shared by every clone
# (as the database image is, guest-images/dbguest/build.py). sccache's
# server is stopped once the Rust steps are done: nothing stays running.
SCCACHE_DIR ?= /var/cache/scalebench/sccache
export SCCACHE_DIR
export SCCACHE_IDLE_TIMEOUT ?= 60
# Its server's start waits 10 s by default: a test that builds a crate while the
# suite keeps both cores busy timed out on it ("Timed out waiting for server startup").
export SCCACHE_STARTUP_TIMEOUT ?= 60
export RUSTC_WRAPPER := $(if $(shell command -v sccache),sccache)
STOP_SCCACHE := $(if $(RUSTC_WRAPPER),sccache --stop-server >/dev/null 2>&1 || true,true)

.PHONY: all run test lint deps build rust guest pyext clean FORCE

all: build

$(STAMP):
	@mkdir -p $@

# Debian packages and the Python package (editable, with the test and cluster extras).
deps: $(STAMP)/apt $(STAMP)/python

$(STAMP)/apt: packages.apt | $(STAMP)
	@pkgs=$$(sed -e 's/#.*//' packages.apt | xargs); \
	missing=$$(for p in $$pkgs; do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

# Redone also when `scalebench` is not imported from this checkout: another
# clone's install (a CI run's clean clone) replaces the editable one.
OWN_PACKAGE := $(shell $(PYTHON) -c 'import importlib.util as u; s = u.find_spec("scalebench"); print(s.origin if s else "")' 2>/dev/null)
$(STAMP)/python: pyproject.toml $(STAMP)/apt $(if $(filter $(CURDIR)/controller/scalebench/__init__.py,$(OWN_PACKAGE)),,FORCE) | $(STAMP)
	$(PYTHON) -m pip install -q -e '.[test,cluster]'
	@touch $@

FORCE:

build: rust guest pyext
	@$(STOP_SCCACHE)

rust:
	$(CARGO) build --release --workspace --bins --quiet

guest:
	$(MAKE) -s -C guest-images/webguest OUT=$(CURDIR)/$(RELEASE)

# The `pagesim` Python extension (pagesim-py/, PyO3 via maturin from the test extra),
# installed into $(PYTHON)'s environment: Python paging policies on the simulator.
pyext: $(STAMP)/python
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps ./pagesim-py

run: deps build
	$(PYTHON) -m scalebench

# House tooling: formatting and lints for Rust and Python (configs: rustfmt.toml, pyproject.toml).
lint: deps
	rustup component add rustfmt clippy >/dev/null 2>&1 || true
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets --quiet -- -D warnings; status=$$?; $(STOP_SCCACHE); exit $$status
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: deps build lint
	$(CARGO) test --release --workspace --quiet; status=$$?; $(STOP_SCCACHE); exit $$status
	@# Two workers (tests/conftest.py, LANES), then the tests marked `alone`
	@# by themselves; a short base directory, since the tests' control
	@# sockets must fit a socket path.
	base=$$(mktemp -d /tmp/sbt.XXXXXX) && \
	  if $(PYTHON) -m pytest -q -n 2 -m "not alone" --basetemp=$$base/p --durations=15 tests && \
	     $(PYTHON) -m pytest -q -m alone --basetemp=$$base/a tests; \
	  then rm -rf $$base; else echo "test files kept in $$base"; exit 1; fi

clean:
	$(CARGO) clean
	rm -rf build
