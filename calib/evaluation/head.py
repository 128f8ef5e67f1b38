"""Next-token log-probabilities from final hidden states, a chunk of positions at a time.

Why: a [seq, vocab] logits tensor of a whole batch of long samples does not fit in memory on large
vocabularies; applying the LM head a chunk of positions at a time keeps it bounded. Checked once against
the model's own forward; models whose head does more than a linear layer fall back to full logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Head:
    """The model's LM head applied to final hidden states (softcap, Cohere's and Granite's logit scaling)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        self.lm, self.full = lm, False
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.multiply = getattr(cfg, "logit_scale", None)       # Cohere
        self.divide = getattr(cfg, "logits_scaling", None)       # Granite
        self.rows = max(1, 2 ** 24 // int(cfg.vocab_size))

    def features(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.full:
            return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return self.lm.base_model(input_ids=ids, attention_mask=mask, use_cache=False)[0]

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        z = h.float() if self.full else self.lm.get_output_embeddings()(h).float()
        if not self.full:
            z = z * self.multiply if self.multiply else z
            z = z / self.divide if self.divide else z
            z = torch.tanh(z / self.softcap) * self.softcap if self.softcap else z
        return torch.log_softmax(z, dim=-1)

    def verify(self, ids: Sequence[int]) -> str | None:
        """Compare with the model's own logits once; fall back to full logits on a mismatch."""
        x = torch.tensor([list(ids[:32])], device=next(self.lm.parameters()).device)
        want = torch.log_softmax(self.lm(input_ids=x, use_cache=False).logits.float(), dim=-1)
        if torch.allclose(self.log_probs(self.features(x, None)), want, rtol=1e-3, atol=1e-3):
            return None
        self.full = True
        return "the model's head does more than a linear layer here: logits are computed in full per batch"
