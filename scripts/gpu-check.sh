#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine, in one go (issue 5): parity tests, then
# `horizon bench` on a Qwen2.5-7B-shaped random model (~16K tokens per step) and on a model
# deeper than the first; prints tokens/s, model TFLOP/s, MFU against 989 dense bf16 TFLOP/s
# (H100/H200 SXM), H2D and D2H GB/s, the compute stream's idle fraction and peak device memory
# against the plan. Each benchmark is set beside its projection (`horizon plan --hardware`) on
# HW_PROFILE and, where PyTorch sees the GPU, on a profile of this machine made from its measured
# ceilings (bench/gpu_ceilings.py, adamw_speed, bench/lent_profile.py: OUT/lent.yaml).
#
# Usage:
#   scripts/gpu-check.sh                    # with cargo: build (release, --features cuda), test, bench
#   scripts/gpu-check.sh --bundle DIR       # with cargo, no GPU needed: put the binary, the test
#                                           # executables and this script in DIR, for a GPU
#                                           # machine without Rust
#   DIR/gpu-check.sh                        # on the GPU machine: runs what DIR holds
# Environment: HORIZON_BIN (the horizon binary), TEST_BIN_DIR (test executables cuda_*),
# BENCHES (the benchmarks to run, of "qwen7b-shape deep moe"; default all), LAYERS_MOE (the
# mixture of experts' depth, default 12 of 48), LAYERS_7B (the 7B
# shape's depth; default as many of its 28 layers as host RAM holds), TEST_TIMEOUT (seconds for
# each test executable, default 600), OP_SPEED_RUN (0 skips examples/cuda_op_speed, the
# per-op times of a 7B layer), BENCH_TIMEOUT (seconds for each benchmark run, default
# 3600), LENT_PROFILE (a profile of this machine measured before, OUT/lent.yaml of an earlier
# run: skips measuring it again), BENCH_STEPS (default 3, after one warm-up step), OUT
# (default out/gpu-check), GRAD_WIRE
# (engine.grad_wire of the benchmarks: fp32, the default, or bf16), OPT_MEMORY
# (optimizer.memory of the benchmarks: lean, the default, or exact), WEIGHT_UPLOAD
# (engine.weight_upload of the benchmarks: auto, the default, image, round or staged),
# DEVICE_MEMORY (device.memory of the benchmarks: auto, the default, which recomputes every
# layer's internals; a size such as 120GiB lets engine.recompute: auto keep as many layers'
# internals as it holds, as the projection does with the profile's GPU memory), TRACE (1: run
# each benchmark once more with `bench --trace` and set its ops beside the projection's,
# `bench/compare_trace.py`; the traces, OUT/NAME.run.json and OUT/NAME.plan.json, open in
# Perfetto).
# The GPU holds bf16 weights (half the bytes of fp32 slots) and runs bf16 products with fp32
# accumulation; the parity tests compare against the CPU with the tolerances of ARCHITECTURE.md.
# Libraries: the NVIDIA driver (libcuda), NVRTC 13 and cuBLAS 13 must be loadable; pip wheels
# (nvidia-cuda-nvrtc, nvidia-cublas) in the current Python are found and put on LD_LIBRARY_PATH.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
OUT="${OUT:-$PWD/out/gpu-check}"
STEPS="${BENCH_STEPS:-3}"
GRAD_WIRE="${GRAD_WIRE:-fp32}"
PEAK_TFLOPS=989

if [[ "${1:-}" == "--bundle" ]]; then
    DIR="${2:?--bundle needs a directory}"
    mkdir -p "$DIR/tests"
    cd "$ROOT"
    cargo build --release --locked --features cuda
    cp target/release/horizon "$DIR/"
    strip "$DIR/horizon" 2>/dev/null || true
    cargo test --release --locked --features cuda --no-run --message-format=json \
        -p horizon-backend -p horizon 2>/dev/null \
        | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in t.get("kind", []) and t["name"].startswith("cuda_"):
        print(m["executable"])' \
        | while read -r exe; do cp "$exe" "$DIR/tests/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
    # Without debug information the binaries are a tenth of the size (about 30 MB in all), so a
    # bundle travels where transfers are limited.
    strip "$DIR"/tests/* 2>/dev/null || true
    # The host rates of a profile of the machine (below).
    cargo build --release --locked --example adamw_speed
    cargo build --release --locked --features cuda -p horizon-backend --example cuda_op_speed
    cp target/release/examples/adamw_speed target/release/examples/cuda_op_speed "$DIR/"
    strip "$DIR/adamw_speed" "$DIR/cuda_op_speed" 2>/dev/null || true
    cp "$0" "$DIR/gpu-check.sh"
    cp bench/compare_trace.py bench/gpu_ceilings.py bench/lent_profile.py "$DIR/"
    # The engine tests find their fixtures at the build machine's path (CARGO_MANIFEST_DIR):
    # ship them, and the path, so the run can link them there. A bundle inside the checkout
    # finds them in the checkout (below) and does not copy them.
    case "$(cd "$DIR" && pwd)/" in
        "$ROOT"/*) ;;
        *) [[ -d tests/fixtures ]] && cp -r tests/fixtures "$DIR/" ;;
    esac
    echo "$ROOT" > "$DIR/manifest_dir"
    echo "bundle in $DIR: $(ls "$DIR" "$DIR/tests" | tr '\n' ' ')"
    exit 0
fi

# ---- libraries -----------------------------------------------------------------------------
for d in $(python3 -c 'import site,glob; [print(p) for s in site.getsitepackages()+[site.getusersitepackages()] for p in glob.glob(s+"/nvidia/*/lib")]' 2>/dev/null); do
    LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
