export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
F="fused_backward=True fused_dq_shared=True compute_registers=240 producer_registers=24"
for v in "shared:" "overlap:fused_overlap=True" "deferred:fused_defer_dq=True fused_defer_inline=True"; do
  n=${v%%:*}; kw=${v#*:}; mkdir -p $R/$n
  echo "=== $n ($kw)" | tee -a $R/profile.log
  timeout -s INT 120 python3 scripts/mosaic_profile.py --backward --shape 1,16384,16,128 --out $R/$n $F $kw > $R/$n/log.txt 2>&1
  echo "rc=$?" >> $R/$n/log.txt
  grep -v Warn $R/$n/log.txt | tail -30 | tee -a $R/profile.log
done
du -sh $R/*
