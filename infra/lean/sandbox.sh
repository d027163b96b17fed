#!/usr/bin/env bash
# The Lean REPL's sandbox: bubblewrap from Debian (workers/lean/sandbox.py runs every REPL process in it).
#   sandbox.sh install | status
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

status() {
  bwrap --unshare-all --uid 65534 --gid 65534 --ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib /lib \
    --symlink usr/lib64 /lib64 -- /usr/bin/true && echo "bubblewrap $(bwrap --version | cut -d' ' -f2): user namespaces work"
}

case "${1:-}" in
  install) apt_install bubblewrap; status >/dev/null || die "bubblewrap cannot create user namespaces here" ;;
  status) status ;;
  *) echo "usage: $0 install|status" >&2; exit 2 ;;
esac
