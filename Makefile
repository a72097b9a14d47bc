# `make serve` and `make test` set everything up on a fresh machine (Python 3.11+). Serving and
# testing have a virtualenv each: the tests' extras (torchao for --quantize, ray, schemathesis,
# ...) stay out of the server's, where torchao alone would fill every start log with its failures
# to load CUDA kernels (pyproject.toml, extra `quantize`).
VENV ?= .venv
TEST_VENV ?= .venv-test
PY := $(VENV)/bin/python
TEST_PY := $(TEST_VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= shapes-unet
POLICY ?= orca

.PHONY: install install-test browser serve test test-fast bench clean

install: $(VENV)/.installed-stamp
install-test: $(TEST_VENV)/.installed-stamp

# torch==2.13.0 before anything else, so that no dependency can pull another torch. The build
# (CPU or CUDA) is whatever the package index serves for that pin.
define make_venv
	python3 -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q torch==2.13.0
	$(1)/bin/python -m pip install -q -c constraints.txt -e '$(2)'
	touch $(1)/.installed-stamp
endef

$(VENV)/.installed-stamp: pyproject.toml constraints.txt
	$(call make_venv,$(VENV),.)

$(TEST_VENV)/.installed-stamp: pyproject.toml constraints.txt
	$(call make_venv,$(TEST_VENV),.[test])

# a built-in is served with the LoRAs and ControlNets trained for it, where there are any (the
# playground lists them): shapes-unet's palette LoRA and layout ControlNet, shapes-edit's palette LoRA
ADAPTERS ?= $(if $(wildcard gouache/weights/loras/$(MODEL)),--lora-dir gouache/weights/loras/$(MODEL)) \
	$(if $(wildcard gouache/weights/controlnets/$(MODEL)),--controlnet-dir gouache/weights/controlnets/$(MODEL))

serve: install
	$(VENV)/bin/gouache serve --host $(HOST) --port $(PORT) --model $(MODEL) --policy $(POLICY) $(ADAPTERS)

# The playground's browser tests drive Debian's Chromium; installed here when missing (as root,
# or with sudo that asks no password). Where it cannot be, those tests are skipped.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
	  { $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver; } >/dev/null 2>&1 \
	    || echo "note: could not install chromium and chromium-driver; the browser tests will be skipped"; \
	fi

# Two pytest-xdist workers, a test file each at a time (tests/conftest.py hands out the files,
# the longest first, and keeps the Ray files on one worker): about 14 minutes on 2 CPU cores,
# where the tests' own times sum to about 27.
PYTEST_XDIST := -n 2 --dist loadfile

test: install-test browser
	$(TEST_PY) -m pytest -q $(PYTEST_XDIST) --durations=20

# The subset to run while working (about 2 minutes on 2 CPU cores): no test marked slow (it
# starts processes: servers, multiproc or Ray workers, compiles, the browser; or takes over
# ~3 s) or gpu. No browser setup: the browser tests are all slow.
test-fast: install-test
	$(TEST_PY) -m pytest -q $(PYTEST_XDIST) --durations=20 -m "not slow and not gpu"

bench: install
	$(VENV)/bin/gouache bench serve

clean:
	rm -rf $(VENV) $(TEST_VENV)
