#!/usr/bin/env bash
# The checkout's own Python environment, fast on a warm machine and never shared between checkouts:
# - the dependencies live in one virtualenv in the cache ($KILN_CACHE/deps-<key>), keyed by the dependency lists
#   of pyproject.toml (+ extras) and the Python version, built once and shared read-only;
# - each checkout gets its own small .venv (no pip, no copies) whose site-packages adds the shared one through a
#   .pth file, and into which this checkout alone is installed editable. Two clones side by side each run their
#   own code; a second clone costs seconds, not a re-download.
# KILN_EXTRAS (default "test") picks the optional dependency groups the shared environment carries.
# - the `rl` extra (torch: a CUDA wheel of ~3 GB, ~5.5 GB installed) has an environment of its own
#   ($KILN_CACHE/rl-<key>, keyed by the rl list and the Python version), layered after the shared one, so editing
#   any other dependency never downloads or stores torch again. KILN_RL=0 leaves it out (the RL tests then skip).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ROOT="$(cd "$INFRA_DIR/.." && pwd)"
PYTHON="${KILN_PYTHON:-python3}"
EXTRAS="${KILN_EXTRAS:-test}"
started=$SECONDS

# The requirement list: dependencies + the chosen extras, from pyproject.toml (entry points and tool settings do not
# change it, so editing them never rebuilds the environment).
requirements=$("$PYTHON" - "$ROOT/pyproject.toml" "$EXTRAS" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
optional = project.get("optional-dependencies", {})
wanted = [e for e in sys.argv[2].split(",") if e]
missing = [e for e in wanted if e not in optional]
if missing:
    sys.exit(f"unknown extras {missing}; pyproject.toml has {sorted(optional)}")
print("\n".join(sorted(set(project["dependencies"]).union(*(optional[e] for e in wanted if e != "rl")))))
EOF
)
rl_requirements=$("$PYTHON" -c 'import sys, tomllib; print("\n".join(sorted(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["rl"])))' "$ROOT/pyproject.toml")
key=$( (printf '%s\n' "$requirements"; "$PYTHON" --version) | sha256sum | cut -c1-12)
DEPS="$KILN_CACHE/deps-$key"
if [[ ! -f $DEPS/.complete ]]; then
  log "creating the shared dependency environment $DEPS (from PyPI, once per dependency list)"
  rm -rf "$DEPS"
  "$PYTHON" -m venv "$DEPS"
  "$DEPS/bin/pip" install -q --disable-pip-version-check --upgrade pip "setuptools>=68" wheel >&2
  printf '%s\n' "$requirements" >"$DEPS/requirements.txt"
  "$DEPS/bin/pip" install -q --disable-pip-version-check -r "$DEPS/requirements.txt" >&2
  touch "$DEPS/.complete"
fi
touch "$DEPS/.complete"  # last use, for pruning
# Keep the three most recently used dependency environments; drop those of the former shared-venv layout.
ls -1dt "$KILN_CACHE"/deps-* 2>/dev/null | tail -n +4 | xargs -r rm -rf
rm -rf "$KILN_CACHE"/venv-*

# The rl environment: built once per rl list, without keeping pip's copy of the 3 GB wheel; the two most recently
# used are kept.
RL=""
if [[ ${KILN_RL:-1} != 0 ]]; then
  rl_key=$( (printf '%s\n' "$rl_requirements"; "$PYTHON" --version) | sha256sum | cut -c1-12)
  RL="$KILN_CACHE/rl-$rl_key"
  if [[ ! -f $RL/.complete ]]; then
    log "creating the rl environment $RL (torch from PyPI: ~3 GB download, once per rl list)"
    rm -rf "$RL"
    "$PYTHON" -m venv "$RL"
    printf '%s\n' "$rl_requirements" >"$RL/requirements.txt"
    "$RL/bin/pip" install -q --disable-pip-version-check --no-cache-dir -r "$RL/requirements.txt" >&2
    touch "$RL/.complete"
  fi
  touch "$RL/.complete"
  ls -1dt "$KILN_CACHE"/rl-* 2>/dev/null | tail -n +3 | xargs -r rm -rf
fi

VENV="$ROOT/.venv"
[[ -L $VENV ]] && rm -f "$VENV"  # a link into a shared environment (the former layout)
rm -rf "$ROOT/kiln.egg-info"
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [[ ! -f $VENV/.kiln-deps || $(cat "$VENV/.kiln-deps") != "$DEPS" ]]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv --without-pip "$VENV"
  echo "$DEPS" >"$VENV/.kiln-deps"
fi
# addsitedir (not a bare path) so the environments' own .pth files are processed too; one file, so the shared
# environment always comes first (the rl one brings its own copies of a few common packages).
pth="import site; site.addsitedir('$(site_of "$DEPS/bin/python")')"
[[ -n $RL ]] && pth+=$'\n'"import site; site.addsitedir('$(site_of "$RL/bin/python")')"
pth_file="$(site_of "$VENV/bin/python")/_kiln_shared_deps.pth"
[[ -f $pth_file && $(cat "$pth_file") == "$pth" ]] || printf '%s\n' "$pth" >"$pth_file"
# Install this checkout editable (only `kiln` is mapped); again only when its metadata changed. Sources added
# later are found without a reinstall.
meta=$(sha256sum "$ROOT/pyproject.toml" | cut -c1-12)
if [[ ! -f $VENV/.kiln-installed || $(cat "$VENV/.kiln-installed") != "$meta" ]]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT" >&2
  # setuptools leaves kiln.egg-info in the checkout: anything run from here (cwd on sys.path) would read its entry
  # points, stale after the next edit, instead of the installed ones.
  rm -rf "$ROOT/kiln.egg-info"
  echo "$meta" >"$VENV/.kiln-installed"
fi
printf '[timing] bootstrap: python env: %ss\n' "$((SECONDS - started))" >&2
