#!/usr/bin/env bash
# The checkout's own Python environment, fast on a warm machine and never shared between checkouts:
# - the dependencies live in one virtualenv in the cache ($KILN_CACHE/deps-<key>), keyed by the dependency lists
#   of pyproject.toml (+ extras) and the Python version, built once and shared read-only;
# - each checkout gets its own small .venv (no pip, no copies) whose site-packages adds the shared one through a
#   .pth file, and into which this checkout alone is installed editable. Two clones side by side each run their
#   own code; a second clone costs seconds, not a re-download.
# KILN_EXTRAS (default "worker,ops,s3,test": everything the demo and the tests need beside the core) picks the
# optional dependency groups the shared environment carries.
# - the `rl` extra (torch: a CUDA wheel of ~3 GB, ~5.5 GB installed) has an environment of its own
#   ($KILN_CACHE/rl-<key>, keyed by the rl list and the Python version), layered after the shared one, so editing
#   any other dependency never downloads or stores torch again. KILN_RL=0 leaves it out (the RL tests then skip).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
ROOT="$(cd "$INFRA_DIR/.." && pwd)"
PYTHON="${KILN_PYTHON:-python3}"
EXTRAS="${KILN_EXTRAS:-worker,ops,s3,test}"
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
# cached_env PREFIX REQUIREMENTS KEEP [PIP_ARGS...]: a virtualenv $KILN_CACHE/PREFIX-<key> holding REQUIREMENTS,
# keyed by them and the Python version, built once; the KEEP most recently used of that prefix are kept. Prints it.
cached_env() {
  local prefix=$1 reqs=$2 keep=$3 key dir lock
  shift 3
  key=$( (printf '%s\n' "$reqs"; "$PYTHON" --version) | sha256sum | cut -c1-12)
  dir="$KILN_CACHE/$prefix-$key"
  # Checkouts bootstrapped side by side build one environment once: the second waits for the first's (a lock per
  # environment), instead of deleting it half-built.
  exec {lock}>"$KILN_CACHE/$prefix-$key.lock"
  flock "$lock"
  if [[ ! -f $dir/.complete ]]; then
    log "creating the $prefix environment $dir (from PyPI, once per requirement list)"
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check --upgrade pip "setuptools>=68" wheel >&2
    printf '%s\n' "$reqs" >"$dir/requirements.txt"
    "$dir/bin/pip" install -q --disable-pip-version-check "$@" -r "$dir/requirements.txt" >&2
    touch "$dir/.complete"
  fi
  touch "$dir/.complete"  # last use, for pruning
  ls -1dt "$KILN_CACHE/$prefix"-*/ 2>/dev/null | tail -n +$((keep + 1)) | xargs -r rm -rf
  flock -u "$lock"
  exec {lock}>&-
  echo "$dir"
}
DEPS=$(cached_env deps "$requirements" 3)
rm -rf "$KILN_CACHE"/venv-*  # the former shared-venv layout
# The rl environment (torch: ~3 GB download) without keeping pip's copy of the wheel.
RL=""
[[ ${KILN_RL:-1} == 0 ]] || RL=$(cached_env rl "$rl_requirements" 2 --no-cache-dir)

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
  # setuptools' deprecation notices about kiln's own metadata are for kiln's maintainers, not for whoever runs this.
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$ROOT" >&2
  # setuptools leaves kiln.egg-info in the checkout: anything run from here (cwd on sys.path) would read its entry
  # points, stale after the next edit, instead of the installed ones.
  rm -rf "$ROOT/kiln.egg-info"
  echo "$meta" >"$VENV/.kiln-installed"
fi
printf '[timing] bootstrap: python env: %ss\n' "$((SECONDS - started))" >&2
