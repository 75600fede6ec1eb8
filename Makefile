PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint venv clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/krait serve --host 127.0.0.1 --port 8000

lint: $(STAMP)
	$(BIN)/ruff check krait tests scripts

test: $(STAMP) lint
	$(BIN)/python -m pytest -q --timeout=600 -n auto --dist worksteal

clean:
	rm -rf $(VENV)
