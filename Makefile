# make install   create .venv with flowrl and its test dependencies (CPU torch unless a GPU is present;
#                as root on Debian also chromium + chromium-driver for the labelling page's browser test)
# make test      install, then run the whole test suite (what CI runs)
# make train     the README's main job: GRPO on the embedded digits model
# make bench     framework-overhead benchmark
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test train bench assets

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	PYTHON=$(BIN)/python bash scripts/install_torch.sh
	bash scripts/install_browser.sh
	$(BIN)/python -m pip install -q -e ".[test]"

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

train: install
	$(BIN)/flowrl train configs/digits/grpo.yaml

bench: install
	$(BIN)/python bench/overhead.py

# Re-create the shipped weights (about 20 minutes per generator on one core).
assets: install
	$(BIN)/python -m flowrl.reward_models.train_digit_classifier
	$(BIN)/python -m flowrl.pipelines.embedded.train_digits --kind flow
	$(BIN)/python -m flowrl.pipelines.embedded.train_digits --kind ddpm
