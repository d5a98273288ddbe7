#!/usr/bin/env bash
# fmoe-local launcher for Linux: double-click it (or the menu entry), or run it in a terminal.
# It only finds a Python >= 3.10 and hands over to installers/bootstrap.py, which holds all the logic.
# Options: --repair (rebuild the environment), --smoke (headless self-test); anything else goes to app.py.
set -u
# Resolve a symlink (e.g. one put in ~/bin) so that the bootstrap is found next to the real file.
self="$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")"
here="$(cd "$(dirname "$self")" && pwd)"
bootstrap="$here/../bootstrap.py"

# Window stays open on failure when started from a file manager or menu, so the message can be read.
pause_on_error() {
  case " $* " in *" --smoke "*) return ;; esac
  if [ -t 0 ] && [ -t 1 ]; then read -r -p "Press Enter to close this window." _; fi
}

# 3.11 first: the version fmoe-local is tested with (and the one PyTorch wheels exist for longest).
python=""
for candidate in python3.11 python3.12 python3.13 python3.10 python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 &&
    "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done

if [ -z "$python" ]; then
  echo "[fmoe-local] fmoe-local needs Python 3.10 or newer, and none was found."
  echo "[fmoe-local] Install Python 3.11 with your package manager (Debian/Ubuntu: sudo apt install python3.11 python3.11-venv; Fedora: sudo dnf install python3.11), then run fmoe-local.sh again."
  pause_on_error "$@"
  exit 1
fi

"$python" "$bootstrap" "$@"
status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 130 ]; then pause_on_error "$@"; fi
exit "$status"
