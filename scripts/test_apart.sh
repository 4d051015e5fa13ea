#!/usr/bin/env bash
# The closing passes of scripts/test.sh: AgentScope 2.x and verifiers each need their own environment
# (.venv-as2, .venv-vf). Two single-process runs, one core each, side by side; each log is printed when both are
# done, and the exit status is 0 only when both passed.
set -euo pipefail
cd "$(dirname "$0")/.."
apart=$(mktemp -d)
as2= vf=
# `|| true`: under set -e a failing command in the trap (kill of a run already reaped) would make the exit 1.
trap 'kill $as2 $vf 2>/dev/null || true; rm -rf "$apart"' EXIT  # an interrupt stops both
.venv-as2/bin/python -m pytest -q --basetemp "$apart/as2" tests/test_agentscope2.py > "$apart/as2.log" 2>&1 &
as2=$!
.venv-vf/bin/python -m pytest -q --basetemp "$apart/vf" tests/test_verifiers.py > "$apart/vf.log" 2>&1 &
vf=$!
as2_rc=0 vf_rc=0
wait "$as2" || as2_rc=$?
wait "$vf" || vf_rc=$?
echo "AgentScope 2.x (exit $as2_rc):"; cat "$apart/as2.log"
echo "verifiers (exit $vf_rc):"; cat "$apart/vf.log"
[ "$as2_rc" = 0 ] && [ "$vf_rc" = 0 ]
