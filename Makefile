# The two commands of the README. Each installs what it needs first (scripts/install.sh, idempotent).
VENV ?= .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo test soak install install-dev clean

demo: install
	bash scripts/demo.sh

# Two workers, a file at a time each, then the `serial` tests alone (scripts/test.sh says why).
test: install-dev
	VENV=$(VENV) bash scripts/test.sh $(PYTEST_ARGS)

# The full trial counts of the property runs (many kills, 10k fuzz cases): tests marked `soak`, which
# `make test` runs with their small counts only.
soak: install-dev
	AZULITE_SOAK=1 $(VENV)/bin/python -m pytest -m soak $(PYTEST_ARGS)

install:
	bash scripts/install.sh

install-dev:
	bash scripts/install.sh --dev

clean:
	rm -rf $(VENV) .pytest_cache .azulite build *.egg-info src/*.egg-info
