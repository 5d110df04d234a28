# The two commands of the quickstart, `make demo` and `make test`, plus their parts.
# `.venv` is made on first use; the project is (re)installed only when pyproject.toml
# is newer than the last install.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNS := $(VENV)/.installed-run
TESTS := $(VENV)/.installed-dev
INSTALL_LOG := $(VENV)/install.log
MYPY_ROOT := $(VENV)/mypy-root/rankscope

.PHONY: demo test test-fast lint format proto clean

# Tests keep compiled modules even where PYTHONDONTWRITEBYTECODE is set: each pytest worker
# rewrites every test module's asserts (its collection: 6.2 s, 3.5 s with them kept), and
# every service a test starts would compile rankscope's modules again
PYTEST_ENV := PYTHONDONTWRITEBYTECODE=

demo: $(RUNS)
	@echo "starting rankscope with a demo cluster; Ctrl-C stops it"
	@echo "(later: . $(VENV)/bin/activate, and the rankscope command is on your PATH)"
	@$(BIN)/rankscope up --demo

# Three workers, then the test that times a pipeline rank's slowdown, alone on the machine.
# On two cores the parallel part takes 436 s on three workers (86% busy), 586 s on two (76%);
# with mlx.launch spinning (see tests/recorded.py) three workers left the test of a recorded
# rank slow from its first step 41-69 s of its 60-s wait, 34 s without. Files go out in the
# order collected, not those of most tests first: that sent the long end-to-end files of a
# test or two (the recorded slow-rank job, packaging, the fault deployments) out together
# at the end, where that test, its ranks starved to a step a second, missed its 60 s in two
# runs of two; in collection order they spread over the run (440 s, against 457-478 s)
# mypy (a core for ~35 s when cold) runs beside the workers, its report shown after them.
test: $(TESTS) $(MYPY_ROOT)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & typing=$$!; \
	$(PYTEST_ENV) $(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder \
		-m "not solo" --durations=20; tests=$$?; \
	wait $$typing; typed=$$?; echo "$(BIN)/mypy"; cat $(VENV)/mypy.log; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]
	$(PYTEST_ENV) $(BIN)/python -m pytest -m solo

# The inner loop: no MLX computation and no multi-process end-to-end test (CI runs them all).
# Four workers on two cores: these tests mostly wait (NATS round trips, timeouts), each
# worker busy about half its time (157 s on two workers, 93-98 s on four, 98 s on six)
test-fast: $(TESTS)
	$(PYTEST_ENV) $(BIN)/python -m pytest -n 4 --dist loadfile -m "not slow and not mlx"

lint: $(TESTS) $(MYPY_ROOT)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(TESTS)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The gRPC modules are committed; regenerate them after editing the .proto.
proto: $(TESTS)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
		services/ranktable/grpcapi/config.proto
	$(BIN)/python -c "import pathlib; p = pathlib.Path('services/ranktable/grpcapi/config_pb2_grpc.py'); \
		p.write_text(p.read_text().replace('from services.', 'from rankscope.services.'))"

# mypy reads `shared/` and `services/` as what they install as, rankscope.shared and
# rankscope.services (it does not follow setuptools' editable import hook)
$(MYPY_ROOT):
	mkdir -p $@
	ln -sfn ../../../shared $@/shared
	ln -sfn ../../../services $@/services

$(BIN)/python:
	@echo "making a virtualenv in $(VENV)"
	@$(PYTHON) -m venv $(VENV)

# What the demo runs; the test tools come on top of it. Each is installed again only
# when pyproject.toml is newer; pip's output goes to $(INSTALL_LOG), each package it
# fetches said as it goes, the whole log shown if it fails.
PIP_FAILED := pip failed
PROGRESS := grep --line-buffered -E '^(Collecting|Successfully installed|$(PIP_FAILED))' | sed -u 's/^/  /'
define pip_install
	@{ $(BIN)/python -m pip install $(1) 2>&1 || echo "$(PIP_FAILED)"; } | tee -a $(INSTALL_LOG) | $(PROGRESS)
	@! grep -q '^$(PIP_FAILED)' $(INSTALL_LOG) || { cat $(INSTALL_LOG); exit 1; }
endef

$(RUNS): pyproject.toml | $(BIN)/python
	@echo "installing rankscope and what it runs (MLX, mlx-lm, NATS, FastAPI) into $(VENV);"
	@echo "a minute or two the first time"
	@: > $(INSTALL_LOG)
	$(call pip_install,--upgrade pip)
	$(call pip_install,-e .)
	@touch $@

$(TESTS): $(RUNS)
	@echo "installing the test and lint tools into $(VENV)"
	$(call pip_install,-e '.[dev]')
	@touch $@

clean:
	rm -rf $(VENV) .rankscope .mypy_cache .pytest_cache .ruff_cache
