# fusuma: `make demo` and `make test` do all set-up on a fresh Debian machine (as root).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
FUSUMA := $(VENV)/bin/fusuma
DEB_PACKAGES := qemu-system-x86 qemu-utils busybox-static erofs-utils cpio \
                qemu-guest-agent python3-venv gcc libc6-dev debootstrap apache2-utils curl \
                prometheus chromium etcd-server dnsmasq-base nftables iperf3 \
                genisoimage ovmf seabios
# kube-apiserver and kubectl for the cluster tests (tests/cluster) and `fusuma bench
# cluster`: built from the Go module proxy (tools/kube-apiserver), once, into the cache.
K8S_VERSION := 1.33.13
KUBE_DIR := $(or $(FUSUMA_CACHE),/var/cache/fusuma)/k8s
KUBE_APISERVER := $(KUBE_DIR)/kube-apiserver-v$(K8S_VERSION)
KUBECTL := $(KUBE_DIR)/kubectl-v$(K8S_VERSION)
K8S_LDFLAGS := -X k8s.io/component-base/version.gitVersion=v$(K8S_VERSION) \
               -X k8s.io/component-base/version.gitMajor=1 \
               -X k8s.io/component-base/version.gitMinor=$(word 2,$(subst ., ,$(K8S_VERSION))) \
               -X k8s.io/component-base/version.gitTreeState=clean

.PHONY: deps venv bytecode image demo test lint lint-static unit integration fault clean bench-boot kube cluster \
        image-cgroup2 test-cgroup2 docs

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

# Every fusuma command, supervisor and agent is a new Python process (the tests run
# thousands): fusuma's sources compiled ahead, none compiles them at its start, even
# where PYTHONDONTWRITEBYTECODE keeps Python from writing them itself (`fusuma ps`:
# 0.25-0.28 s without them, 0.17-0.19 s with them, on this 2-core host).
bytecode: venv
	$(VENV)/bin/python -m compileall -q -j 0 src > /dev/null
	@# and the __init__ of each of fusuma's @frozen classes (fusuma.frozen.INIT_CACHE)
	$(VENV)/bin/python -m fusuma.frozen > /dev/null

image: venv
	$(FUSUMA) image build
	$(FUSUMA) image build --kind debian
	$(FUSUMA) qemu install 10.0
	@# A bootable Debian disk image with cloud-init, imported by the tests like a
	@# user's own (about 2 minutes, once; cached in FUSUMA_CACHE/images/cloud-*).
	$(VENV)/bin/python -m fusuma.images.diskimage

demo: image bytecode
	@# The template part of an earlier demo goes first (clones need p0 on QEMU 10.0).
	@for v in clone0 clone1 tsrc; do \
	  $(FUSUMA) vm list --json 2>/dev/null | grep -q "\"$$v\"" && \
	    $(FUSUMA) vm delete $$v --force; true; \
	done
	@$(FUSUMA) template list --json 2>/dev/null | grep -q '"demo"' && \
	  $(FUSUMA) template delete demo; true
	@# A p0 left on QEMU 10.0 by an earlier demo goes back to the system's first, so
	@# that the host matches the default spec again.
	@if $(FUSUMA) partition list --json 2>/dev/null | $(VENV)/bin/python -c 'import json,sys; sys.exit(0 if any(p["name"] == "p0" and p["qemu"] not in (None, "7.2") for p in json.load(sys.stdin)) else 1)'; then \
	  echo "--- p0 runs another QEMU since an earlier demo: back to the system's"; \
	  $(FUSUMA) maintain p0 --via p1 --qemu 7.2; \
	fi
	$(FUSUMA) up
	$(FUSUMA) ps
	@for v in $$($(FUSUMA) vm list --json | $(VENV)/bin/python -c 'import json,sys; print(" ".join(v["name"] for v in json.load(sys.stdin)))'); do \
	  echo "--- $$v: guest kernel and hostname, through the guest agent:"; \
	  $(FUSUMA) vm exec $$v -- /bin/sh -c 'uname -r; hostname'; \
	done
	@echo "--- zero-copy migration of vm0 to p1 and back (the guest keeps running):"
	$(FUSUMA) migrate vm0 --to p1
	$(FUSUMA) migrate vm0 --to p0
	@echo "--- a Debian VM serving apache2 with its root from a shared segment (DAX):"
	$(FUSUMA) segment list --json | grep -q '"debian-root"' || \
	  $(FUSUMA) segment create debian-root --from-image debian
	$(FUSUMA) vm list --json | grep -q '"web0"' || \
	  $(FUSUMA) vm create web0 -p p0 --image debian --segment debian-root:/ --port 8080:80 --start
	@for i in $$(seq 60); do curl -sf -o /dev/null http://127.0.0.1:8080/ && break; sleep 1; done
	curl -s http://127.0.0.1:8080/ | grep -o '<title>.*</title>'
	$(FUSUMA) share report
	@echo "--- QEMU versions side by side: the system's and 10.0 from Debian's backports"
	$(FUSUMA) qemu list
	@echo "--- upgrade p0's hypervisor from QEMU 7.2 to 10.0 under its running VMs"
	@echo "    (each VM moves to p1 and back onto 10.0, keeping machine type pc-q35-7.2):"
	$(FUSUMA) maintain p0 --via p1 --qemu 10.0
	$(FUSUMA) ps
	curl -s http://127.0.0.1:8080/ | grep -o '<title>.*</title>'
	@echo "--- free page reporting: web0's guest drops its caches, the host gets them back"
	$(FUSUMA) vm trim web0
	@echo "--- a template: a booted VM stopped into RAM + device state; clones start from"
	@echo "    it in milliseconds and share the pages they have not written"
	$(FUSUMA) vm create tsrc -p p0 --memory 192 --start
	$(FUSUMA) template create demo --from tsrc
	$(FUSUMA) vm delete tsrc
	for c in clone0 clone1; do \
	  $(FUSUMA) vm create $$c -p p0 --template demo --start && \
	  $(FUSUMA) vm exec $$c -- hostname || exit 1; \
	done
	$(FUSUMA) share report
	@echo
	@echo "Two partitions are up, p0 on QEMU 10.0 and p1 on the system's 7.2."
	@echo "Try: $(FUSUMA) ps, $(FUSUMA) vm console vm0, $(FUSUMA) qemu list,"
	@echo "$(FUSUMA) partition restart p0, $(FUSUMA) share analyze --vm web0."
	@echo "Remove everything with: $(FUSUMA) down; $(FUSUMA) segment delete debian-root"
	@echo "(down also deletes the template demo and its clones)."

