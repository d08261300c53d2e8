# Sourced by the device scripts (gpu_check.sh, gpu_costs.sh) after they set $out: the Python to use
# ($PYTHON, else .venv/bin/python, else python3), the project on PYTHONPATH, the carried wheels
# installed into /tmp/site where megatron.core, ortools or matplotlib do not import and .whl/ exists
# (see scripts/fetch_device_wheels.sh), and `step NAME TIMEOUT_S COMMAND...`, which runs a command under
# its own timeout, logs it to $out/NAME.log and records a failure in ${failed[@]} without stopping.
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if ! "$PY" -c "import megatron.core, ortools, matplotlib" 2>/dev/null && [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

failed=()
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}
