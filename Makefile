# The two commands of the README. Both are idempotent and fast on a warm machine.
.PHONY: demo test lint

demo:
	bash infra/bootstrap.sh
	.venv/bin/kiln setup kafka
	.venv/bin/kiln demo

test:
	bash infra/bootstrap.sh
	.venv/bin/kiln setup --all
	.venv/bin/python -m pytest -q -ra

lint:
	.venv/bin/ruff check streams workers ingest schemas tests bench
	.venv/bin/mypy
