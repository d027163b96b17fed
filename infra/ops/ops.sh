#!/usr/bin/env bash
# Tools the operator-facing tests use, from Debian: promtool (package prometheus) checks the alerting rules,
# chromium + chromium-driver load the status page headless (tests/streams/status/).
#   ops.sh install | status
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

status() {
  echo "$(promtool --version 2>&1 | head -1); $(chromium --version); $(chromedriver --version | cut -d' ' -f1-2)"
}

case "${1:-}" in
  install) apt_install prometheus chromium chromium-driver; status ;;
  status) status ;;
  *) echo "usage: $0 install|status" >&2; exit 2 ;;
esac
