"""The pre-norm residual block every decoder family here shares:
h = x + attn(norm(x)); y = h + mlp(norm(h)), with the residual sum carried into the next
norm so it is formed once (RMSNorm's fused residual form)."""

from __future__ import annotations

from torch import nn


class PreNormDecoderLayer(nn.Module):
    """Subclasses set input_layernorm, self_attn, post_attention_layernorm and mlp."""

    def forward(self, x, residual, positions, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
