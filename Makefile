# hpctrain: `make demo` runs the main job end to end, `make test` runs the whole suite, `make check` its quick tier.
# Both install what is missing on a fresh Debian machine (apt packages, .venv, the project).

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HPCTRAIN := $(VENV)/bin/hpctrain
TORCH_VERSION ?= 2.13.0
APT_PACKAGES := openmpi-bin libopenmpi-dev shellcheck
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1

.PHONY: demo test check docs deps venv clean slurm-up slurm-down slurm-status bench-slurm soak

deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml | deps
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: deps $(VENV)/.installed

demo: venv
	rm -rf demo/data demo/run
	$(HPCTRAIN) shard digits demo/data --shards 2
	$(HPCTRAIN) launch -n 2 -- train --data demo/data --run-dir demo/run --epochs 20
	@echo "summary: demo/run/summary.json"

# Two pytest workers (pytest-xdist), each test file on one, then the tests marked `alone` by themselves (Horovod's
# own suite, whose barrier test times a 5 s wait that a rank starved of a core by the other worker cannot meet,
# and a clean traced run's straggler verdict); the suite's time is in docs/development.md.
# TEST_WORKERS=0: everything in one serial run.
TEST_WORKERS ?= 2
test: venv
ifeq ($(TEST_WORKERS),0)
	$(PY) -m pytest -q -ra --durations=30 tests
else
	$(PY) -m pytest -q -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile -m "not alone" tests
	$(PY) -m pytest -q -ra -m alone tests
endif

# The quick tier for the edit-test loop: every unit test and the few 1-2 rank MPI smoke tests marked `quick`,
# on two workers; it stops at the first failure. Its time is in docs/development.md.
check: venv
	$(PY) -m pytest -q -x -ra -n $(TEST_WORKERS) --dist loadfile -m quick tests/unit tests/mpi

# the documentation site (MkDocs), built strictly: a broken link, a missing page or a bad docstring fails
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# the local two-node Slurm cluster (munge, slurmctld, two slurmd on localhost) the tests use; try submit on it
slurm-up: ; $(SUDO) bash slurm/cluster.sh up
slurm-down: ; $(SUDO) bash slurm/cluster.sh down
slurm-status: ; bash slurm/cluster.sh status
bench-slurm: venv ; $(PY) benchmarks/slurm_latency.py --repeats 5

# the randomized hang matrix: CASES random cases of seed SEED (config + one signal/kill/stop), one row each
SEED ?= 1
CASES ?= 200
soak: venv ; $(PY) benchmarks/soak.py --seed $(SEED) --cases $(CASES)

clean:
	rm -rf demo site $(VENV)