# The binaries' names carry the version: built once, reused until K8S_VERSION changes
# (about 5 minutes on 2 cores; the Go build cache makes a rebuild a link).
kube: deps
	@if [ ! -x $(KUBE_APISERVER) ] || [ ! -x $(KUBECTL) ]; then \
	  echo "building kube-apiserver and kubectl v$(K8S_VERSION) (about 5 minutes)"; \
	  mkdir -p $(KUBE_DIR)/build && cd tools/kube-apiserver && \
	  go build -trimpath -ldflags '$(K8S_LDFLAGS)' -o $(KUBE_DIR)/build/ \
	    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl && \
	  mv $(KUBE_DIR)/build/kube-apiserver $(KUBE_APISERVER) && \
	  mv $(KUBE_DIR)/build/kubectl $(KUBECTL); \
	fi

lint: lint-static
	@# every test module imports (a name moved elsewhere fails here, not after the cgroup2 suite)
	PYTHONPATH=src $(VENV)/bin/pytest -q --collect-only -p no:cacheprovider tests > /dev/null

lint-static: venv
	$(VENV)/bin/ruff check src tests tools/docs_reference.py tools/raw_nic_downtime.py tools/template_holes.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

unit: venv
	$(VENV)/bin/pytest -q tests/unit

integration: image
	$(VENV)/bin/pytest -q tests/integration

fault: image
	$(VENV)/bin/pytest -q tests/fault

cluster: image kube
	$(VENV)/bin/pytest -q tests/cluster

# cgroup v2 on a real kernel (these machines mount v1): the v2 driver, cpuset partitions,
# supervisors as systemd units and one nested VM, inside a Debian guest with systemd as
# init (tests/cgroup2; several minutes under nested TCG). Its image is built once.
image-cgroup2: image
	$(FUSUMA) image build --kind debian-host

test-cgroup2: image-cgroup2
	$(VENV)/bin/pytest -q tests/cgroup2 tests/unit/test_cgroups.py \
	  tests/unit/test_cgroups_partition.py tests/unit/test_systemd.py

# The manual (docs/, mkdocs.yml): the reference pages are written from the code (the
# click tree, the OpenAPI document, the spec's models, the metrics, the error classes),
# then the site is built into build/site with every warning an error (broken links and
# anchors included). A few seconds, offline. `fusuma serve` serves it at /manual/.
docs: venv
	PYTHONPATH=src $(VENV)/bin/python tools/docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The 20 slowest tests close every run, so the suite's budget shows in every CI log.
# The suite on TEST_JOBS workers, a test module at a time per worker, the longest first
# (tests/conftest.py): the tests spend much of their time waiting on guests. Then the
# tests marked `serial`, alone. Per-test times land in test-output/junit*.xml; after a
# full run, `python tools/suite_costs.py test-output/junit*.xml` refreshes the order.
# The static checks (lint-static: ruff, mypy, import contracts; about 20 s of one core)
# run beside the first tests, in the time the guests leave a core idle, and their verdict
# counts before the serial tests start; the tests' own collection is the import check.
TEST_JOBS ?= 2
test: image image-cgroup2 kube docs bytecode
	@mkdir -p test-output
	@echo "lint-static runs beside the tests: test-output/lint.log"
	@$(MAKE) --no-print-directory lint-static > test-output/lint.log 2>&1 & lint=$$!; \
	$(VENV)/bin/pytest -q tests -n $(TEST_JOBS) --dist loadscope -m "not serial" \
	  --durations=20 --junitxml=test-output/junit.xml; rc=$$?; \
	if wait $$lint; then echo "lint-static: passed"; \
	else cat test-output/lint.log; echo "lint-static: FAILED (above)"; rc=1; fi; \
	exit $$rc
	$(VENV)/bin/pytest -q tests -m serial --junitxml=test-output/junit-serial.xml

bench-boot: image
	$(FUSUMA) bench boot --vms 2 --runs 5 --json results/boot.json

clean:
	rm -rf $(VENV) build *.egg-info
