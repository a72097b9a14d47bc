# `make serve` and `make test` set everything up on a fresh machine (Python 3.11+).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= shapes-unet
POLICY ?= orca

.PHONY: install browser serve test bench clean

install: $(STAMP)

# torch==2.13.0 before anything else, so that no dependency can pull another torch. The build
# (CPU or CUDA) is whatever the package index serves for that pin.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# shapes-unet is served with the LoRA and ControlNet trained for it (the playground lists them)
ifeq ($(MODEL),shapes-unet)
ADAPTERS ?= --lora-dir gouache/weights/loras/shapes-unet --controlnet-dir gouache/weights/controlnets/shapes-unet
endif

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

test: install browser
	$(PY) -m pytest -q --durations=20

bench: install
	$(VENV)/bin/gouache bench serve

clean:
	rm -rf $(VENV)