for lib in libcuda.so.1 libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13; do
    if ! ldconfig -p 2>/dev/null | grep -q "$lib" && ! ls ${LD_LIBRARY_PATH//:/\/$lib } 2>/dev/null | grep -q .; then
        echo "warning: $lib not found (ldconfig, LD_LIBRARY_PATH); the CUDA backend will say what is missing" >&2
    fi
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available" >&2
echo "host: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), $(awk '/MemTotal|MemAvailable/ {printf "%s %.1f GiB  ", $1, $2 / 1048576}' /proc/meminfo)"

# ---- binaries ------------------------------------------------------------------------------
if [[ -z "${HORIZON_BIN:-}" && -x "$HERE/horizon" ]]; then HORIZON_BIN="$HERE/horizon"; fi
if [[ -z "${TEST_BIN_DIR:-}" && -d "$HERE/tests" ]]; then TEST_BIN_DIR="$HERE/tests"; fi
if [[ -z "${HORIZON_BIN:-}" ]]; then
    command -v cargo >/dev/null || { echo "no cargo and no HORIZON_BIN: use --bundle on a machine with Rust" >&2; exit 1; }
    echo "== build (release, --features cuda)"
    (cd "$ROOT" && cargo build --release --locked --features cuda)
    (cd "$ROOT" && cargo build --release --locked --features cuda -p horizon-backend --example cuda_op_speed)
    HORIZON_BIN="$ROOT/target/release/horizon"
fi

echo "== parity tests"
fixtures="$HERE/fixtures"
[[ -d "$fixtures" ]] || fixtures="$ROOT/tests/fixtures"  # a bundle inside a checkout
if [[ -f "$HERE/manifest_dir" && -d "$fixtures" ]]; then
    m="$(cat "$HERE/manifest_dir")"
    if [[ ! -e "$m/tests/fixtures" ]]; then
        mkdir -p "$m/tests" && ln -s "$fixtures" "$m/tests/fixtures" \
            || echo "warning: cannot link the fixtures at $m/tests/fixtures; cuda_engine will fail" >&2
    fi
fi
if [[ -n "${TEST_BIN_DIR:-}" ]]; then
    fail=0
    for t in "$TEST_BIN_DIR"/cuda_*; do
        echo "-- $(basename "$t")"
        (cd "$ROOT" && timeout "${TEST_TIMEOUT:-600}" "$t" --test-threads=1) || fail=1
    done
    # A failed parity test fails the check, but the benchmarks still run: their figures are
    # worth having from a lent GPU either way.
    [[ $fail == 0 ]] || echo "parity tests FAILED" >&2
else
    (cd "$ROOT" && cargo test --release --locked --features cuda -p horizon-backend --test 'cuda_*' -- --test-threads=1)
    (cd "$ROOT" && cargo test --release --locked --features cuda --test 'cuda_*' -- --test-threads=1)
fi

# ---- benchmarks ----------------------------------------------------------------------------
mkdir -p "$OUT"

# Every op of a Qwen2.5-7B layer at 4 x 4096 tokens, every attention kernel set side by side
# (examples/cuda_op_speed): what a step's Forward and Backward are made of.
OP_SPEED="$HERE/cuda_op_speed"
[[ -x "$OP_SPEED" ]] || OP_SPEED="$ROOT/target/release/examples/cuda_op_speed"
if [[ -x "$OP_SPEED" && "${OP_SPEED_RUN:-1}" == 1 ]]; then
    echo "== ops of a layer (cuda_op_speed)"
    timeout "${BENCH_TIMEOUT:-3600}" "$OP_SPEED" 2>&1 | tee "$OUT/op_speed.txt" || echo "cuda_op_speed FAILED"
fi
status=${fail:-0}
BENCHES=${BENCHES:-qwen7b-shape deep moe}
wanted() { [[ " $BENCHES " == *" $1 "* ]]; }
avail_kb=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
gpu_bytes=$( (nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null || true) | head -1 | awk '{print $1 * 1048576}')
gpu_bytes=${gpu_bytes:-150000000000}

# Host bytes per parameter: fp32 master + gradient + two moments.
layers_that_fit() { # hidden inter vocab heads kvh -> layers whose host state fits in 85% of MemAvailable
    python3 - "$@" "$avail_kb" <<'PY'
import sys
c, f, v, h, kvh, avail_kb = map(int, sys.argv[1:])
d = c // h
layer = c * (h + 2 * kvh) * d + (h + 2 * kvh) * d + h * d * c + 3 * c * f + 2 * c
fixed = 2 * v * c + c
budget = 0.85 * avail_kb * 1024 / 16 - 4 * v * c  # minus staging slabs (~4 slots of the head)
print(max(1, min(28 * 8, int((budget - fixed) / layer))))
PY
}

# engine.weight_upload of the benchmarks: auto | image | round | staged.
WEIGHT_UPLOAD=${WEIGHT_UPLOAD:-auto}
# device.memory of the benchmarks (see the usage above).
DEVICE_MEMORY=${DEVICE_MEMORY:-auto}
# With device.memory: auto the run recomputes; say so in the config, so that its projection
# (planned on the profile's GPU memory, where auto would keep internals) plans the same run.
if [[ "$DEVICE_MEMORY" == auto ]]; then RECOMPUTE=always; else RECOMPUTE=auto; fi

# optimizer.memory of the benchmarks: lean (the default, as docs/projection.md's H200 projections) or exact.
OPT_MEMORY=${OPT_MEMORY:-lean}

# The profile the projection of each benchmark is made for (`horizon plan --hardware`).
HW_PROFILE=${HW_PROFILE:-h200-pcie5}

# bench/*.py: beside this script in a bundle, else in the checkout.
script() { if [[ -f "$HERE/$1" ]]; then echo "$HERE/$1"; else echo "$ROOT/bench/$1"; fi; }
COMPARE=$(script compare_trace.py)

# ---- the machine's own profile ---------------------------------------------------------------
# Its ceilings, measured here (the link each way and cuBLAS products through PyTorch, the host's
# per-core rates and memory bandwidth through adamw_speed, Horizon's attention kernels through
# cuda_op_speed above), as a hardware profile: each
# benchmark is projected on it as well as on HW_PROFILE, so that the run is set beside a
# projection of the machine it ran on.
# LENT_PROFILE=FILE uses a profile measured before (OUT/lent.yaml of an earlier run) instead.
LENT="${LENT_PROFILE:-}"
ADAMW_SPEED="$HERE/adamw_speed"
[[ -x "$ADAMW_SPEED" ]] || ADAMW_SPEED="$ROOT/target/release/examples/adamw_speed"
if [[ -n "$LENT" ]]; then
    echo "== this machine's profile: $LENT (LENT_PROFILE)"
elif [[ -x "$ADAMW_SPEED" ]] && python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "== this machine's ceilings (gpu_ceilings.py, adamw_speed)"
    mem_gib=$(awk '/MemTotal/ {printf "%.1f", $2 / 1048576}' /proc/meminfo)
    if python3 "$(script gpu_ceilings.py)" --json "$OUT/ceilings.json" \
        && "$ADAMW_SPEED" 16 5 --json > "$OUT/host_rates.json" \
        && python3 "$(script lent_profile.py)" "$OUT/ceilings.json" "$OUT/host_rates.json" \
            "$(nproc)" "$mem_gib" $( [[ -s "$OUT/op_speed.txt" ]] && echo "$OUT/op_speed.txt") \
            > "$OUT/lent.yaml"; then
        LENT="$OUT/lent.yaml"
        sed 's/^/  /' "$LENT"
    else
        echo "  (no profile of this machine: a measurement failed)"
    fi
fi

project() { # config profile trace -> the projection's step, busy and bound lines
    echo "  projection (horizon plan --hardware $2):"
    "$HORIZON_BIN" plan --config "$1" --hardware "$2" --trace "$3" 2>&1 \
        | grep -E "projected step|busy per step|bound|^  (forward|head|backward|step boundary) " \
        | sed 's/^/  /' || true
}

bench() { # name hidden inter layers heads kvh vocab batch mbs seq ckpt
    local name=$1 c=$2 f=$3 l=$4 h=$5 kvh=$6 v=$7 b=$8 mbs=$9 t=${10} k=${11}
    local cfg="$OUT/$name.yaml"
    cat > "$cfg" <<YAML
model: {init: random, arch: qwen2, hidden_size: $c, intermediate_size: $f, num_hidden_layers: $l,
        num_attention_heads: $h, num_key_value_heads: $kvh, vocab_size: $v, rope_theta: 1000000.0,
        max_position_embeddings: 32768, tie_word_embeddings: false}
data: {format: synthetic}
train: {steps: $((STEPS + 1)), batch_size: $b, micro_batch_size: $mbs, max_seq_len: $t}
optimizer: {memory: $OPT_MEMORY}
engine: {checkpoint_every: $k, grad_slabs: 4, head_chunk_rows: 2048, grad_wire: $GRAD_WIRE,
         weight_upload: $WEIGHT_UPLOAD, recompute: $RECOMPUTE}
device: {backend: cuda, memory: $DEVICE_MEMORY}
output: {dir: $OUT/$name}
YAML
    echo "== bench $name: $l layers, hidden $c, ffn $f, heads $h/$kvh, vocab $v, $b x $t tokens/step, grad_wire $GRAD_WIRE"
    if ! timeout "${BENCH_TIMEOUT:-3600}" "$HORIZON_BIN" bench --config "$cfg" --warmup 1 \
        > "$OUT/$name.log" 2>&1; then
        tail -n 30 "$OUT/$name.log"
        echo "bench $name FAILED (log: $OUT/$name.log)" >&2
        status=1
        return 0
    fi
    grep -E "^(step|model:|  total|device|host)" "$OUT/$name.log" | tail -n 12
    python3 - "$OUT/$name/summary.json" "$c" "$f" "$l" "$h" "$kvh" "$v" "$t" "$PEAK_TFLOPS" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
c, f, l, h, kvh, v, t, peak = map(float, sys.argv[2:])
d = c / h
layer = c * (h + 2 * kvh) * d + (h + 2 * kvh) * d + h * d * c + 3 * c * f + 2 * c
n = l * layer + v * c + c  # non-embedding parameters (the LM head counts)
flops_tok = 6 * n + 6 * l * t * h * d  # fwd + bwd matmuls; causal attention (half of 12 L T H D)
tps = s["tokens_per_s"]
tflops = flops_tok * tps / 1e12
wall = max(s["wall_s"], 1e-9)
link = max(s["link_busy_s"], 1e-9)
print(f"  tokens/s            {tps:,.0f}")
print(f"  model TFLOP/s       {tflops:,.1f}   MFU {100 * tflops / peak:.1f}% of {peak:.0f}")
print(f"  H2D                 {s['h2d_bytes'] / wall / 1e9:.1f} GB/s over the run, {s['h2d_bytes'] / link / 1e9:.1f} GB/s while busy")
print(f"  D2H                 {s['d2h_bytes'] / wall / 1e9:.1f} GB/s over the run")
print(f"  compute idle        {100 * max(0.0, 1 - s['device_compute_s'] / wall):.1f}% of wall time")
print(f"  peak device memory  {s['peak_device_bytes'] / 2**30:.2f} GiB (plan {s['planned_device_bytes'] / 2**30:.2f} GiB)")
print(f"  overlap ratio       {s['overlap_ratio']:.2f}   final loss {s['final_loss']:.4f}")
print(f"  weights uploaded    from {s['weight_upload']}; pinned {s['pinned_bytes'] / 2**30:.2f} GiB "
      f"(plan {s['planned_pinned_bytes'] / 2**30:.2f} GiB); host threads {s['host_threads']}")
n = max(s["steps"], 1)
print(f"  measured per step   {wall / n:.3f} s; busy: compute {s['device_compute_s'] / n:.3f} s, "
      f"h2d {s['h2d_busy_s'] / n:.3f} s, d2h {s['d2h_busy_s'] / n:.3f} s, host {s['host_busy_s'] / n:.3f} s")
PY
    # The projection of the same config on the machine this is meant to be (issue 17), and on
    # this machine's own profile: set their step and busy times beside the measured ones above.
    local plan="$OUT/$name.plan.json"
    project "$cfg" "$HW_PROFILE" "$OUT/$name.plan.json"
    if [[ -n "$LENT" ]]; then
        plan="$OUT/$name.lent.json"
        project "$cfg" "$LENT" "$plan"
    fi
    if [[ "${TRACE:-0}" == 1 ]]; then
        echo "  traced run against the projection on $(basename "$plan" .json), op by op:"
        # Its own output directory: the untraced run's summary.json stays as it was.
        if timeout "${BENCH_TIMEOUT:-3600}" "$HORIZON_BIN" bench --config "$cfg" --warmup 1 \
            --trace "$OUT/$name.run.json" --set "output.dir=$OUT/$name-traced" \
            > "$OUT/$name.traced.log" 2>&1; then
            python3 "$COMPARE" "$OUT/$name.run.json" "$plan" 1 | sed 's/^/  /' || true
        else
            echo "  traced bench $name FAILED (log: $OUT/$name.traced.log)"
        fi
    fi
}

# Qwen2.5-7B per layer: hidden 3584, FFN 18944, 28 heads / 4 kv heads, vocab 152064; 28 layers
# where host RAM holds fp32 masters, gradients and moments (16 bytes per parameter), fewer
# otherwise (every layer is the same, so the per-layer figures stand). 4 x 4096 tokens a step in
# one micro-batch, as bench/h200/qwen2.5-7b-16k.yaml (docs/projection.md's H200 projection).
if wanted qwen7b-shape; then
    L7=${LAYERS_7B:-$(layers_that_fit 3584 18944 152064 28 4)}
    L7=$(( L7 < 28 ? L7 : 28 ))
    [[ $L7 -lt 28 ]] && echo "note: benchmarking $L7 of Qwen2.5-7B's 28 layers (host RAM, or LAYERS_7B)"
    bench qwen7b-shape 3584 18944 "$L7" 28 4 152064 4 4 4096 4
fi

# Deeper: weights several times GPU memory if host RAM allows; else the same width at twice
# the depth of a smaller model, to show peak device memory does not grow with depth.
if wanted deep; then
    LD=$(layers_that_fit 2048 8192 32000 16 4)
    need=$(python3 -c "print(int(3 * $gpu_bytes / (4 * (2048*2048*2 + 2*2048*512 + 3*2048*8192))) + 1)")
    if (( LD >= need )); then
        bench deep 2048 8192 "$need" 16 4 32000 8 4 2048 4
    else
        echo "note: host RAM holds $LD layers of the deep model; weights 3x GPU memory need $need: comparing depth $((LD / 2)) and $LD instead"
        bench deep-half 2048 8192 $((LD / 2)) 16 4 32000 8 4 2048 4
        bench deep 2048 8192 "$LD" 16 4 32000 8 4 2048 4
    fi
fi
# A mixture of experts (issue 44): QLoRA on a random Qwen3-30B-A3B shape (LAYERS_MOE of its 48
# layers, default 12; 128 experts of 768, top 8; attention and experts NF4, r 8 on attention),
# 4 x 2048 tokens a step, with whole layers and with the experts in chunks of 16: tokens/s, the
# step, peak device memory against the plan.
if wanted moe; then
    for chunk in null 16; do
        name="moe-chunk-$chunk"
        cfg="$OUT/$name.yaml"
        cat > "$cfg" <<YAML
model: {init: random, arch: qwen3_moe, hidden_size: 2048, intermediate_size: 6144,
        moe_intermediate_size: 768, num_experts: 128, num_experts_per_tok: 8, norm_topk_prob: true,
        num_hidden_layers: ${LAYERS_MOE:-12}, num_attention_heads: 32, num_key_value_heads: 4,
        head_dim: 128, vocab_size: 151936, tie_word_embeddings: false, output_router_logits: true}
data: {format: synthetic}
train: {steps: $((STEPS + 1)), batch_size: 4, max_seq_len: 2048}
adapter: {type: qlora, r: 8, alpha: 16, targets: [q_proj, k_proj, v_proj, o_proj]}
engine: {checkpoint_every: 4, head_chunk_rows: 2048, expert_chunk: $chunk}
device: {backend: cuda}
output: {dir: $OUT/$name}
YAML
        echo "== bench $name: ${LAYERS_MOE:-12} Qwen3-30B-A3B layers, QLoRA, 4 x 2048 tokens, expert_chunk $chunk"
        if timeout "${BENCH_TIMEOUT:-3600}" "$HORIZON_BIN" bench --config "$cfg" --warmup 1 > "$OUT/$name.log" 2>&1; then
            grep -E "^(bench:|  per step|  overlap)" "$OUT/$name.log" | tail -n 4
        else
            tail -n 20 "$OUT/$name.log"; echo "bench $name FAILED" >&2; status=1
        fi
    done
fi
echo "== done: summaries and logs under $OUT"
exit "$status"
