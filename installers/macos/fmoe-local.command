#!/usr/bin/env bash
# fmoe-local launcher for macOS: double-click it in Finder (Terminal opens and shows progress).
# It only finds a Python >= 3.10 and hands over to installers/bootstrap.py, which holds all the logic.
# Options: --repair (rebuild the environment), --smoke (headless self-test); anything else goes to app.py.
set -u
# Resolve a symlink (e.g. one put in ~/bin) so that the bootstrap is found next to the real file.
self="$(readlink -f "${BASH_SOURCE[0]}" 2>/dev/null || echo "${BASH_SOURCE[0]}")"
here="$(cd "$(dirname "$self")" && pwd)"
bootstrap="$here/../bootstrap.py"
# Finder starts us with a short PATH: add where python.org and Homebrew put Python.
PATH="$PATH:/Library/Frameworks/Python.framework/Versions/Current/bin:/opt/homebrew/bin:/usr/local/bin"

pause_on_error() {
  case " $* " in *" --smoke "*) return ;; esac
  if [ -t 0 ] && [ -t 1 ]; then read -r -p "Press Enter to close this window." _; fi
}

# /usr/bin/python3 is skipped: it is Apple's 3.9 and, without the developer tools, opens an install dialog.
python=""
for candidate in python3.11 python3.12 python3.13 python3.10 python3; do
  path="$(command -v "$candidate" 2>/dev/null)" || continue
  [ "$path" = "/usr/bin/python3" ] && continue
  if "$path" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
    python="$path"
    break
  fi
done

if [ -z "$python" ]; then
  echo "[fmoe-local] fmoe-local needs Python 3.10 or newer, and none was found."
  echo "[fmoe-local] Install Python 3.11 from https://www.python.org/downloads/macos/ (or run: brew install python@3.11), then double-click fmoe-local.command again."
  pause_on_error "$@"
  exit 1
fi

"$python" "$bootstrap" "$@"
status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 130 ]; then pause_on_error "$@"; fi
exit "$status"
