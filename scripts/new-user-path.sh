#!/usr/bin/env bash
# The new-user path of issue 46, end to end on this machine, printing what a user sees:
# a model by Hub id from a Hugging Face cache laid out as huggingface_hub lays one out (a fake
# one, no network), chat SFT with LoRA, the export merged, its file list beside what
# transformers' save_pretrained writes, `horizon generate --chat` on it, the TensorBoard events,
# and `horizon plan` of a CUDA config of a real model's shape on this (CPU-only) build.
#
#   scripts/new-user-path.sh [HORIZON_BINARY]     (default: target/release/horizon)
# With PYTHON pointing at a Python that has the `tensorboard` package, the events are read by
# TensorBoard's own reader (scripts/check-tensorboard.py).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=$(realpath "${1:-target/release/horizon}")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
say() { printf '\n$ %s\n' "$*"; }

# The "downloaded" model: a small random Qwen2 with the transformers-5 tokenizer fixture, saved
# as an HF directory by a 1-step run, then laid out as huggingface_hub's cache does.
cp -r "$ROOT/tests/fixtures/tokenizers/qwen2-transformers5" tok
printf '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' > seed.jsonl
cat > seed.yaml <<EOF
model: { init: random, arch: qwen2, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
         num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 512 }
data: { path: seed.jsonl, format: chat, tokenizer: tok }
train: { steps: 1, batch_size: 1, max_seq_len: 64 }
output: { dir: seed-out, tensorboard: false }
EOF
"$BIN" train --config seed.yaml > /dev/null
COMMIT=0123456789abcdef0123456789abcdef01234567
REPO=hub/models--acme--tiny-chat
mkdir -p "$REPO/blobs" "$REPO/snapshots/$COMMIT" "$REPO/refs"
for f in seed-out/final/*; do
    blob=$(sha256sum "$f" | cut -c1-64)
    cp "$f" "$REPO/blobs/$blob"
    ln -s "../../blobs/$blob" "$REPO/snapshots/$COMMIT/$(basename "$f")"
done
printf '%s' "$COMMIT" > "$REPO/refs/main"
export HF_HUB_CACHE=$WORK/hub
say "find \$HF_HUB_CACHE -maxdepth 4 | sort"
(cd hub && find . -maxdepth 4 | sort | sed 's|^\./||' | grep -v '^\.$' | head -20)

# Chat SFT with LoRA on the model by its Hub id.
python3 - <<'EOF'
import json, random
random.seed(0)
with open("chat.jsonl", "w") as f:
    for i in range(64):
        a, b = random.randint(0, 9), random.randint(0, 9)
        f.write(json.dumps({"messages": [
            {"role": "user", "content": f"{a}+{b}?"},
            {"role": "assistant", "content": str(a + b)}]}) + "\n")
EOF
cat > sft.yaml <<EOF
model: { path: acme/tiny-chat }
data: { path: chat.jsonl, format: chat, shuffle: true }
adapter: { type: lora, r: 8, alpha: 16 }
train: { epochs: 40, batch_size: 8, max_seq_len: 64 }
optimizer: { lr: 5.0e-3 }
output: { dir: sft-out }
EOF
say "cat sft.yaml"; cat sft.yaml
say "horizon train --config sft.yaml   (last lines)"
"$BIN" train --config sft.yaml 2>&1 | grep -v "^\s*$" | tail -6

say "horizon export sft-out --merge --out merged"
"$BIN" export sft-out --merge --out merged 2>&1 | tail -3
say "ls merged/   (transformers 5.25 save_pretrained of a causal LM + tokenizer writes:"
echo "   chat_template.jinja config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json)"
ls merged | tr '\n' ' '; echo
say "ls sft-out/final/   (PEFT save_pretrained: adapter_config.json adapter_model.safetensors, + tokenizer)"
ls sft-out/final | tr '\n' ' '; echo
say "grep -E 'base_model_name_or_path|revision' sft-out/final/adapter_config.json"
grep -E '"base_model_name_or_path"|"revision"' sft-out/final/adapter_config.json

say "horizon generate --model merged --chat --prompt '3+4?' --max-new-tokens 4"
"$BIN" generate --model merged --chat --prompt '3+4?' --max-new-tokens 4 --temperature 0 2>&1 | cat -A | tail -4

say "TensorBoard events in sft-out/tb/"
ls sft-out/tb
if [[ -n "${PYTHON:-}" ]]; then
    "$PYTHON" "$ROOT/scripts/check-tensorboard.py" sft-out/tb |
        sed -E 's/steps \[([0-9]+), [^]]*, ([0-9]+)\]/steps \1..\2/' | tail -12
fi

# A CUDA config of a real model's shape, planned on this build (no GPU, maybe no cuda feature).
REAL=hub/models--Qwen--Qwen3-32B
mkdir -p "$REAL/snapshots/$COMMIT" "$REAL/refs" "$REAL/blobs"
cp "$ROOT/tests/fixtures/real-shapes/Qwen--Qwen3-32B/config.json" "$REAL/blobs/cfg"
ln -s ../../blobs/cfg "$REAL/snapshots/$COMMIT/config.json"
printf '%s' "$COMMIT" > "$REAL/refs/main"
say "horizon plan --config configs/qwen3-32b-qlora.yaml --host-memory 64GiB   (device.backend: cuda)"
"$BIN" plan --config "$ROOT/configs/qwen3-32b-qlora.yaml" --host-memory 64GiB 2>&1 | head -24
