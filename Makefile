# Every target sets up .venv itself: CPU torch first (a bare `torch` would pull a CUDA build),
# then hookscope with the extras the job needs.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Tests run on every core (pytest-xdist; a file's tests stay on one worker, so its module-scoped
# fixtures are built once); hypothesis runs its deterministic "ci" profile (tests/conftest.py).
# `make fuzz` runs only the property tests, with fresh random examples, ten times as many.
PYTEST_WORKERS ?= auto

.PHONY: setup demo test fuzz bench docs zoo
setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/hookscope capture efficientnet-lite0 --input sample:chelsea --layers '_blocks.*' --plot out/ --overwrite

test: setup
	$(VENV)/bin/ruff check src tests
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q
	# mypy (one core, about a minute from a fresh clone) checks beside the tests; either failing fails
	@log=$$(mktemp); $(VENV)/bin/mypy src/hookscope >$$log 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile; tests=$$?; \
	wait $$mypy; types=$$?; echo "mypy src/hookscope:"; cat $$log; rm -f $$log; \
	[ $$tests -eq 0 ] && [ $$types -eq 0 ]
	# the docs again on ATen's baseline kernels (no AVX2/AVX-512): a page that pins one CPU's
	# digits fails here first, not on a user's machine (one page to a worker, tests/test_readme.py)
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup tests/test_readme.py

fuzz: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) -m hypothesis --hypothesis-profile=fuzz

# the docs site (docs/ + the API reference from the docstrings) in build/site
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# python -m bench creates .venv-bench (pinned peers) on first use; e.g. BENCH_ARGS='--only gpt2'
bench: setup
	$(PY) -m bench $(BENCH_ARGS)

# every architecture of transformers' auto mappings through the verbs, against the model's own
# values; rewrites docs/zoo.md (about an hour on 2 busy cores; tests/test_zoo.py runs a sample)
zoo: setup
	PYTHONPATH=src:. $(PY) -m tests.zoo --jobs 2 --out docs/zoo.md
