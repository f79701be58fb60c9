"""Reference models for examples and tests.

Llama: a Llama-style decoder (RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention, untied head) with Hugging Face's parameter names, so a Llama checkpoint in
safetensors loads by name (zinf.load_safetensors with name_map=lambda n: "model." + n for
everything but lm_head, see examples/finetune.py). Plain torch; deterministic on the CPU.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotary position embeddings; cos/sin are non-persistent buffers (not in checkpoints)."""

    def __init__(self, head_dim, max_seq, base=10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(max_seq).float(), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):  # x: B, H, T, D
        t = x.shape[-2]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos[:t].to(x.dtype) + rotated * self.sin[:t].to(x.dtype)


def causal_attention(q, k, v):
    t = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class LlamaAttention(nn.Module):
    """Grouped-query attention: n_kv_heads key/value heads shared by n_heads query heads."""

    def __init__(self, dim, n_heads, n_kv_heads, max_seq, rope_theta=10000.0):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(n_heads * self.hd, dim, bias=False)
        self.rotary = Rotary(self.hd, max_seq, rope_theta)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden, max_seq, rope_theta=10000.0, eps=1e-6):
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = LlamaAttention(dim, n_heads, n_kv_heads, max_seq, rope_theta)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaHead(nn.Module):
    """Llama's final norm, head and loss: the last stage of Llama.stack()."""

    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, x, targets):
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class Llama(nn.Module):
    """RMSNorm, rotary embeddings, SwiGLU, grouped-query attention (HF names); the head untied
    unless tie_embeddings (then lm_head.weight is embed_tokens.weight, one parameter).
    rope_theta and eps are Hugging Face's config.json rope_theta and rms_norm_eps."""

    def __init__(self, vocab=64, dim=32, layers=2, n_heads=4, n_kv_heads=2, hidden=64,
                 max_seq=32, rope_theta=10000.0, eps=1e-6, tie_embeddings=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [LlamaBlock(dim, n_heads, n_kv_heads, hidden, max_seq, rope_theta, eps)
             for _ in range(layers)])
        self.norm = RMSNorm(dim, eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def stack(self):
        """The model as a stack for zinf.schedule "layer-major" (ZinfEngine.train_window):
        (embed, blocks, head) with embed(ids) -> hidden, the blocks in order, and
        head(hidden, targets) -> the loss forward(ids, targets) gives. A tied head (one weight
        with two uses per micro-batch) is refused: train it on the micro-batch schedule."""
        if self.lm_head.weight is self.embed_tokens.weight:
            raise ValueError("Llama.stack(): the head is tied to the embedding (one parameter "
                             "used at both ends of the stack); zinf's layer-major schedule "
                             "needs each parameter in one stage: use the micro-batch schedule")

        return self.embed_tokens, list(self.layers), LlamaHead(self.norm, self.lm_head)

    def forward(self, ids, targets=None):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
