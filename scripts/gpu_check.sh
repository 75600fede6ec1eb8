#!/usr/bin/env bash
# One device call: what the project measures on the GPU as it is now. Logs: $OUT/logs.tgz.
# Usage (device machine, repo root):
#   bash scripts/gpu_check.sh [kernels|parity|targets|maxlen|throughput|spec|prefix|gdn]
# parity needs the oracle: here, PYTHONPATH=. .venv/bin/python scripts/gpu_parity.py make .parity,
# and carry=[".parity"] in the device call (PARITY_MODES= and PARITY_FIXTURES= narrow the check:
# scripts/gpu_parity.py). docs/benchmarks.md records the results.
set -uo pipefail
OUT=${OUT:-/tmp/krait_gpu}
LOG=/tmp/krait_logs  # packed into $OUT/logs.tgz (a device call returns few files)
mkdir -p "$OUT" "$LOG"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KRAIT_TEST_GPU=1
what=${1:-}
case $what in kernels|parity|targets|maxlen|throughput|spec|prefix|gdn) ;; *) sed -n 3,4p "$0"; exit 2 ;; esac
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" .; }  # after each part: a timed-out call keeps its logs
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOG/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$LOG/gpu.txt"

bench_latency() {  # name, tag, extra args: decode steps at batch 1 and 64, context 1024
  local name=$1 tag=$2; shift 2
  timeout ${LAT_TIMEOUT:-600} python3 -m krait bench latency --config "$name" --batch-sizes 1,64 --prompt-lens "" \
    "$@" > "$LOG/lat_${name}${tag}.json" 2> "$LOG/lat_${name}${tag}.err"
  echo "== $name $tag"; grep -v Warn "$LOG/lat_${name}${tag}.err" | tail -12
  pack
}
TARGETS=${TARGETS:-mamba2-1.3b granite-4.0-h-micro qwen3-0.6b}

