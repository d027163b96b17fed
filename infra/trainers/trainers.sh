#!/usr/bin/env bash
# The trainers kiln's adapters are tested against, their code unmodified from PyPI (never kiln dependencies):
#   trainers.sh install | path
# $KILN_CACHE/trainers-<key>/ (key: the lists below and the Python version), built once:
# - code/: verl, AReaL and OpenRLHF with --no-deps, plus only what importing the modules the tests drive needs
#   (their full requirements are GPU stacks: vLLM, flash-attn, DeepSpeed, which a test never imports);
# - verifiers/: `verifiers` with its requirements resolved by pip (all pure Python).
# `path` prints both directories, one a line: the tests append them to sys.path, after kiln's own environment.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
PYTHON="${KILN_PYTHON:-python3}"

CODE=(
  verl==0.9.1 areal==1.0.4 openrlhf==0.11.2
  # verl.protocol and its utilities
  ray==2.60.0 tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.3 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3
  hydra-core==1.3.8 codetiming==1.4.0 orjson==3.13.0 msgpack==1.2.4 protobuf==7.36.2
  # areal.api, areal.infra, areal.workflow
  numba==0.68.1 llvmlite==0.50.0 einops==0.8.2 aiofiles==25.1.0 flask==3.1.3 werkzeug==3.1.9 itsdangerous==2.2.0
  blinker==1.9.0 lark==1.3.1 uvloop==0.23.0 torchdata==0.11.0
  # openrlhf.utils.agent
  pylatexenc==2.11
)
VERIFIERS=(verifiers==0.4.0)

key=$( (printf '%s\n' "${CODE[@]}" "${VERIFIERS[@]}"; "$PYTHON" --version) | sha256sum | cut -c1-12)
DIR="$KILN_CACHE/trainers-$key"

install() {
  [[ -f $DIR/.complete ]] && return 0
  log "installing the trainers' code into $DIR (from PyPI, once per list)"
  rm -rf "$DIR"
  "$PYTHON" -m venv "$DIR/pip"
  "$DIR/pip/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2
  "$DIR/pip/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-deps --target "$DIR/code" \
    "${CODE[@]}" >&2
  "$DIR/pip/bin/pip" install -q --disable-pip-version-check --no-cache-dir --target "$DIR/verifiers" \
    "${VERIFIERS[@]}" >&2
  # Top-level packages some wheels ship beside their own (`tests`, `scripts`): they would shadow the suite's.
  rm -rf "$DIR/code/tests" "$DIR/code/scripts" "$DIR/verifiers/tests" "$DIR/verifiers/scripts"
  touch "$DIR/.complete"
  ls -1dt "$KILN_CACHE"/trainers-* 2>/dev/null | tail -n +3 | xargs -r rm -rf
}

case "${1:-}" in
  install) install ;;
  path) [[ -f $DIR/.complete ]] || die "not installed: kiln setup trainers"; printf '%s\n' "$DIR/code" "$DIR/verifiers" ;;
  *) echo "usage: $0 install|path" >&2; exit 2 ;;
esac
