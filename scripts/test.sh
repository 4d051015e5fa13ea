#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite (CPU only, no network but the package index).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --test
. .venv/bin/activate
python -m pytest -q "$@"
