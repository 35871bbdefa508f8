#!/usr/bin/env python3
"""PyTorch eager baseline for `horizon bench` (issue: speed on the CPU backend). Not run by CI.

Trains the same shape as bench/llama-58m.yaml: a randomly initialised Llama (hidden 512, 8
layers, 8 heads, 8 kv heads, FFN 1408, vocab 32000, untied head: 58.5M parameters) on random
tokens, 4 x 256 tokens per step, fp32, torch.optim.AdamW(lr 1e-4, weight decay 0.01) with
torch.nn.utils.clip_grad_norm_(1.0) -- the full step, optimizer included. Attention is
F.scaled_dot_product_attention (what Hugging Face's LlamaForCausalLM uses by default).

    python bench/torch_baseline.py [--steps 3] [--warmup 1] [--threads N] [--json]

Prints tokens/s over the timed steps (after warm-up); --json prints one JSON object instead.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, c, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Layer(nn.Module):
    def __init__(self, c, h, kvh, f, eps):
        super().__init__()
        self.h, self.kvh, self.d = h, kvh, c // h
        self.input_layernorm = RMSNorm(c, eps)
        self.q_proj = nn.Linear(c, h * self.d, bias=False)
        self.k_proj = nn.Linear(c, kvh * self.d, bias=False)
        self.v_proj = nn.Linear(c, kvh * self.d, bias=False)
        self.o_proj = nn.Linear(h * self.d, c, bias=False)
        self.post_attention_layernorm = RMSNorm(c, eps)
        self.gate_proj = nn.Linear(c, f, bias=False)
        self.up_proj = nn.Linear(c, f, bias=False)
        self.down_proj = nn.Linear(f, c, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.kvh, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.h != self.kvh
        )
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.d))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    def __init__(self, c, layers, h, kvh, f, v, t, eps=1e-6, theta=10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(v, c)
        self.layers = nn.ModuleList(Layer(c, h, kvh, f, eps) for _ in range(layers))
        self.norm = RMSNorm(c, eps)
        self.lm_head = nn.Linear(c, v, bias=False)
        d = c // h
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, targets):
        t = ids.shape[1]
        x = self.embed_tokens(ids)
        cos, sin = self.cos[:t], self.sin[:t]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    c, layers, h, kvh, f, v, b, t = 512, 8, 8, 8, 1408, 32000, 4, 256
    model = Llama(c, layers, h, kvh, f, v, t)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, v, (b, t + 1), generator=g) for _ in range(4)]

    def step(k):
        row = batches[k % len(batches)]
        loss = model(row[:, :-1], row[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.item(), norm.item()

    for k in range(a.warmup):
        step(k)
    t0 = time.perf_counter()
    losses = [step(a.warmup + k)[0] for k in range(a.steps)]
    wall = time.perf_counter() - t0
    tokens = a.steps * b * t
    # Model FLOPs: 6 * N * tokens for the matrices (embedding excluded: a gather), plus the
    # causal attention products, forward 2 * 2 * T^2/2 * C per sequence and layer, backward 2x.
    n_matmul = params - v * c - (2 * layers + 1) * c
    attn = 3 * layers * b * 2 * t * (t + 1) * c
    flops = 6 * n_matmul * tokens + attn * a.steps
    out = {
        "torch": torch.__version__,
        "threads": a.threads,
        "params": params,
        "steps": a.steps,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "model_gflops_per_s": flops / wall / 1e9,
        "final_loss": losses[-1],
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(f"torch {out['torch']}, {a.threads} threads, {params/1e6:.1f}M parameters: "
              f"{out['tokens_per_s']:.1f} tokens/s, {out['model_gflops_per_s']:.1f} model GFLOP/s "
              f"(loss {losses[-1]:.4f}, ln V = {math.log(v):.4f})")


if __name__ == "__main__":
    main()
