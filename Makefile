# The two commands of the quickstart, `make demo` and `make test`, plus their parts.
# `.venv` is made on first use; the project is (re)installed only when pyproject.toml
# is newer than the last install.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: demo test lint format proto clean

demo: $(INSTALLED)
	$(BIN)/rankscope up --demo

test: lint
	$(BIN)/python -m pytest

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(INSTALLED)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The gRPC modules are committed; regenerate them after editing the .proto.
proto: $(INSTALLED)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
		services/ranktable/grpcapi/config.proto

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

clean:
	rm -rf $(VENV) .rankscope .mypy_cache .pytest_cache .ruff_cache
