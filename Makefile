# gpu-agent: `make run` starts the agent on a simulated DGX H100; `make test` runs the suite but its
# slow cases (one case of each slow family stays), `make test-slow` only those, `make test-all` everything
# with its long trials at full length.
PYTHON ?= python3
VENV ?= .venv
RUN_ROOT ?= .run/root
SIMULATE ?= dgx-h100
BIN := $(VENV)/bin

.PHONY: run lint test test-slow test-all bench package e2e e2e-cluster e2e-cluster-build clean kubelet-api-stubs

$(BIN)/gpu-agent: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing python3-venv (Debian splits venv out of python3)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv; \
	  else echo "python3 cannot create virtual environments: install python3-venv" >&2; exit 1; fi; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade -c constraints.txt pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,package]'
	@touch $@

run: $(BIN)/gpu-agent
	@mkdir -p $(RUN_ROOT)/etc/gpu-agent
	@# the packaged MIG configs where the package puts them, for the daemon's mig.config and `gpu-agent mig`
	@test -e $(RUN_ROOT)/etc/gpu-agent/mig.yaml || cp packaging/mig.yaml $(RUN_ROOT)/etc/gpu-agent/mig.yaml
	@echo "gpu-agent on a simulated $(SIMULATE) node, sandbox root $(RUN_ROOT); in another terminal:"
	@echo "  curl -s 127.0.0.1:9445/readyz?verbose"
	@echo "  curl -s 127.0.0.1:9445/status"
	@echo "  curl -s 127.0.0.1:9445/metrics"
	@echo "  $(BIN)/gpu-agent --root $(RUN_ROOT) status"
	@echo "  $(BIN)/gpu-agent --root $(RUN_ROOT) sim inject-xid --gpu 3 --xid 79    (then: sim clear)"
	@echo "  $(BIN)/gpu-agent --root $(RUN_ROOT) mig apply -c all-balanced --dry-run"
	@echo "Ctrl-C stops it."
	$(BIN)/gpu-agent --root $(RUN_ROOT) --simulate $(SIMULATE) run

# ruff first (fast, finds most), then mypy on gpu_agent (files in pyproject's [tool.mypy]).
lint: $(BIN)/gpu-agent
	$(BIN)/ruff check gpu_agent tests bench packaging
	$(BIN)/mypy

# pytest-xdist workers: three per CPU, since much of the suite's time is spent waiting on the daemons it
# starts (quiet periods, backoff, timeouts) while using no CPU.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) * 3 )))
# The tests' folders (about 70,000 small files a run) on /dev/shm where it has 600 MiB free: on a disk,
# making and removing them took a fifth of the suite's time. One folder per clone, its name short for
# the unix sockets in it (108 bytes); a passing run removes it (conftest.py).
TEST_TMP ?= $(shell [ -w /dev/shm ] && [ "$$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $$4}')" -gt 614400 ] \
	2>/dev/null && echo /dev/shm/gat$$(id -u)-$$(echo '$(CURDIR)' | cksum | cut -c1-6))
# Bytecode is written even where the environment says PYTHONDONTWRITEBYTECODE: without it each worker
# rewrites every test module's asserts again (5 s of CPU each) and each agent a test starts compiles the
# whole package again.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --ignore=tests/e2e \
	$(if $(TEST_TMP),--basetemp=$(TEST_TMP))

# Bytecode of the package and of the test modules (their asserts rewritten) made once, in one process,
# before the workers start: on a fresh clone each worker made all of it again (about 15 s of the run).
# So is the Go kubelet stand-in, once per machine: its build held the workers that need it for 25 s.
WARM := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q gpu_agent >/dev/null && \
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --collect-only -p no:xdist --ignore=tests/e2e >/dev/null && \
	PYTHONPATH=tests $(BIN)/python tests/kubelet_standin_build.py

# The developer loop: everything but the tests marked slow (pyproject's markers). Its goal is 90 s on 2
# idle cores; its tests take 80-84 s there (2,635 tests, about 155 s of CPU; 84 s in a fresh clone's CI
# run; ~10 % more when the VM they were measured on ran slow). A test not marked slow fails when it runs
# well over 10 s (tests/conftest.py).
test: lint
	@$(WARM)
	$(PYTEST) -m "not slow"

# The slow part alone: sweeps over every config and machine, the other kill -9 trials, storms (CI runs it).
test-slow: $(BIN)/gpu-agent
	$(PYTEST) -m slow

# The whole suite with its long trials at full length (200 kill -9 trials instead of 20).
test-all: lint
	GPU_AGENT_TEST_ALL=1 $(PYTEST)

# The packages installed and run under a booted Debian 12 (root; debootstrap, systemd-nspawn, lintian, rpm), and
# the runtime matrix: Debian 12 and 13 with their containerd, Docker and podman (tests/e2e/test_runtimes.py).
e2e: $(BIN)/gpu-agent
	$(BIN)/python -m pytest -q tests/e2e --ignore=tests/e2e/cluster

# The real cluster of issue 34 (root): etcd, kube-apiserver, kubelet, containerd 2.x and crictl built from
# their Go modules at the versions tests/e2e/cluster/modules/ pins, into /var/cache/gpu-agent-e2e/cluster
# (tests/e2e/cluster/components.py: each once, then cached), and the tests that run them with the agent in
# a booted Debian 13 (tests/e2e/cluster/test_cluster.py; docs/development.md says how long each takes).
e2e-cluster-build:
	$(PYTHON) tests/e2e/cluster/components.py

# The booted machine's systemd, containerd and kubelet each hold inotify instances, counted against root's
# limit on the whole host (128 by default, which other root processes share): raised to 1024 first (kind
# asks 512 of its hosts; each of the two machines here boots a systemd of its own, and what ran before on
# the host may still hold some).
e2e-cluster: $(BIN)/gpu-agent e2e-cluster-build
	@[ "$$(cat /proc/sys/fs/inotify/max_user_instances)" -ge 1024 ] || sysctl -qw fs.inotify.max_user_instances=1024
	$(BIN)/python -m pytest -q tests/e2e/cluster

# One package per target python3 into dist/ (packaging/README.md): Debian 12's and 13's .deb, RHEL 9's .rpm.
package: $(BIN)/gpu-agent
	$(BIN)/python packaging/build.py --out dist

# Every figure of issue 15 into bench/results.json and README.md's Performance table (~20 min; QUICK=1: short).
bench: $(BIN)/gpu-agent
	$(BIN)/python bench/run.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) .run build dist *.egg-info

# protobuf's own Python classes for the kubelet APIs the agent speaks (tests/kubelet_api/, committed): the
# tests' kubelet peers and the yardstick for gpu_agent/proto3.py. Debian's protoc (protobuf-compiler) with
# grpclib's plugin from the venv. The .proto files are our own statement of the APIs' wire facts (names,
# field numbers, types), read from k8s.io/kubelet/pkg/apis/ (deviceplugin/v1beta1, podresources/v1) at
# the commit each file's header names.
kubelet-api-stubs: $(BIN)/gpu-agent
	protoc -I tests --python_out=tests --pyi_out=tests --grpclib_python_out=tests \
	  --plugin=protoc-gen-grpclib_python=$(BIN)/protoc-gen-grpclib_python tests/kubelet_api/*.proto
