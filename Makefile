# The two commands of the README: `make demo` and `make test`. Both create the venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
MODE ?= thundersync
STEPS ?= 20
ALGO ?= grpo

$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the CPU build; an unpinned torch pulls CUDA
	$(PY) -m pip install -q -e ".[cpu,test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/thundersync demo --algo $(ALGO) --mode $(MODE) --steps $(STEPS)

# Two workers, each taking whole test files (module fixtures such as a recorded run are built once); the 15
# slowest tests are printed at the end. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

# The documentation site (mkdocs.yml, docs/) into site/; --strict: every warning is an error. mkdocs and
# mkdocs-material come with the venv's test extra; docs/hooks.py generates the configuration reference.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Everything except the tests marked slow (main_ppo runs, Ray + FSDP engines, model builds; see pytest.ini).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

.PHONY: install demo test test-fast docs
