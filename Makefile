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

lint:
	$(DEPS)/bin/ruff check .
	.venv/bin/python -m mypy
