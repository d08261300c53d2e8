# Sourced by the device scripts (gpu_check.sh, gpu_costs.sh) after they set $out and $mode: the Python to
# use ($PYTHON, else .venv/bin/python, else python3), the project on PYTHONPATH, the carried wheels
# installed into /tmp/site where megatron.core, ortools or matplotlib do not import and .whl/ exists (see
# scripts/fetch_device_wheels.sh), and
#   step NAME TIMEOUT_S COMMAND...   run a command under its own timeout, log it to $work/NAME.log, record
#                                    a failure in ${failed[@]} and go on;
#   finish                           pack $work into OUT/SCRIPT.tar.gz beside OUT/summary.txt and exit
#                                    non-zero if a step failed.
# A device call brings back at most 8 files and runs at most 600 s: a script leaves exactly two files in
# OUT, and its steps' time limits add up to at most $step_budget_s (540 s on a GPU), checked step by step
# before a step starts. ORCH_DEVICE_DRY_RUN=1 lists the steps and their limits and runs none (the test
# of the budgets does this).
script_base=${script_name%.sh}
work="$out/$script_base"
dry_run=${ORCH_DEVICE_DRY_RUN:-0}
if [ "$mode" = gpu ]; then step_budget_s=540; else step_budget_s=1500; fi
planned_s=0
failed=()
if [ "$dry_run" != 1 ]; then
  mkdir -p "$work" || exit 1
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
  if ! "$PY" -c "import megatron.core, ortools, matplotlib" 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
else
  PY=python3
fi

step() {
  local name=$1 limit=$2; shift 2
  planned_s=$((planned_s + limit))
  if [ "$planned_s" -gt "$step_budget_s" ]; then
    echo "== $name: NOT RUN: its limit would bring the steps to $planned_s s, over the $step_budget_s s budget"
    failed+=("$name (over the time budget)")
    return
  fi
  if [ "$dry_run" = 1 ]; then echo "step $name $limit"; return; fi
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$work/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

finish() {
  if [ "$dry_run" = 1 ]; then
    echo "total $planned_s of $step_budget_s s"
    [ ${#failed[@]} -eq 0 ]; exit
  fi
  {
    date -u
    echo "$script_name ($mode): steps planned $planned_s s of $step_budget_s s; files in $script_base.tar.gz"
    [ -f "$work/summary_lines.txt" ] && cat "$work/summary_lines.txt"
    if [ ${#failed[@]} -eq 0 ]; then echo PASSED; else printf 'FAILED: %s\n' "${failed[@]}"; fi
  } | tee "$out/summary.txt"
  tar -czf "$out/$script_base.tar.gz" -C "$out" "$script_base" && rm -rf "$work"
  [ ${#failed[@]} -eq 0 ]; exit
}

# summarize LINE...: lines for summary.txt (a step's headline figures), after the steps.
summarize() { [ "$dry_run" = 1 ] || printf '%s\n' "$@" >> "$work/summary_lines.txt"; }
