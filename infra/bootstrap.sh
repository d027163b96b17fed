#!/usr/bin/env bash
# Creates the project's virtualenv, cached outside the repo and keyed by a hash of pyproject.toml and the
# Python version, links it as .venv, and installs this checkout into it (editable, without re-resolving deps).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ROOT="$(cd "$INFRA_DIR/.." && pwd)"
PYTHON="${KILN_PYTHON:-python3}"
started=$SECONDS

key=$( (cat "$ROOT/pyproject.toml"; "$PYTHON" --version) | sha256sum | cut -c1-12)
VENV="$KILN_CACHE/venv-$key"
if [[ ! -f $VENV/.complete ]]; then
  log "creating virtualenv $VENV (dependencies from PyPI, once per pyproject.toml)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip "setuptools>=68" wheel >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]" >&2
  touch "$VENV/.complete"
fi
# Re-point the editable install at this checkout (a fresh clone may live elsewhere); cheap, no resolution.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e "$ROOT" >&2
ln -sfn "$VENV" "$ROOT/.venv"
printf '[timing] bootstrap: python env: %ss\n' "$((SECONDS - started))" >&2
