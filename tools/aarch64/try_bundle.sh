#!/usr/bin/env bash
# Install a `gemma-export bundle` folder on the emulated board and run its README's commands as
# written (every indented line of README.md, in order, from inside the bundle folder).
#
# Usage: sudo tools/aarch64/try_bundle.sh [--skip-bench] [--] BOARD_DIR   (the option before or after the folder)
#
# --skip-bench leaves out the README's `gemma-export bench` line: under emulation it takes about an
# hour (its times are emulation times anyway); the other commands take minutes.
#
# The bundle folder must be under /tmp or the current directory (run.sh binds those). The venv is
# created afresh in a temporary HOME inside the emulated board, so nothing of the toolkit's checkout
# is used: PYTHONPATH is cleared and the toolkit comes from the bundle's wheel.
set -euo pipefail
SKIP_BENCH=0
ARGS=()
OPTIONS=1
for arg in "$@"; do   # --skip-bench before or after the folder; after --, a folder whatever its name
  if [ "$OPTIONS" = 1 ]; then
    case "$arg" in
      -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
      --skip-bench) SKIP_BENCH=1; continue ;;
      --) OPTIONS=0; continue ;;
      -?*) echo "error: $arg: unknown option (expected --skip-bench; a folder named so: -- $arg or ./$arg)" >&2
           echo "usage: $0 [--skip-bench] BOARD_DIR" >&2; exit 2 ;;
    esac
  fi
  ARGS+=("$arg")
done
[ ${#ARGS[@]} -eq 1 ] || { echo "error: expected one BOARD_DIR, found ${#ARGS[@]}" >&2; echo "usage: $0 [--skip-bench] BOARD_DIR" >&2; exit 2; }
set -- "${ARGS[@]}"
[ -n "$1" ] || { echo "error: BOARD_DIR: empty path" >&2; exit 2; }
[ -d "$1" ] || { echo "error: $1: not a folder (expected a gemma-export bundle folder)" >&2; exit 2; }
BUNDLE=$(cd -- "$1" && pwd)
[ -f "$BUNDLE/README.md" ] && [ -f "$BUNDLE/BUNDLE.json" ] || { echo "error: $BUNDLE: not a gemma-export bundle (README.md, BUNDLE.json)" >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
COMMANDS=$(sed -n 's/^    //p' "$BUNDLE/README.md")
if [ "$SKIP_BENCH" = 1 ]; then
  COMMANDS=$(printf '%s\n' "$COMMANDS" | grep -v 'gemma-export bench ' || true)
fi
[ -n "$COMMANDS" ] || { echo "error: $BUNDLE/README.md: no indented command lines to run" >&2; exit 2; }
echo "[try_bundle] running on the emulated board, in $BUNDLE:" >&2
echo "$COMMANDS" | sed 's/^/  $ /' >&2
HOME_DIR=$(mktemp -d /tmp/gx-board-home.XXXXXX)
trap 'rm -rf "$HOME_DIR"' EXIT   # the throwaway venv (~330 MB)
cd "$BUNDLE"
"$HERE/run.sh" /usr/bin/env -u PYTHONPATH HOME="$HOME_DIR" PATH=/usr/bin:/bin /bin/sh -ec "$COMMANDS"