case $what in
  kernels)  # the GPU tests: kernels at real sizes, graphs, the runner on CUDA
    timeout ${KERNEL_TIMEOUT:-900} python3 -m pytest -q --maxfail=5 -m gpu tests/ops tests/runner \
      tests/test_bench.py -p no:cacheprovider 2>&1 | tail -60 | tee "$LOG/kernels.log"
    ;;
  parity)  # HF parity on the GPU in float32: graphs, chunked prefill, eager, batch 1, spec
    [ -d .parity ] || { echo "no .parity carried: run gpu_parity.py make .parity here first"; exit 1; }
    timeout ${PARITY_TIMEOUT:-600} python3 scripts/gpu_parity.py check .parity 2>&1 | grep -v Warn \
      > "$LOG/parity_full.log"  # the full log keeps the first traceback
    tail -40 "$LOG/parity_full.log" | tee "$LOG/parity.log"
    ;;
  targets)  # the decode targets: batch 1 and 64 for the three target models
    for m in $TARGETS; do bench_latency $m ""; done
    ;;
  maxlen)  # decode cost must not follow max_model_len
    for L in 4096 131072; do bench_latency granite-4.0-h-micro "_L$L" --max-model-len $L; done
    ;;
  throughput)  # offline throughput against HF transformers' generate in the same process:
    # 256 prompts x 256 in / OUT_LENS out (HF timed on HF_OUT new tokens); TP_EXTRA adds engine
    # flags (--mamba-ssm-cache-dtype bfloat16: the SSM state in the model dtype, as HF keeps
    # it). HF's Mamba2 without mamba_ssm kernels is slow: it goes last, each run time-boxed
    for m in ${MODELS:-qwen3-0.6b granite-4.0-h-micro mamba2-1.3b}; do for out in ${OUT_LENS:-64 256}; do
      timeout ${TP_TIMEOUT:-150} python3 -m krait bench throughput --config $m --num-prompts 256 \
        --input-len 256 --output-len $out --hf-output-len ${HF_OUT:-64} --hf-baseline \
        --hf-max-prompts 32 ${TP_EXTRA:-} > "$LOG/tp_${m}_o$out.json" 2> "$LOG/tp_${m}_o$out.err"
      echo "== $m output $out"; grep -v Warn "$LOG/tp_${m}_o$out.err" | tail -4; pack
    done; done
    ;;
  spec)  # speculative decoding: the verify kernels at real sizes, then ngram drafts (k = 3)
    timeout 300 python3 -m pytest -q -m gpu tests/ops/test_selective_state_verify.py \
      tests/ops/test_causal_conv1d_verify.py tests/ops/test_paged_attention_split.py \
      tests/models/test_spec_draft_chained.py tests/ops/test_spec_commit.py \
      tests/ops/test_greedy_accept.py -p no:cacheprovider 2>&1 | tail -15 \
      | tee "$LOG/kernels_spec.log"
    # the Mamba2 verify kernels at mamba2-1.3b's sizes: state tiles and warps, the gated norm
    timeout 150 python3 scripts/bench_ssm_verify.py > "$LOG/ssm_verify.jsonl" 2>&1
    echo "== mamba2 verify kernels (us a call)"; grep -v Warn "$LOG/ssm_verify.jsonl"; pack
    for m in ${SPEC_MODELS:-$TARGETS}; do
      bench_latency $m "_spec" --workload repetitive \
        --speculative-config '{"method":"ngram","num_speculative_tokens":3}'
    done
    # a same-seed 2-layer draft (3 drafts a row every step, accepted or not: granite-micro's
    # acceptance 0.00 on the H100, session 35): where ngram finds nothing on
    # random weights (granite-micro), this is what runs the verify graph on real rows
    for m in ${SAME_SEED_DRAFT_MODELS:-granite-4.0-h-micro}; do
      d=/tmp/krait_same_seed_draft_$m
      python3 scripts/draft_config.py "$m" "$d" 2
      bench_latency $m "_same_seed_draft" --speculative-config "{\"model\":\"$d\",\"num_speculative_tokens\":3}"
    done
    # a foreign random draft model (the target's config cut to 2 layers at half the width,
    # its lm_head untied: drafts always rejected, see scripts/draft_config.py), beside the
    # draft's own decode step (its cost) and the plain target
    for m in ${DRAFT_MODELS:-mamba2-1.3b qwen3-0.6b}; do
      d=/tmp/krait_draft_$m
      python3 scripts/draft_config.py "$m" "$d" 2 --foreign
      bench_latency $m "_draft" --speculative-config "{\"model\":\"$d\",\"num_speculative_tokens\":3}"
      bench_latency $m ""
      timeout 300 python3 -m krait bench latency --model "$d" --load-format dummy --batch-sizes 1,64 \
        --prompt-lens "" > "$LOG/lat_draftonly_$m.json" 2> "$LOG/lat_draftonly_$m.err"
      echo "== draft of $m alone"; grep -v Warn "$LOG/lat_draftonly_$m.err" | tail -4; pack
    done
    # an EAGLE-1 head at the target's widths (random weights: drafts rejected; what the head,
    # its runner and the verify graphs cost)
    for m in ${EAGLE_MODELS:-qwen3-0.6b}; do
      d=/tmp/krait_eagle_$m
      python3 scripts/draft_config.py "$m" "$d" --eagle
      bench_latency $m "_eagle" --speculative-config "{\"method\":\"eagle\",\"model\":\"$d\",\"num_speculative_tokens\":3}"
    done
    ;;
  prefix)  # prefix caching on hybrids: 64 requests sharing a 4096-token prefix + 64 distinct,
    # 32 out; TTFT cold vs warm, throughput with caching on / off, distinct prompts' cost
    for m in ${MODELS:-granite-4.0-h-micro nemotron-h-8b}; do
      timeout ${PREFIX_TIMEOUT:-400} python3 -m krait bench prefix --config $m ${PREFIX_EXTRA:-} \
        > "$LOG/prefix_$m.json" 2> "$LOG/prefix_$m.err"
      echo "== $m prefix"; grep -v Warn "$LOG/prefix_$m.err" | tail -4; pack
    done
    ;;
  gdn)  # Qwen3-Next's Gated DeltaNet: its kernels at Qwen3-Next-80B's sizes against the torch
    # references; its MoE's few-route kernels; the 8-layer config's decode at batch 1 and 64
    # (roofline ratio), an 8k prefill and MTP drafting; the prefill kernel beside fla's
    # chunk_gated_delta_rule at 8k tokens when wheels/ (fla-core, einops: carry=["wheels"]) is
    # there. Fits one 600 s call: each part time-boxed
    timeout ${GDN_TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/ops/test_gated_delta_rule.py \
      tests/ops/test_gated_delta_update_norm.py \
      -p no:cacheprovider 2>&1 | tail -15 | tee "$LOG/kernels_gdn.log"
    timeout 90 python3 scripts/bench_moe_routes.py --quick > "$LOG/moe_routes.jsonl" 2>&1
    echo "== moe few-route kernels (us a call)"; grep best "$LOG/moe_routes.jsonl"
    pack
    LAT_TIMEOUT=${LAT_TIMEOUT:-300} bench_latency qwen3-next-80b-a3b-8l "" --prompt-lens 8192
    # its MTP head drafting (random weights: drafts rejected; the head's and the graphs' cost)
    LAT_TIMEOUT=${LAT_TIMEOUT:-300} bench_latency qwen3-next-80b-a3b-8l "_mtp" \
      --speculative-config '{"method":"mtp","num_speculative_tokens":3}'
    if [ -d wheels ]; then  # installed beside, not into, the environment: only this run sees fla
      python3 -m pip install -q --no-deps --no-index --target /tmp/krait_wheels wheels/*.whl \
        2>&1 | tail -3
      # no pip there: pure-Python wheels unpack as they are
      python3 -c "import sys; sys.path.insert(0, '/tmp/krait_wheels'); import fla" 2>/dev/null \
        || for w in wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/krait_wheels; done
    else
      echo "no wheels/ carried: the fla comparison runs krait alone"
    fi
    PYTHONPATH=/tmp/krait_wheels:$PYTHONPATH timeout ${FLA_TIMEOUT:-110} python3 \
      scripts/bench_gdn_prefill.py --tokens 8192 --breakdown > "$LOG/gdn_prefill.json" 2> "$LOG/gdn_prefill.err"
    echo "== gdn prefill 8192 (krait vs fla)"; cat "$LOG/gdn_prefill.json"
    grep -v Warn "$LOG/gdn_prefill.err" | tail -5
    pack
    ;;
esac
# the latency rows of this call in one table (the call's output keeps only its tail)
ls "$LOG"/lat_*.json >/dev/null 2>&1 && python3 scripts/summarize_bench.py "$LOG"
pack
