#!/usr/bin/env bash
# One device call: Triton kernels at real sizes, GPU parity, benchmarks. Logs: $OUT/logs.tgz.
# Usage (device machine, repo root):
#   bash scripts/gpu_check.sh [quick|ablate|tma|session14|session15|session16|parity16|inproj|against|session17|refresh|session19|session19b|session20|session21|timeline|kernels|verify|bench|maxlen|throughput|profile|ab|fp8|fp8b|blockn|moe|host|piecewise|prefill|pwtp|gemvwide|mlp|prefillgraphs|bigengine|normhoist|forms|targets|gemmforms|others|gemv|record|all]
# Before the call, here: PYTHONPATH=. .venv/bin/python scripts/gpu_parity.py make .parity
# and pass carry=[".parity"] to the device run.
set -uo pipefail
OUT=${OUT:-/tmp/krait_gpu}
LOG=/tmp/krait_logs  # packed into $OUT/logs.tgz at the end (a device call returns few files)
mkdir -p "$OUT" "$LOG"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KRAIT_TEST_GPU=1
what=${1:-all}
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }  # after each part: a timed-out call keeps its logs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOG/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$LOG/gpu.txt"

run_kernels() {
  timeout ${KERNEL_TIMEOUT:-900} python3 -m pytest -q --maxfail=5 -m gpu tests/ops tests/runner tests/test_bench.py -p no:cacheprovider 2>&1 | tail -60 | tee "$LOG/kernels.log"
  pack
}
run_parity() {
  # HF parity on the GPU in float32, CUDA graphs on and off, chunked prefill. The oracle comes
  # from this machine's checkout: run `PYTHONPATH=. python3 scripts/gpu_parity.py make .parity`
  # there first and name .parity in the device call's carry.
  if [ -d .parity ]; then
    # the full log keeps the first traceback (a failure can break the models after it)
    timeout ${PARITY_TIMEOUT:-600} python3 scripts/gpu_parity.py check .parity 2>&1 | grep -v Warn > "$LOG/parity_full${PARITY_TAG:-}.log"
    tail -40 "$LOG/parity_full${PARITY_TAG:-}.log" | tee "$LOG/parity${PARITY_TAG:-}.log"
  else
    echo "no .parity fixtures carried: GPU parity skipped" | tee "$LOG/parity.log"
  fi
}
bench_latency() {  # name, tag, extra args
  local name=$1 tag=$2; shift 2
  timeout 600 python3 -m krait bench latency --config "$name" "$@" > "$LOG/lat_${name}${tag}.json" 2> "$LOG/lat_${name}${tag}.err"
  echo "== $name $tag"; grep -v Warn "$LOG/lat_${name}${tag}.err" | tail -12
  pack
}
case $what in
  quick)
    run_kernels
    bench_latency qwen3-0.6b "" --batch-sizes 1,64 --prompt-lens 2048 --num-steps 10
    ;;
  kernels) run_kernels; run_parity ;;
  verify)  # first call after unmeasured changes: kernels at real sizes, GPU parity, GEMV sweep
    run_kernels; run_parity; pack
    bash "$0" gemv
    ;;
  bench)
    for m in mamba2-1.3b granite-4.0-h-micro qwen3-0.6b; do bench_latency $m ""; done
    ;;
  throughput)  # offline throughput against HF transformers generate, same process
    # HF's Mamba2 without mamba_ssm kernels is very slow: it goes last, each model time-boxed.
    # Two workloads: prefill-heavy (256 in / 64 out) and decode-heavy (256 in / 256 out, HF
    # timed on 64 new tokens: its per-token rate only rises with shorter outputs). TP_EXTRA adds
    # engine flags, e.g. TP_EXTRA="--mamba-ssm-cache-dtype bfloat16" (HF keeps its SSM state in
    # the model dtype; krait's default is float32, twice the state bytes a decode step moves)
    for m in ${MODELS:-qwen3-0.6b granite-4.0-h-micro mamba2-1.3b}; do
      for out in ${OUT_LENS:-64 256}; do
        timeout ${TP_TIMEOUT:-150} python3 -m krait bench throughput --config $m --num-prompts 256 \
          --input-len 256 --output-len $out --hf-output-len ${HF_OUT:-64} --hf-baseline \
          --hf-max-prompts 32 ${TP_EXTRA:-} > "$LOG/tp_${m}_o$out.json" 2> "$LOG/tp_${m}_o$out.err"
        echo "== $m output $out"; grep -v Warn "$LOG/tp_${m}_o$out.err" | tail -4; pack
      done
    done
    ;;
  maxlen)  # decode cost must not follow max_model_len
    for L in 4096 131072; do
      bench_latency granite-4.0-h-micro "_L$L" --batch-sizes 1,64 --prompt-lens "" --max-model-len $L
    done
    ;;
  profile)  # wall vs GPU kernel time of decode steps and one prefill, top kernels
    # (and the host's own time per decode step with the functions it goes to: cProfile)
    OUT=$LOG timeout ${PROFILE_TIMEOUT:-400} python3 scripts/profile_decode.py \
      ${PROFILE_SPECS:-qwen3-0.6b:1:1024 granite-4.0-h-micro:1:1024 granite-4.0-h-micro:64:1024 mamba2-1.3b:1:1024} \
      --prefill ${PROFILE_PREFILL:-2048} ${PROFILE_EXTRA:-} 2>&1 | grep -v -E "Warn|USDT|profiler" \
      | tee "$LOG/${PROFILE_LOG:-profile}.log"
    ;;
  ab)  # the dispatch knobs against the defaults, same machine (~4 min): programmatic dependent
    # launch off (KRAIT_PDL=0), the GEMV's PDL trigger at its start (KRAIT_PDL_TRIGGER=early),
    # session 5's narrow GEMV rule (KRAIT_GEMV=narrow), the wide one (KRAIT_GEMV=wide). Decode
    # attention tiles and splits: `blockn`; the fp8 cache: `fp8`.
    for m in qwen3-0.6b mamba2-1.3b granite-4.0-h-micro; do
      bench_latency $m "_base" --batch-sizes 1,8,64 --prompt-lens ""
      KRAIT_PDL=0 bench_latency $m "_nopdl" --batch-sizes 1,8,64 --prompt-lens ""
      KRAIT_PDL_TRIGGER=early bench_latency $m "_early" --batch-sizes 1 --prompt-lens ""
      KRAIT_GEMV=narrow bench_latency $m "_narrow" --batch-sizes 1 --prompt-lens ""
      KRAIT_GEMV=wide bench_latency $m "_wide" --batch-sizes 1 --prompt-lens ""
    done
    ;;
  fp8)  # the fp8 KV cache against the model-dtype cache: decode at
    # batch 1/64/256 (the KV read dominates at 256), then qwen3's throughput with it (~5 min)
    for m in qwen3-0.6b granite-4.0-h-micro; do
      bench_latency $m "_kvauto" --batch-sizes 1,64,256 --prompt-lens ""
      bench_latency $m "_kvfp8" --batch-sizes 1,64,256 --prompt-lens "" --kv-cache-dtype fp8
    done
    MODELS=qwen3-0.6b OUT_LENS=256 TP_EXTRA="--kv-cache-dtype fp8" bash "$0" throughput
    ;;
  fp8b)  # the fp8 cache widened in registers (session 7; ~3 min): its GPU tests, decode at
    # batch 1/64/256 against the bf16 cache (qwen3), qwen3's throughput with it (krait only)
    timeout 200 python3 -m pytest -q -m gpu tests/ops/test_fp8_kv_cache.py -p no:cacheprovider \
      2>&1 | tail -15 | tee "$LOG/kernels_fp8.log"
    bench_latency qwen3-0.6b "_kvauto" --batch-sizes 1,64,256 --prompt-lens ""
    bench_latency qwen3-0.6b "_kvfp8" --batch-sizes 1,64,256 --prompt-lens "" --kv-cache-dtype fp8
    timeout 150 python3 -m krait bench throughput --config qwen3-0.6b --num-prompts 256 \
      --input-len 256 --output-len 256 --kv-cache-dtype fp8 > "$LOG/tp_qwen3_fp8.json" \
      2> "$LOG/tp_qwen3_fp8.err"
    grep -v Warn "$LOG/tp_qwen3_fp8.err" | tail -3
    ;;
  blockn)  # keys per decode tile (KRAIT_DECODE_BLOCK_N, 64 unless set) for the bf16 and the
    # fp8 cache, qwen3 at batch 1/64/256, alternating (~4 min): an fp8 tile of 64 keys moves
    # half a bf16 tile's bytes for the same per-tile work
    for kv in auto fp8; do for bn in 64 128; do
      KRAIT_DECODE_BLOCK_N=$bn bench_latency qwen3-0.6b "_${kv}_n$bn" --batch-sizes 1,64,256 \
        --prompt-lens "" --kv-cache-dtype $kv
    done; done
    # batch 64 runs 512 one-split programs at 3 a SM (153 registers): 1.3 waves. Four waves'
    # worth of programs splits its rows in two (the split kernel, 96 registers)
    for w in 2 4; do
      KRAIT_DECODE_SPLIT_WAVES=$w bench_latency qwen3-0.6b "_waves$w" --batch-sizes 32,64,128 \
        --prompt-lens ""
    done
    ;;
  moe)  # the MoE's few-route path (on by default since session 9; KRAIT_MOE_ROUTES=0 off; ~6 min):
    # its GPU tests, GPU parity with it off, granite-4.0-h-tiny decode at batch 1/2/4/8 with and
    # without it, alternating twice, then both profiled at batch 1 and a 2048-token prefill
    timeout 200 python3 -m pytest -q -m gpu tests/ops/test_moe_routes.py tests/ops/test_fused_moe.py \
      -p no:cacheprovider 2>&1 | tail -8 | tee "$LOG/kernels_moe.log"
    if [ -d .parity ]; then
      KRAIT_MOE_ROUTES=0 timeout 300 python3 scripts/gpu_parity.py check .parity 2>&1 \
        | grep -v Warn | tail -4 | tee "$LOG/parity_moe.log"
    fi
    for i in 1 2; do
      KRAIT_MOE_ROUTES=0 bench_latency granite-4.0-h-tiny "_grouped$i" --batch-sizes 1,2,4,8 \
        --prompt-lens ""
      bench_latency granite-4.0-h-tiny "_routes$i" --batch-sizes 1,2,4,8 --prompt-lens ""
    done
    PROFILE_SPECS="granite-4.0-h-tiny:1:1024" bash "$0" profile
    KRAIT_MOE_ROUTES=0 PROFILE_LOG=profile_grouped PROFILE_SPECS="granite-4.0-h-tiny:1:1024" \
      PROFILE_PREFILL=0 bash "$0" profile
    ;;
  host)  # an eager prefill's host time in two trees, alternating (~4 min): this one and .ab_base/,
    # made here before the call (rm -rf .ab_base && mkdir .ab_base && git archive BASE krait |
    # tar -x -C .ab_base; echo .ab_base/ >> .git/info/exclude) and named in the call's carry.
    # `python3 -m` puts the working directory first on sys.path, ahead of PYTHONPATH: each tree
    # runs from its own directory (session 9's run 7 ran this tree twice by missing that)
    [ -d .ab_base/krait ] || { echo "no .ab_base/krait carried"; exit 1; }
    root=$PWD
    for m in qwen3-0.6b granite-4.0-h-tiny; do for t in base new base new; do
      dir=$root; [ $t = base ] && dir=$root/.ab_base
      (cd "$dir" && PYTHONPATH=$dir timeout 90 python3 -c "import krait, sys; sys.stderr.write(
        'krait from ' + krait.__file__ + '\\n')" && PYTHONPATH=$dir timeout 90 python3 -m krait bench \
        latency --config $m --batch-sizes 1 --prompt-lens 512,2048 --max-num-seqs 1 --num-steps 5) \
        > "$LOG/host_${m}_$t.json" 2> "$LOG/host_${m}_$t.err"
      echo "== $m $t"; grep -E "^krait from" "$LOG/host_${m}_$t.err"
      grep -A2 "^prompt" "$LOG/host_${m}_$t.err"; pack
    done; done
    for t in base new; do  # a script's own folder, not the working directory, leads sys.path
      dir=$root; [ $t = base ] && dir=$root/.ab_base
      PYTHONPATH=$dir OUT=$LOG timeout 120 python3 scripts/profile_decode.py \
        granite-4.0-h-tiny:1:64 --prefill 2048 2>&1 | grep -E "^==|^ +[0-9.]+ us|unprofiled" \
        | tee "$LOG/host_profile_$t.log"
    done
    ;;
  piecewise)  # piecewise graphs for eager steps (on by default since session 10; ~6 min): their
    # tests, GPU parity with them off (the default runs take them), then prefill 128/512/2048
    # tokens and a batch-1 decode with and without them (all buckets captured at start-up)
    timeout 200 python3 -m pytest -q -m gpu tests/runner/test_piecewise_graphs.py -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$LOG/kernels_piecewise.log"
    if [ -d .parity ]; then
      KRAIT_PIECEWISE_GRAPHS=0 timeout 300 python3 scripts/gpu_parity.py check .parity 2>&1 \
        | grep -v Warn | tail -12 | tee "$LOG/parity_nopiecewise.log"
    fi
    for m in ${MODELS:-qwen3-0.6b granite-4.0-h-micro granite-4.0-h-tiny}; do
      KRAIT_PIECEWISE_GRAPHS=0 bench_latency $m "_eager" --batch-sizes 1 --prompt-lens 128,512,2048 \
        --max-num-seqs 1
      KRAIT_PREFILL_GRAPHS=0 bench_latency $m "_piecewise" --batch-sizes 1 --prompt-lens 128,512,2048 \
        --max-num-seqs 1
      # the memory profile's room for the pool against what the start-up captures took
      grep -h -E "memory:|captured piecewise" "$LOG/lat_${m}_piecewise.err"
    done
    ;;
  pwtp)  # offline throughput (krait only, 256 prompts x 256 in / 256 out) with piecewise graphs
    # off, up to 2048 tokens (the default) and up to 8192 (the default step budget: the
    # workload's prefill steps take them too); granite with the bf16 SSM state (~6 min)
    for m in granite-4.0-h-micro qwen3-0.6b; do
      extra=""; [ $m = granite-4.0-h-micro ] && extra="--mamba-ssm-cache-dtype bfloat16"
      for arm in off 2048 8192; do
        if [ $arm = off ]; then pw="KRAIT_PIECEWISE_GRAPHS=0"; else pw="KRAIT_PIECEWISE_MAX_TOKENS=$arm"; fi
        env $pw timeout 150 python3 -m krait bench throughput --config $m --num-prompts 256 \
          --input-len 256 --output-len 256 $extra > "$LOG/pwtp_${m}_$arm.json" 2> "$LOG/pwtp_${m}_$arm.err"
        echo "== $m piecewise $arm"; grep -E "^krait:|memory:|captured piecewise" "$LOG/pwtp_${m}_$arm.err"
        pack
      done
    done
    ;;
  prefill)  # the default (piecewise) prefill of the four benchmarked configs (~3 min)
    for m in qwen3-0.6b mamba2-1.3b granite-4.0-h-micro granite-4.0-h-tiny; do
      bench_latency $m "_prefill" --batch-sizes 1 --prompt-lens 128,512,2048
    done
    ;;
  others)  # the shipped configs without a target (first GPU run: session 8; ~4 min):
    # decode at batch 1 and 64 and one 2048-token prefill each (the MoE's fused kernel, the
    # 8-9B hybrids)
    for m in granite-4.0-h-tiny nemotron-h-8b llama-3.2-1b bamba-9b; do
      bench_latency $m "" --batch-sizes 1,64 --prompt-lens 2048 --num-steps 10
    done
    ;;
  gemvwide)  # batch 1 with every one-row projection up to 20M elements on the GEMV
    # (KRAIT_GEMV=wide: granite-micro's MLP down with its SiLU in the GEMV's prologue, one launch
    # instead of SiLU + split-K cuBLAS + reduce) against the default, alternating twice (~3 min)
    for i in 1 2; do
      for m in granite-4.0-h-micro mamba2-1.3b; do
        bench_latency $m "_default$i" --batch-sizes 1 --prompt-lens ""
        KRAIT_GEMV=wide bench_latency $m "_wide$i" --batch-sizes 1 --prompt-lens ""
      done
    done
    ;;
  mlp)  # session 11's one-row dispatch (~8 min): the gate_up GEMV with silu-and-mul in its
    # epilogue and Mamba's in_proj (N >= K, up to 20M) on the GEMV; its GPU tests, GPU parity
    # at the new defaults, then batch 1 against session 10's rule (KRAIT_GEMV=small) and with
    # granite's MLP down on the GEMV too (wide), alternating twice; qwen3 with one-tile splits
    timeout 200 python3 -m pytest -q -m gpu tests/ops/test_gemv.py -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$LOG/kernels_gemv.log"
    run_parity; pack
    for i in 1 2; do
      for m in granite-4.0-h-micro qwen3-0.6b; do
        KRAIT_GEMV=small bench_latency $m "_s10rule$i" --batch-sizes 1 --prompt-lens ""
        bench_latency $m "_default$i" --batch-sizes 1 --prompt-lens ""
        KRAIT_GEMV=wide bench_latency $m "_wide$i" --batch-sizes 1 --prompt-lens ""
      done
      KRAIT_GEMV=small bench_latency mamba2-1.3b "_s10rule$i" --batch-sizes 1 --prompt-lens ""
      bench_latency mamba2-1.3b "_default$i" --batch-sizes 1 --prompt-lens ""
    done
    KRAIT_DECODE_SPLIT_KEYS=64 bench_latency qwen3-0.6b "_splitkeys64" --batch-sizes 1 --prompt-lens ""
    ;;
  prefillgraphs)  # whole-forward graphs for one-prefill-row steps (on by default since
    # session 11; ~4 min): their GPU tests, then one-request prefill of qwen3 and mamba2 with
    # and without them (KRAIT_PREFILL_GRAPHS=0; piecewise graphs on in both arms, all captured
    # at start-up)
    timeout 110 python3 -m pytest -q -m gpu tests/runner/test_prefill_graphs.py -p no:cacheprovider 2>&1 \
      | tail -5 | tee "$LOG/kernels_prefill_graphs.log"
    pack
    for m in ${MODELS:-qwen3-0.6b mamba2-1.3b}; do
      bench_latency $m "_prefillgraphs" --batch-sizes 1 --prompt-lens 128,512,2048 \
        --num-steps 4
      grep -h -E "memory:|captured p" "$LOG/lat_${m}_prefillgraphs.err"
      KRAIT_PREFILL_GRAPHS=0 bench_latency $m "_piecewise" --batch-sizes 1 \
        --prompt-lens 128,512,2048 --num-steps 4
    done
    # graphs of 2 and 4 prefill rows: the engine starts with them (memory lines), and
    # 8 x 256 prompts' first steps (4 rows each) take them
    for m in ${MODELS:-qwen3-0.6b mamba2-1.3b}; do
      for rows in 1 4; do
        KRAIT_PREFILL_GRAPH_ROWS=$rows timeout 150 python3 -m krait bench throughput --config $m \
          --num-prompts 8 --input-len 256 --output-len 8 --max-num-seqs 4 \
          > "$LOG/pgrows_${m}_$rows.json" 2> "$LOG/pgrows_${m}_$rows.err"
        echo "== $m prefill graph rows $rows"; grep -E "^krait:|memory:|captured p" "$LOG/pgrows_${m}_$rows.err"
        pack
      done
    done
    ;;
  bigengine)  # a one-request 512-token prefill by engine size (session 12; ~3 min): a large
    # engine with no decode batches first, one after 256-row decode batches, a one-row engine;
    # prefill graphs on, then the second arm with them off
    for m in ${MODELS:-mamba2-1.3b}; do
      bench_latency $m "_big" --batch-sizes 1 --max-num-seqs 256 --prompt-lens 512 --num-steps 4
      bench_latency $m "_afterdecode" --batch-sizes 1,256 --prompt-lens 512 --num-steps 4
      bench_latency $m "_small" --batch-sizes 1 --prompt-lens 512 --num-steps 4
      KRAIT_PREFILL_GRAPHS=0 bench_latency $m "_afterdecode_piecewise" --batch-sizes 1,256 \
        --prompt-lens 512 --num-steps 4
    done
    ;;
  normhoist)  # norms and the conv in the GEMVs (session 12; ~8 min): the Mamba gated norm in
    # out_proj's prologue (default on since c956af2; KRAIT_MAMBA_NORM_PROLOGUE=0 the unfused
    # arm), the residual fold (KRAIT_NORM_PROLOGUE=1) and the decode conv in in_proj's epilogue
    # (KRAIT_CONV_EPILOGUE=1); GPU tests, one round of batch 1, GPU parity of the changed models
    # with both opt-ins on
    timeout 120 python3 -m pytest -q -m gpu tests/ops/test_gemv.py -k "norm_gated or fold or conv_epilogue" -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$LOG/kernels_normhoist.log"
    pack
    for m in mamba2-1.3b granite-4.0-h-micro; do
      KRAIT_MAMBA_NORM_PROLOGUE=0 bench_latency $m "_unfused" --batch-sizes 1 --prompt-lens ""
      bench_latency $m "_default" --batch-sizes 1 --prompt-lens ""
      KRAIT_CONV_EPILOGUE=1 bench_latency $m "_conv" --batch-sizes 1 --prompt-lens ""
    done
    for m in mamba2-1.3b granite-4.0-h-micro; do
      KRAIT_NORM_PROLOGUE=1 bench_latency $m "_fold" --batch-sizes 1 --prompt-lens ""
      KRAIT_NORM_PROLOGUE=1 KRAIT_CONV_EPILOGUE=1 bench_latency $m "_foldconv" \
        --batch-sizes 1 --prompt-lens ""
    done
    # the MoE route GEMVs with x born in the weight tile's layout (session 12, unmeasured):
    # against session 12 run 3's graph 2.772-2.780 ms at batch 1, session 9's 4.97 at batch 8
    bench_latency granite-4.0-h-tiny "_default" --batch-sizes 1,8 --prompt-lens ""
    bench_latency qwen3-0.6b "_default" --batch-sizes 1 --prompt-lens ""
    KRAIT_NORM_PROLOGUE=1 bench_latency qwen3-0.6b "_fold" --batch-sizes 1 --prompt-lens ""
    if [ -d .parity ]; then  # GPU parity with the opt-ins on, the models they change
      rm -rf /tmp/parity_fold && mkdir -p /tmp/parity_fold
      cp -r .parity/mamba2 .parity/mamba2-g1 .parity/qwen3 .parity/llama .parity/granitemoehybrid \
        .parity/granitemoehybrid-dense /tmp/parity_fold/
      KRAIT_NORM_PROLOGUE=1 KRAIT_CONV_EPILOGUE=1 timeout 150 python3 scripts/gpu_parity.py \
        check /tmp/parity_fold 2>&1 \
        | grep -v Warn | tail -14 | tee "$LOG/parity_normhoist.log"
    fi
    pack
    # per-kernel times of mamba2's batch-1 step with both opt-ins (where a loss would sit)
    KRAIT_NORM_PROLOGUE=1 KRAIT_CONV_EPILOGUE=1 PROFILE_PREFILL=0 PROFILE_TIMEOUT=60 \
      PROFILE_SPECS=mamba2-1.3b:1:1024 PROFILE_LOG=profile_foldconv bash "$0" profile
    pack
    ;;
  forms)  # session 13 (~4 min): what each GEMV prologue / epilogue costs alone
    # (bench_gemv.py --forms), then batch 1 at the defaults and with the fold (run 2 also
    # timed session 12's NORM form, 1 / rms summed after the loop, through a knob since removed)
    timeout 120 python3 -m pytest -q -m gpu tests/ops/test_gemv.py -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$LOG/kernels_forms.log"
    timeout 150 python3 scripts/bench_gemv.py --forms 2>&1 | grep -v Warn | tee "$LOG/gemv_forms.log"
    pack
    for m in mamba2-1.3b granite-4.0-h-micro qwen3-0.6b; do
      bench_latency $m "_default" --batch-sizes 1 --prompt-lens ""
      KRAIT_NORM_PROLOGUE=1 bench_latency $m "_fold" --batch-sizes 1 --prompt-lens ""
    done
    ;;
  targets)  # issue 4's decode targets (batch 1 and 64, context 1024) and granite-micro's
    # decode-heavy throughput against HF with the SSM state in bf16 as HF keeps it (~6 min)
    for m in mamba2-1.3b granite-4.0-h-micro qwen3-0.6b; do
      bench_latency $m "_targets" --batch-sizes 1,64 --prompt-lens ""
    done
    MODELS=granite-4.0-h-micro OUT_LENS=256 TP_EXTRA="--mamba-ssm-cache-dtype bfloat16" \
      TP_TIMEOUT=200 bash "$0" throughput
    ;;
  ablate)  # session 14 (~6 min): what each kernel class costs inside the batch-1 chain (its
    # launches removed: scripts/ablate_decode.py), and the state update's state read before
    # the PDL wait (KRAIT_SSU_PREFETCH) on and off; GPU tests of the state update first
    timeout 120 python3 -m pytest -q -m gpu tests/ops/test_selective_state_update.py \
      -p no:cacheprovider 2>&1 | tail -3 | tee "$LOG/kernels_ablate.log"
    ablate() {  # model, skip
      timeout 200 python3 scripts/ablate_decode.py --skip "$2" -- --config "$1" --batch-sizes 1 \
        --prompt-lens "" > "$LOG/lat_${1}_skip_$2.json" 2> "$LOG/lat_${1}_skip_$2.err"
      echo "== $1 skip $2"; grep -v Warn "$LOG/lat_${1}_skip_$2.err" | tail -3; pack
    }
    for s in none ${QWEN_SKIPS:-gemv attn rope norm}; do ablate qwen3-0.6b $s; done
    for s in none ${MAMBA_SKIPS:-gemv ssu norm}; do ablate mamba2-1.3b $s; done
    ablate granite-4.0-h-micro none
    for m in mamba2-1.3b granite-4.0-h-micro; do
      KRAIT_SSU_PREFETCH=0 bench_latency $m "_ssuprefetch0" --batch-sizes 1 --prompt-lens ""
    done
    ;;
  tma)  # session 14 (~6 min): the TMA GEMV (krait/ops/gemv_tma.py) for the big one-row
    # projections (granite and llama gate_up and down, qwen3 gate_up) at batch 1, against
    # KRAIT_GEMV_TMA=0 and without its L2 prefetch before the PDL wait; GPU tests first
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_gemv_tma.py tests/ops/test_gemv.py \
      tests/ops/test_selective_state_update.py -p no:cacheprovider 2>&1 | tail -3 \
      | tee "$LOG/kernels_tma.log"
    for m in granite-4.0-h-micro qwen3-0.6b llama-3.2-1b; do
      bench_latency $m "_tma" --batch-sizes 1 --prompt-lens ""
      KRAIT_GEMV_TMA=0 bench_latency $m "_tma0" --batch-sizes 1 --prompt-lens ""
      KRAIT_GEMV_TMA=noprefetch bench_latency $m "_tmanopf" --batch-sizes 1 --prompt-lens ""
    done
    bench_latency mamba2-1.3b "_ssu" --batch-sizes 1 --prompt-lens ""
    ;;
  session14)  # session 14's last call (~10 min): every GPU test, GPU parity, the TMA in_proj
    # with its conv at batch 1 against KRAIT_GEMV_TMA=noconv, then the targets
    KERNEL_TIMEOUT=300 run_kernels; run_parity; pack
    for m in mamba2-1.3b granite-4.0-h-micro; do
      KRAIT_GEMV_TMA=noconv bench_latency $m "_noconv" --batch-sizes 1 --prompt-lens ""
    done
    bash "$0" targets
    ;;
  session15)  # the GPU tests of the ops changed in session 15, then the batch-1 A/Bs and
    # timelines: rope/KV write with its operands before the wait, the TMA in_proj's conv
    # operands before the wait (KRAIT_CONV_EARLY)
    timeout 300 python3 -m pytest -q -m gpu tests/ops/test_rope_kv_write.py tests/ops/test_gemv_tma.py \
      tests/ops/test_causal_conv1d.py tests/ops/test_gemv.py tests/ops/test_paged_attention.py \
      tests/ops/test_timeline.py -p no:cacheprovider 2>&1 | tail -5 | tee "$LOG/kernels_s15.log"
    for m in ${MODELS:-qwen3-0.6b llama-3.2-1b}; do
      bench_latency $m "" --batch-sizes 1 --prompt-lens ""
    done
    for m in mamba2-1.3b granite-4.0-h-micro; do
      bench_latency $m "" --batch-sizes 1 --prompt-lens ""
      KRAIT_CONV_EARLY=1 bench_latency $m "_convearly" --batch-sizes 1 --prompt-lens ""
    done
    for m in qwen3-0.6b mamba2-1.3b; do
      KRAIT_CONV_EARLY=1 timeout 150 python3 scripts/timeline_decode.py --config $m --launches 16 \
        2>&1 | grep -v -E "Warn|INFO|deprecated" | tee "$LOG/timeline_$m.log"
      pack
    done
    ;;
  session16)  # (~6 min) the split-KV decode's defaults of session 16 against the old ones at
    # batch 1 and 8: 64 keys a split at least (KRAIT_DECODE_SPLIT_KEYS=256 was the default), 8
    # warps while its grid fits one program an SM (KRAIT_DECODE_SPLIT_WARPS=4 fixes the old 4);
    # mamba2 and granite-micro at batch 1 (the TMA in_proj's conv operands early, now the
    # default); rope + KV write folded into the split kernel (KRAIT_DECODE_ROPE_FOLD=1, new,
    # unmeasured): its GPU test and A/B. GPU parity: parity16
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_paged_attention_split.py \
      tests/ops/test_paged_attention.py tests/ops/test_gemv_tma.py tests/ops/test_rope_attention.py \
      -p no:cacheprovider 2>&1 | tail -5 | tee "$LOG/kernels_s16.log"
    pack
    for m in qwen3-0.6b llama-3.2-1b; do
      bench_latency $m "" --batch-sizes 1,8 --prompt-lens ""
      KRAIT_DECODE_ROPE_FOLD=1 bench_latency $m "_fold" --batch-sizes 1,8 --prompt-lens ""
      KRAIT_DECODE_SPLIT_WARPS=4 bench_latency $m "_w4" --batch-sizes 1,8 --prompt-lens ""
      KRAIT_DECODE_SPLIT_WARPS=4 KRAIT_DECODE_SPLIT_KEYS=256 bench_latency $m "_w4k256" \
        --batch-sizes 1,8 --prompt-lens ""
    done
    for m in mamba2-1.3b granite-4.0-h-micro; do
      bench_latency $m "" --batch-sizes 1 --prompt-lens ""
    done
    ;;
  inproj)  # (~5 min) the Mamba in_proj's TMA config in the batch-1 chain (its 532 programs of
    # 16 columns land unevenly: session 15's timeline): wider / narrower programs, deeper
    # rings, the L2 prefetch before the PDL wait (session 17: none faster; persistent grids
    # lost 14-54% and were removed)
    timeout 120 python3 -m pytest -q -m gpu tests/ops/test_gemv_tma.py -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$LOG/kernels_inproj.log"
    bench_latency mamba2-1.3b "" --batch-sizes 1 --prompt-lens ""
    KRAIT_GEMV_TMA=prefetch bench_latency mamba2-1.3b "_prefetch" --batch-sizes 1 --prompt-lens ""
    for c in ${INPROJ_CONFIGS:-32,128,4,4 8,256,4,4 64,128,4,8 16,256,4,4 16,128,6,4}; do
      KRAIT_INPROJ_TMA=$c bench_latency mamba2-1.3b "_$c" --batch-sizes 1 --prompt-lens ""
    done
    ;;
  against)  # (~2 min) ${MODEL:-qwen3-0.6b} at batch 1 and 8 with an older krait against this
    # tree, same machine: OLD_TAR made here with `git archive COMMIT krait > old_krait.tar`
    # (session 17 found the batch-8 split-KV regression this way)
    rm -rf /tmp/old && mkdir -p /tmp/old && tar xf "${OLD_TAR:-old_krait.tar}" -C /tmp/old
    (cd /tmp/old && PYTHONPATH=/tmp/old timeout 300 python3 -m krait bench latency \
      --config ${MODEL:-qwen3-0.6b} --batch-sizes ${BATCHES:-1,8} --prompt-lens "" \
      > "$LOG/lat_old_${MODEL:-qwen3-0.6b}.json" 2> "$LOG/lat_old_${MODEL:-qwen3-0.6b}.err")
    echo "== old ${MODEL:-qwen3-0.6b}"; grep -v Warn "$LOG/lat_old_${MODEL:-qwen3-0.6b}.err" | tail -4
    bench_latency ${MODEL:-qwen3-0.6b} "_new" --batch-sizes ${BATCHES:-1,8} --prompt-lens ""
    ;;
  session17)  # (~5 min) the split-KV kernel's q load order (after the newest key's reload in
    # 4-warp programs, before it at 8 warps: Q_FIRST) and the rope fold, on by default: GPU
    # tests, the attention alone (scripts/bench_decode_attention.py, fold on and off), qwen3
    # and llama at batch 1 and 8 (fold on and off); GPU parity: parity16
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_paged_attention_split.py \
      tests/ops/test_paged_attention.py tests/ops/test_rope_attention.py -p no:cacheprovider \
      2>&1 | tail -3 | tee "$LOG/kernels_s17.log"
    for f in 1 0; do
      KRAIT_DECODE_ROPE_FOLD=$f timeout 120 python3 scripts/bench_decode_attention.py \
        --json "$LOG/attn_fold$f.json" 2>&1 | grep -v Warn | tee "$LOG/attn_fold$f.log"
    done
    pack
    for m in qwen3-0.6b llama-3.2-1b; do
      bench_latency $m "" --batch-sizes 1,8 --prompt-lens ""
      KRAIT_DECODE_ROPE_FOLD=0 bench_latency $m "_nofold" --batch-sizes 1,8 --prompt-lens ""
    done
    ;;
  refresh)  # (~12 min, two device calls: `refresh` then `targets`) session 18's defaults: GPU tests
    # of the split-KV and rope kernels, the attention alone with caches past the L2 (fold on
    # and off), llama and qwen3 at batch 1 and 8, max_model_len 4096 vs 131072 (granite-micro)
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_paged_attention_split.py \
      tests/ops/test_rope_attention.py -p no:cacheprovider 2>&1 | tail -3 | tee "$LOG/kernels_refresh.log"
    for f in 1 0; do
      KRAIT_DECODE_ROPE_FOLD=$f timeout 150 python3 scripts/bench_decode_attention.py \
        --json "$LOG/attn_cold_fold$f.json" 2>&1 | grep -v Warn | tee "$LOG/attn_cold_fold$f.log"
    done
    pack
    for m in qwen3-0.6b llama-3.2-1b; do bench_latency $m "_refresh" --batch-sizes 1,8 --prompt-lens ""; done
    bash "$0" maxlen
    ;;
  session19)  # (~8 min) the block's RMSNorm inside the TMA GEMVs' loop (the residual fold,
    # KRAIT_NORM_PROLOGUE=1: no RMSNorm launch) and each TMA GEMV's first box loaded before
    # the PDL wait (KRAIT_TMA_EARLY_BOX=1), batch 1; their GPU tests first
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_gemv_tma.py -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$LOG/kernels_s19.log"
    for m in mamba2-1.3b granite-4.0-h-micro qwen3-0.6b; do
      bench_latency $m "_s19base" --batch-sizes 1 --prompt-lens ""
      KRAIT_NORM_PROLOGUE=1 bench_latency $m "_s19fold" --batch-sizes 1 --prompt-lens ""
      KRAIT_TMA_EARLY_BOX=1 bench_latency $m "_s19early" --batch-sizes 1 --prompt-lens ""
      KRAIT_NORM_PROLOGUE=1 KRAIT_TMA_EARLY_BOX=1 bench_latency $m "_s19both" --batch-sizes 1 \
        --prompt-lens ""
    done
    ;;
  session19b)  # (~6 min) mamba2's batch-1 chain per kernel with the fold (the RMSNorm inside
    # in_proj's TMA loop) and with the early first box, against the default; the early box on
    # llama and granite (batch 1 and 64) against the default, same machine
    for arm in base fold early; do
      case $arm in base) knobs="";; fold) knobs="KRAIT_NORM_PROLOGUE=1";;
        early) knobs="KRAIT_TMA_EARLY_BOX=1";; esac
      env $knobs timeout 150 python3 scripts/timeline_decode.py --config mamba2-1.3b \
        --json "$LOG/timeline_mamba2_$arm.json" 2>&1 | grep -v -E "Warn|INFO" \
        | tail -25 | tee "$LOG/timeline_mamba2_$arm.log"
      pack
    done
    for m in llama-3.2-1b granite-4.0-h-micro; do
      bench_latency $m "_s19base" --batch-sizes 1,64 --prompt-lens ""
      KRAIT_TMA_EARLY_BOX=1 bench_latency $m "_s19early" --batch-sizes 1,64 --prompt-lens ""
    done
    ;;
  session20)  # (~7 min) session 19's left-overs: the TMA GEMV's GPU tests (the early box at
    # every dispatch config, granite's split-K down among them: not yet run on the GPU) and the
    # engine memory test; the batch-1 baselines of the two Mamba models; then where the
    # throughput workload's time goes (granite-micro, bf16 state: a batch-256 decode step at
    # context 384 and one 8192-token prefill, per kernel)
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_gemv_tma.py \
      tests/runner/test_engine_memory.py -p no:cacheprovider 2>&1 | tail -3 \
      | tee "$LOG/kernels_s20.log"
    for m in mamba2-1.3b granite-4.0-h-micro; do
      bench_latency $m "_s20" --batch-sizes 1 --prompt-lens ""
    done
    PROFILE_SPECS="granite-4.0-h-micro:256:384" PROFILE_PREFILL=8192 PROFILE_LOG=profile_tp \
      PROFILE_EXTRA="--mamba-ssm-cache-dtype bfloat16" bash "$0" profile
    ;;
  session21)  # (~5 min) the state update's program shapes alone (scripts/bench_ssu.py), then
    # batch 1 and 64 of mamba2 and granite-micro with session 21's shapes against the old ones
    # (OLD_TAR: `git archive bb22bb4 krait > old_krait.tar` here, carried)
    timeout 200 python3 scripts/bench_ssu.py 2>&1 | grep -v Warn | tee "$LOG/ssu.log"; pack
    timeout 150 python3 -m pytest -q -m gpu tests/ops/test_selective_state_update.py \
      -p no:cacheprovider 2>&1 | tail -3 | tee "$LOG/kernels_s21.log"
    for m in mamba2-1.3b granite-4.0-h-micro; do
      MODEL=$m BATCHES=1,64 bash "$0" against
    done
    ;;
  parity16)  # (~7 min) GPU parity with every tiny model's decode rows split, the rope fold on
    # (the default) and off
    KRAIT_DECODE_SPLIT_KEYS=16 PARITY_TIMEOUT=280 run_parity; pack
    KRAIT_DECODE_ROPE_FOLD=0 KRAIT_DECODE_SPLIT_KEYS=16 PARITY_TIMEOUT=280 PARITY_TAG=_nofold run_parity
    pack
    ;;
  timeline)  # per-program timestamps of the batch-1 decode chain (~6 min): its GPU test, then
    # scripts/timeline_decode.py per model (KRAIT_TIMELINE, krait/ops/timeline.py), then the
    # GEMV's early PDL trigger for one-wave grids (KRAIT_PDL_TRIGGER=auto) against the default
    timeout 120 python3 -m pytest -q -m gpu tests/ops/test_timeline.py -p no:cacheprovider 2>&1 \
      | tail -3 | tee "$LOG/kernels_timeline.log"
    for m in ${MODELS:-qwen3-0.6b mamba2-1.3b granite-4.0-h-micro}; do
      timeout 150 python3 scripts/timeline_decode.py --config $m --json "$LOG/timeline_$m.json" \
        2>&1 | grep -v -E "Warn|INFO" | tee "$LOG/timeline_$m.log"
      pack
    done
    # one-wave GEMVs let the next kernel launch at their start (KRAIT_PDL_TRIGGER=auto, new)
    KRAIT_PDL_TRIGGER=auto timeout 150 python3 scripts/timeline_decode.py --config qwen3-0.6b \
      --json "$LOG/timeline_qwen3_auto.json" 2>&1 | grep -v -E "Warn|INFO" \
      | tee "$LOG/timeline_qwen3_auto.log"
    for m in qwen3-0.6b mamba2-1.3b granite-4.0-h-micro; do
      bench_latency $m "_late" --batch-sizes 1 --prompt-lens ""
      KRAIT_PDL_TRIGGER=auto bench_latency $m "_auto" --batch-sizes 1 --prompt-lens ""
    done
    ;;
  gemmforms)  # cuBLAS formulations of the decode-batch projections (batch 64-256; ~2 min)
    timeout 200 python3 scripts/bench_gemm_forms.py 2>&1 | grep -v Warn | tee "$LOG/gemm_forms.log"
    ;;
  gemv)  # the decode GEMV against cuBLAS per shape, with a config sweep
    timeout 300 python3 scripts/bench_gemv.py 2>&1 | tee "$LOG/gemv.log"; pack
    ;;
  record)  # what docs/benchmarks.md records, most important first (logs pack after each part);
    # ~6 minutes. Throughput (3 models x 2 workloads, each time-boxed) takes its own call.
    run_parity; pack
    bash "$0" bench; bash "$0" maxlen
    PROFILE_SPECS="qwen3-0.6b:1:1024" bash "$0" profile
    ;;
  all)  # everything issue 4 asks for (~15 min; over the device tool's 10 minutes a call, where
    # it takes two: `kernels`, then `targets` and `maxlen`)
    run_kernels
    run_parity
    bash "$0" targets
    bash "$0" maxlen
    ;;
esac
# the A/B rows of this call in one table (the call's output keeps only its tail)
case $what in ablate|tma|session14|session15|timeline|gemvwide|mlp|prefillgraphs|bigengine|normhoist|forms|targets|ab|attn|attn1|late|newdef|fp8|fp8b|blockn|ropeattn|stats|prefetch|fuse|knobs1|bench|maxlen|others) python3 scripts/summarize_bench.py "$LOG" ;; esac
# the device call brings back few files: pack the logs into one
pack
