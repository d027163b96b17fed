# The two commands of the README. Both are idempotent and fast on a warm machine.
.PHONY: demo test lint

# The shared dependency environment behind this checkout's .venv (infra/bootstrap.sh); read after bootstrap ran.
DEPS = $(shell cat .venv/.kiln-deps)

demo:
	bash infra/bootstrap.sh
	.venv/bin/kiln setup kafka docker lean
	.venv/bin/kiln demo

test:
	bash infra/bootstrap.sh
	.venv/bin/kiln setup --all
	$(MAKE) --no-print-directory lint
	.venv/bin/python -m pytest -q -ra --durations=40

# mypy's cache outside the checkout (a clean clone's cold check takes ~40 s, a warm one ~2 s): mypy validates each
# cached module against its source's hash and its own version, so clones and versions can share it.
KILN_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kiln

lint:
	$(DEPS)/bin/ruff check .
	.venv/bin/python -m mypy --cache-dir $(KILN_CACHE)/mypy
