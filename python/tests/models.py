"""The models the Python tests train: written here, deterministic on the CPU (no dropout)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from zinf.models import Llama, causal_attention  # noqa: F401 (the tests import Llama from here)


class Gpt2Block(nn.Module):
    """GPT-2's block, with the attention's key projection unbiased (as in Whisper): a key bias
    adds the same value to every score of a query, which softmax ignores, so its gradient is
    exactly zero in exact arithmetic and rounding noise in practice; Adam normalises that
    noise into full-size steps, so two correct implementations that differ by an ulp anywhere
    drift apart on it, and a comparison with torch would measure only that noise."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln_1(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
                   for z in (q, k, v))
        x = x + self.c_proj(causal_attention(q, k, v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Gpt2(nn.Module):
    """GPT-2 style: learned positions, LayerNorm, GELU MLP, head tied to the token embedding
    (read by the parent module, not by a module call)."""

    def __init__(self, vocab=64, dim=32, layers=2, n_heads=4, max_seq=32):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.h = nn.ModuleList([Gpt2Block(dim, n_heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, ids, targets=None):
        t = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(t, device=ids.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class Quirky(nn.Module):
    """A frozen embedding, a block called twice per forward, and an auxiliary head used only
    when asked (its parameters get no gradient in the other steps)."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.embed.weight.requires_grad_(False)
        self.shared = nn.Linear(dim, dim)
        self.aux = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, targets, use_aux=False):
        x = self.embed(ids)
        x = torch.tanh(self.shared(x))
        x = torch.tanh(self.shared(x)) + x
        if use_aux:
            x = x + self.aux(x)
        return F.cross_entropy(self.head(x).view(-1, self.head.out_features), targets.view(-1))


def batch(step, micro=0, b=4, t=16, vocab=64):
    """A learnable batch: targets are a fixed function of the inputs."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    return ids, (ids * 7 + 3) % vocab
