# Shared shell helpers for infra/ scripts (sourced, not executed).
# Every artefact lives under KILN_CACHE (outside the repo) keyed by its version or input hash,
# and every service's runtime state under KILN_RUN, so a fresh clone reuses a warm machine.
set -euo pipefail

KILN_CACHE="${KILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln}"
KILN_RUN="${KILN_RUN:-$KILN_CACHE/run}"
INFRA_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KILN_CACHE KILN_RUN
mkdir -p "$KILN_CACHE" "$KILN_RUN"

log() { printf '[kiln-infra] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# wait_for DESCRIPTION TIMEOUT_S COMMAND...: poll COMMAND until it succeeds.
wait_for() {
  local what=$1 timeout=$2; shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then die "$what not ready after ${timeout}s"; fi
    sleep 0.3
  done
}

# pid_alive PIDFILE: the process recorded in PIDFILE is running.
pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# stop_pidfile PIDFILE NAME: SIGTERM, wait, then SIGKILL.
stop_pidfile() {
  local pidfile=$1 name=$2
  if ! pid_alive "$pidfile"; then log "$name not running"; rm -f "$pidfile"; return 0; fi
  local pid; pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$pidfile"
  log "$name stopped"
}

tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

apt_install() {
  local missing=()
  for pkg in "$@"; do
    # "deinstall ok config-files" (removed, not purged) also makes dpkg -s succeed: ask for the real state.
    [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) == "install ok installed" ]] || missing+=("$pkg")
  done
  ((${#missing[@]} == 0)) && return 0
  log "apt-get install ${missing[*]}"
  local stamp="$KILN_CACHE/apt-updated"
  # Two checkouts set up side by side (a CI clone beside a developer's) must not fail on dpkg's lock: apt waits for
  # it, and the update stamp is taken under a lock of its own.
  (
    flock 9
    if [[ ! -f $stamp ]] || (($(date +%s) - $(stat -c %Y "$stamp") > 86400)); then
      apt-get -o DPkg::Lock::Timeout=900 update -q >&2 && touch "$stamp"
    fi
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -q --no-install-recommends \
      "${missing[@]}" >&2
  ) 9>"$KILN_CACHE/apt.lock"
}

# installation_secret NAME: a random secret made once per installation ($KILN_CACHE/secrets/NAME, mode 600), so no
# credential of a local service is a committed default.
installation_secret() {
  local dir="$KILN_CACHE/secrets" file="$KILN_CACHE/secrets/$1"
  if [[ ! -s $file ]]; then
    mkdir -p "$dir" && chmod 700 "$dir"
    (umask 077; head -c 64 /dev/urandom | base64 -w0 | tr -dc 'A-Za-z0-9' | cut -c1-32 >"$file.tmp" && mv "$file.tmp" "$file")
  fi
  cat "$file"
}

# same_config_running PIDFILE KEYFILE KEY: the service runs, started with configuration KEY (when it runs with
# another, the caller stops it and starts it again: new credentials take effect).
same_config_running() {
  local pidfile=$1 keyfile=$2 key=$3
  pid_alive "$pidfile" || return 1
  [[ $(cat "$keyfile" 2>/dev/null) == "$key" ]] && return 0
  return 1
}
