# fusuma: `make demo` and `make test` do all set-up on a fresh Debian machine (as root).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
FUSUMA := $(VENV)/bin/fusuma
DEB_PACKAGES := qemu-system-x86 qemu-utils busybox-static erofs-utils cpio \
                qemu-guest-agent python3-venv gcc libc6-dev debootstrap apache2-utils curl \
                prometheus chromium

.PHONY: deps venv image demo test lint unit integration fault clean bench-boot

deps:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

venv: deps $(VENV)/.installed

image: venv
	$(FUSUMA) image build
	$(FUSUMA) image build --kind debian

demo: image
	$(FUSUMA) up
	$(FUSUMA) ps
	@for v in $$($(FUSUMA) vm list --json | $(VENV)/bin/python -c 'import json,sys; print(" ".join(v["name"] for v in json.load(sys.stdin)))'); do \
	  echo "--- $$v: guest kernel and hostname, through the guest agent:"; \
	  $(FUSUMA) vm exec $$v -- /bin/sh -c 'uname -r; hostname'; \
	done
	@echo "--- zero-copy migration of vm0 to p1 and back (the guest keeps running):"
	$(FUSUMA) migrate vm0 --to p1
	$(FUSUMA) migrate vm0 --to p0
	@echo "--- a Debian VM serving apache2 with its /usr from a shared segment (DAX):"
	$(FUSUMA) segment list --json | grep -q '"debian-usr"' || \
	  $(FUSUMA) segment create debian-usr --from-image debian
	$(FUSUMA) vm list --json | grep -q '"web0"' || \
	  $(FUSUMA) vm create web0 -p p0 --image debian --segment debian-usr:/usr --port 8080:80 --start
	@for i in $$(seq 60); do curl -sf -o /dev/null http://127.0.0.1:8080/ && break; sleep 1; done
	curl -s http://127.0.0.1:8080/ | grep -o '<title>.*</title>'
	$(FUSUMA) share report
	@echo
	@echo "Two partitions are up. Try: $(FUSUMA) ps, $(FUSUMA) vm console vm0,"
	@echo "$(FUSUMA) partition restart p0, $(FUSUMA) share analyze --vm web0."
	@echo "Remove everything with: $(FUSUMA) down; $(FUSUMA) segment delete debian-usr"

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

unit: venv
	$(VENV)/bin/pytest -q tests/unit

integration: image
	$(VENV)/bin/pytest -q tests/integration

fault: image
	$(VENV)/bin/pytest -q tests/fault

test: image lint
	$(VENV)/bin/pytest -q tests

bench-boot: image
	$(FUSUMA) bench boot --vms 2 --runs 5 --json results/boot.json

clean:
	rm -rf $(VENV) build *.egg-info
