# make install       create .venv with flowrl and what its core needs (CPU torch unless a GPU is present); extras are
#                    opt-in: .venv/bin/pip install -e ".[lora,server,video,...]" (README, "Installing")
# make install-test  flowrl with every test dependency, at the versions of .ci/constraints.txt (as root on Debian
#                    also chromium + chromium-driver for the labelling page's browser test)
# make test          install-test, then the ruff checks (lint + format), the strict docs build (docs-check) and the
#                    whole test suite (what CI runs)
# make test-fast     the suite without the tests marked slow (pytest -m "not slow"): the inner loop, a few minutes;
#                    nothing installed (run make install-test once); make test still runs everything
# make lint          the ruff checks alone; `make format` applies ruff's fixes and formatting
# make docs          the documentation site (MkDocs Material, mkdocs.yml) into site/; open site/index.html
# make docs-check    the same build with --strict into a temporary folder: a broken link or anchor, a page missing from
#                    the nav or an API reference that does not resolve fails it (part of make test)
# make constraints   rewrite .ci/constraints.txt from .venv, once the suite passes with newer versions
# make train     the README's main job: GRPO on the embedded digits model
# make bench     framework-overhead benchmark
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-test test test-fast lint format docs docs-check constraints train bench assets
CONSTRAINTS := .ci/constraints.txt

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	PYTHON=$(BIN)/python bash scripts/install_torch.sh
	$(BIN)/python -m pip install -q -e .

# The versions the suite last passed with (torch and its CUDA wheels aside: scripts/install_torch.sh picks those), so
# a new major release of a dependency cannot change numbers unseen; `make constraints` refreshes the file.
install-test: $(BIN)/python
	PIP_CONSTRAINT=$(CONSTRAINTS) PYTHON=$(BIN)/python bash scripts/install_torch.sh
	bash scripts/install_browser.sh
	PIP_CONSTRAINT=$(CONSTRAINTS) $(BIN)/python -m pip install -q -e ".[test]"

constraints:
	@echo "# The versions the test suite last passed with (make test installs with them). Refresh after a green suite" > $(CONSTRAINTS)
	@echo "# on newer versions: make constraints. torch and its CUDA wheels are left to scripts/install_torch.sh." >> $(CONSTRAINTS)
	$(BIN)/python -m pip freeze --exclude-editable | grep -viE '^(torch|nvidia-|triton)' >> $(CONSTRAINTS)

# Two pytest-xdist workers, one test file each at a time (a file's module fixtures are built once), one torch thread
# each (tests/conftest.py): on 2 cores 1.75x faster than one process, with the same tests.
test: install-test lint docs-check
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

# The same workers without the tests marked @pytest.mark.slow (a call over about 3 s: real training runs, launched
# processes, the family tests' training checks).
test-fast:
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not slow"

# MkDocs, Material and mkdocstrings (pyproject's docs extra, which make install-test installs too), at the versions of
# the constraints. mkdocstrings reads the sources without importing them, so the site needs neither torch nor flowrl.
$(BIN)/mkdocs: $(BIN)/python
	PIP_CONSTRAINT=$(CONSTRAINTS) $(BIN)/python -m pip install -q mkdocs mkdocs-material "mkdocstrings[python]"

# NO_MKDOCS_2_WARNING: Material's notice about its end of life (May 2027), printed on every build
docs: $(BIN)/mkdocs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

docs-check: $(BIN)/mkdocs
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet --site-dir "$$tmp" && echo "docs: strict build passed"

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format:
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

train: install
	$(BIN)/flowrl train digits/grpo

bench: install-test
	$(BIN)/python bench/overhead.py

# Re-create the shipped weights (about 20 minutes per generator on one core; the masked-token one about 30).
assets: install-test
	$(BIN)/python -m flowrl.reward_models.train_digit_classifier
	$(BIN)/python -m flowrl.pipelines.embedded.train_digits --kind flow
	$(BIN)/python -m flowrl.pipelines.embedded.distil_digits_student --threads 1  # DMD2 on digits_flow: needs it first
	$(BIN)/python -m flowrl.pipelines.embedded.train_digits --kind ddpm
	$(BIN)/python -m flowrl.pipelines.embedded.train_masked_digits
	$(BIN)/python -m flowrl.pipelines.embedded.train_arith --steps 1000 --seed 0 --flaw-rate 0.3
	$(BIN)/python -m flowrl.pipelines.embedded.train_arith_bd3lm
	$(BIN)/python -m flowrl.pipelines.embedded.train_sudoku --steps 170 --seed 0 --puzzles 2000 --clues 8 --threads 1
	$(BIN)/python -m flowrl.pipelines.embedded.train_digits_video --steps 4500 --batch-size 32 --lr 0.002 --seed 0 --width 64 --layers 4 --threads 1
