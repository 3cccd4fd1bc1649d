#!/usr/bin/env bash
# Remove what scripts/install.sh installed: the virtual environment (.venv, or $SWIFTLM_VENV), and, unless
# --keep-models, the models in the Hugging Face cache that `swiftlm models` lists (HF_HOME / HF_HUB_CACHE; the
# bundled model goes with the venv).  Other install methods: docs/guide/getting-started.md ("Other ways to install").
# Usage: scripts/uninstall.sh [--keep-models] [--yes]
#   --keep-models  leave the Hugging Face cache alone
#   --yes          do not ask before deleting models (needed when not run from a terminal)
set -euo pipefail
cd "$(dirname "$0")/.."
keep=0; yes=0
for a in "$@"; do
  case "$a" in
    --keep-models) keep=1 ;;
    --yes|-y) yes=1 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "uninstall.sh: unknown option '$a' (see scripts/uninstall.sh --help)" >&2; exit 2 ;;
  esac
done
VENV="${SWIFTLM_VENV:-.venv}"
SW="$VENV/bin/swiftlm"
if [ "$keep" = 0 ]; then
  if [ -x "$SW" ]; then
    models="$("$SW" models --json | "$VENV/bin/python" -c 'import json, sys
print("\n".join(m["id"] for m in json.load(sys.stdin)["models"] if m["source"] == "hf-cache"))')"
  else
    models=""
    echo "uninstall.sh: no swiftlm in $VENV, so no model list; the Hugging Face cache is left alone" >&2
  fi
  if [ -n "$models" ]; then
    echo "models in the Hugging Face cache that will be deleted:"; echo "$models" | sed 's/^/  /'
    if [ "$yes" = 0 ]; then
      if [ -t 0 ]; then
        read -r -p "delete them? [y/N] " ans
        case "$ans" in y|Y|yes) ;; *) echo "uninstall.sh: stopped; nothing removed (--keep-models keeps them)" >&2; exit 1 ;; esac
      else
        echo "uninstall.sh: not a terminal: pass --yes to delete these models or --keep-models to keep them; nothing removed" >&2
        exit 2
      fi
    fi
    while IFS= read -r m; do "$SW" rm "$m"; done <<< "$models"
  fi
fi
if [ -d "$VENV" ]; then
  rm -rf "$VENV"
  echo "removed $VENV"
else
  echo "no virtual environment at $VENV"
fi
[ "$keep" = 1 ] && echo "kept the Hugging Face cache (${HF_HUB_CACHE:-${HF_HOME:-~/.cache/huggingface}/hub})" || true
