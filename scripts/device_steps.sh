# Sourced by the device scripts (gpu_check.sh, gpu_costs.sh) after device_options has set $out and $mode,
# from the repository root: the Python to use ($PYTHON, else .venv/bin/python, else python3), the project
# on PYTHONPATH, the carried wheels installed into /tmp/site where megatron.core, ortools or matplotlib do
# not import and .whl/ exists (see scripts/fetch_device_wheels.sh), and
#   step NAME LIMIT_S COMMAND...   run a command under its own time limit, log it to $work/NAME.log, record
#                                  a failure in ${failed[@]} and go on; a step writes its files under $work;
#   summarize LINE...              headline lines (a step's figures) for summary.txt;
#   finish                         pack $work into OUT/SCRIPT.tar.gz beside OUT/summary.txt and exit
#                                  non-zero if a step failed.
# A device call brings back at most 8 files and runs at most 600 s: a script leaves exactly two files in
# OUT, and its steps' limits add up to at most $step_budget_s (540 s on a GPU), checked before each step
# starts; a step also never runs past $deadline_s after the script started (the set-up, e.g. installing
# the wheels, counts). ORCH_DEVICE_DRY_RUN=1 lists the steps and their limits, runs and writes nothing
# (the test of the budgets does this).
script_base=${script_name%.sh}
work="$out/$script_base"
dry_run=${ORCH_DEVICE_DRY_RUN:-0}
if [ "$mode" = gpu ]; then step_budget_s=540 deadline_s=575; else step_budget_s=4400 deadline_s=5000; fi
planned_s=0
failed=()
if [ "$dry_run" != 1 ]; then
  [ ! -e "$work" ] || { echo "$script_name: error: $work exists already: give an empty OUT_DIR" >&2; exit 2; }
  mkdir -p "$work" || exit 1
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
  if ! "$PY" -c "import megatron.core, ortools, matplotlib" 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
else
  PY=${PYTHON:-python3}
fi

step() {
  local name=$1 limit=$2; shift 2
  if [ $((planned_s + limit)) -gt "$step_budget_s" ]; then
    echo "== $name: NOT RUN: its limit of $limit s would bring the steps to $((planned_s + limit)) s, over the" \
      "$step_budget_s s budget"
    failed+=("$name (not run: over the time budget)")
    return
  fi
  planned_s=$((planned_s + limit))
  if [ "$dry_run" = 1 ]; then echo "step $name $limit"; return; fi
  local left=$((deadline_s - SECONDS))
  if [ "$left" -lt "$limit" ]; then
    echo "== $name: limit cut from $limit s to $left s: the script started $SECONDS s ago (deadline $deadline_s s)"
    limit=$left
  fi
  if [ "$limit" -lt 5 ]; then
    failed+=("$name (not run: past the deadline)")
    return
  fi
  echo "== $name: $*"
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$work/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$work/$name.log"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then failed+=("$name (stopped at its $limit s limit)")
  elif [ "$rc" -ne 0 ]; then failed+=("$name (exit $rc)"); fi
}

summarize() { [ "$dry_run" = 1 ] || printf '%s\n' "$@" >> "$work/summary_lines.txt"; }

finish() {
  if [ "$dry_run" = 1 ]; then
    echo "total $planned_s of $step_budget_s s"
    [ ${#failed[@]} -eq 0 ]; exit
  fi
  {
    date -u
    echo "$script_name ($mode): steps' limits $planned_s s of $step_budget_s s, ran $SECONDS s; logs and files" \
      "in $script_base.tar.gz"
    [ -f "$work/summary_lines.txt" ] && cat "$work/summary_lines.txt"
    if [ ${#failed[@]} -eq 0 ]; then echo PASSED
    else echo "FAILED: $(IFS=';'; echo "${failed[*]}" | sed 's/;/; /g')"; fi
  } > "$out/summary.txt"
  cp "$out/summary.txt" "$work/summary.txt"
  cat "$out/summary.txt"
  tar -czf "$out/$script_base.tar.gz" -C "$out" "$script_base" && rm -rf "$work"
  [ ${#failed[@]} -eq 0 ]; exit
}
