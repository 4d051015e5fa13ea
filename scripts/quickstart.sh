#!/usr/bin/env bash
# Sets up .venv and trains the quick-start: GRPO on the 135M demo model, on CPU (about 8 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
astuner --conf tutorial/quickstart/quickstart.yaml --backbone debug "$@"
