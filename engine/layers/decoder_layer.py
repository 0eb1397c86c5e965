"""The pre-norm residual block every decoder family here shares:
h = x + attn(norm(x)); y = h + mlp(norm(h)), with the residual sum carried into the next
norm so it is formed once (RMSNorm's fused residual form)."""

from __future__ import annotations

from torch import nn


class PreNormDecoderLayer(nn.Module):
    """Subclasses set input_layernorm, self_attn, post_attention_layernorm and mlp."""

    def forward(self, x, residual, positions, ctx):
        x, residual = self.attend(x, residual, positions, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def attend(self, x, residual, positions, ctx):
        """(attn(norm(x + residual)), x + residual); a family may form both in fewer
        launches on some backend."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn(x, positions, ctx), residual
