export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd .snap/new
for args in "causal" "causal dkdv_schedule=serial" "nc" "causal bwd_delta_in_kernel=False"; do
  echo "== $args"; timeout -s KILL 40 python3 diag.py $args 2>&1 | grep -v Warn | tail -4
done
