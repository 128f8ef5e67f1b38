"""Next-token losses from final hidden states, a chunk of positions at a time, the chunk sized for the device.

Why: a [positions, vocab] logits tensor of a whole batch of long samples does not fit in memory on large
vocabularies; applying the LM head a chunk of positions at a time keeps the losses' memory O(chunk x vocab).
The chunk was once a CPU-sized constant (2^24 / vocab positions: 64 on a 262K vocabulary, ~500 head launches
per 32K-token sample per arm on a GPU with tens of GiB free); on CUDA it now comes from the free device
memory at the time of the call, on CPU from a fixed budget. Checked once against the model's own forward;
models whose head does more than a linear layer fall back to full logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CPU_LOGITS = 2 ** 24          # logits per chunk on CPU (64 MiB float32 each)
BYTES_PER_LOGIT = 32          # working set per logit of both arms' losses: logits, log-probs, exp, products
DEVICE_SHARE = 0.5            # of the free device memory (the caching allocator's idle blocks counted free)
MAX_ROWS = 16384              # beyond this a bigger chunk no longer saves launches worth having


def free_bytes(device: torch.device) -> int | None:
    """Bytes the losses may use on `device` now: CUDA's free memory plus what torch's caching allocator holds
    idle; None off CUDA (the CPU budget applies)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def chunk_rows(vocab: int, free: int | None) -> int:
    """Positions per chunk: `DEVICE_SHARE` of `free` bytes at `BYTES_PER_LOGIT` per logit, or the CPU budget
    (`free` None); at least 1, at most `MAX_ROWS`."""
    rows = CPU_LOGITS // vocab if free is None else int(DEVICE_SHARE * free) // (BYTES_PER_LOGIT * vocab)
    return max(1, min(MAX_ROWS, rows))


class Head:
    """The model's LM head applied to final hidden states (softcap, Cohere's and Granite's logit scaling).
    `rows`: positions per chunk; None sizes it per call from the device (`chunk_rows`)."""

    def __init__(self, lm: torch.nn.Module, rows: int | None = None) -> None:
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        self.lm, self.full = lm, False
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.multiply = getattr(cfg, "logit_scale", None)       # Cohere
        self.divide = getattr(cfg, "logits_scaling", None)       # Granite
        self.vocab = int(cfg.vocab_size)
        self.rows = rows

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

    def chunk(self, device: torch.device) -> int:
        return self.rows or chunk_rows(self.vocab, free_bytes(device))

    @torch.no_grad()
    def losses(self, h_ref: torch.Tensor, h_arm: torch.Tensor | None, tgt: torch.Tensor) -> list[torch.Tensor]:
        """Per position ([positions, hidden] features, [positions] targets), a chunk at a time. Reference
        only: [nll, top1]; with an arm: [kl(ref || arm), top-1 agrees, nll, arm top1]."""
        rows = self.chunk(h_ref.device)
        parts = []
        for a in range(0, tgt.numel(), rows):
            sl = slice(a, a + rows)
            lr = self.log_probs(h_ref[sl])
            if h_arm is None:
                parts.append((-lr.gather(-1, tgt[sl, None])[:, 0], lr.argmax(-1)))
                continue
            la = self.log_probs(h_arm[sl])
            top = la.argmax(-1)
            ref_top = lr.argmax(-1)
            nll = -la.gather(-1, tgt[sl, None])[:, 0]
            kl = torch.sub(lr, la, out=la).mul_(lr.exp_()).sum(-1).clamp_min(0)   # in place: two chunks live
            parts.append((kl, top == ref_top, nll, top))
        if not parts:
            empty = torch.zeros(0, device=h_ref.device)
            return [empty, empty.long()] if h_arm is None else [empty, empty.bool(), empty, empty.long()]
        return [torch.cat(p) for p in zip(*parts)]

    def verify(self, ids: Sequence[int]) -> str | None:
        """Compare with the model's own logits once; fall back to full logits on a mismatch."""
        x = torch.tensor([list(ids[:32])], device=next(self.lm.parameters()).device)
        want = torch.log_softmax(self.lm(input_ids=x, use_cache=False).logits.float(), dim=-1)
        if torch.allclose(self.log_probs(self.features(x, None)), want, rtol=1e-3, atol=1e-3):
            return None
        self.full = True
        return "the model's head does more than a linear layer here: logits are computed in full per batch"
