# The two commands of the README. Both are idempotent and fast on a warm machine.
.PHONY: demo test lint

demo:
	bash infra/bootstrap.sh
	.venv/bin/kiln setup kafka
	.venv/bin/kiln demo

test:
	bash infra/bootstrap.sh
	.venv/bin/kiln setup --all
	$(MAKE) --no-print-directory lint
	.venv/bin/python -m pytest -q -ra

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
