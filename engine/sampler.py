"""Vectorized sampling: every row of a batch with its own parameters (vLLM semantics).

Order per row: allowed tokens, min_tokens (blocks EOS / stop tokens), logit_bias,
repetition / frequency / presence penalties, then greedy argmax, or temperature,
min_p, top_k, top_p and a draw (``argmax(p / Exp(1))``, from the row's own
generator when seeded). Logprobs are those of the raw model distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.engine.sequence import Sequence

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    """One step's picks."""

    token_ids: list[int]
    logprobs: list[float] | None  # raw logprob of each picked token (None: nobody asked)
    ranks: list[int] | None
    top_ids: list[list[int]] | None  # per row, top-N token ids (N = that row's logprobs)
    top_logprobs: list[list[float]] | None


class Sampler:
    """Picks one token per row from ``logits`` [B, V] fp32."""

    def __init__(self, vocab_size: int, eos_token_ids: set[int], generator: torch.Generator) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.generator = generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        logits = logits[:, : self.vocab_size]
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        # best_of > n ranks completions by cumulative logprob, asked for or not
        need_raw = any(want_logprobs) or any(s.params.best_of > s.params.n for s in seqs)
        raw = torch.log_softmax(logits, dim=-1) if need_raw else None
        logits = self._process(logits, seqs)
        tokens = self._pick(logits, seqs)
        return self._logprobs(raw, tokens, seqs, want_logprobs)

    # --- logits processing -------------------------------------------------------
    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        cloned = False

        def writable() -> torch.Tensor:
            nonlocal logits, cloned
            if not cloned:
                logits = logits.clone()
                cloned = True
            return logits

        for row, s in enumerate(seqs):
            p = s.params
            if p.allowed_token_ids is not None:
                lg = writable()
                keep = torch.full((self.vocab_size,), _NEG_INF, device=lg.device)
                keep[p.allowed_token_ids] = 0.0
                lg[row] += keep
            if s.num_output_tokens < p.min_tokens:
                # vLLM (and transformers' min_new_tokens): EOS too, whatever ignore_eos says
                blocked = list(p.stop_token_ids) + list(self.eos_token_ids)
                if blocked:
                    writable()[row, blocked] = _NEG_INF
            if p.logit_bias:
                lg = writable()
                ids = list(p.logit_bias.keys())
                lg[row, ids] += torch.tensor(list(p.logit_bias.values()), device=lg.device)
        rows = [
            i
            for i, s in enumerate(seqs)
            if s.params.repetition_penalty != 1.0
            or s.params.presence_penalty != 0.0
            or s.params.frequency_penalty != 0.0
        ]
        if rows:
            lg = writable()
            lg[rows] = self._penalize(lg[rows], [seqs[i] for i in rows])
        return logits

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        n, v = logits.shape
        dev = logits.device
        counts = torch.zeros(n, v, device=dev)
        seen = torch.zeros(n, v, dtype=torch.bool, device=dev)
        for r, s in enumerate(seqs):
            out = s.output_token_ids
            if out:
                counts[r].index_add_(
                    0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev)
                )
            seen[r, s.token_ids] = True  # prompt + output, for repetition_penalty
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev).unsqueeze(1)
        pen = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, pen, logits)
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev).unsqueeze(1)
        pres = torch.tensor([s.params.presence_penalty for s in seqs], device=dev).unsqueeze(1)
        return logits - freq * counts - pres * (counts > 0).float()

    # --- picking -----------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if not sampled:
            return tokens
        sub = logits[sampled]
        params = [seqs[i].params for i in sampled]
        dev = sub.device
        temp = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        probs = torch.softmax(sub / temp, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
        if (min_p > 0).any():
            threshold = probs.max(dim=-1, keepdim=True).values * min_p
            probs = probs.masked_fill(probs < threshold, 0.0)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(tp < 1.0 for tp in top_p):
            probs = _top_k_top_p(probs, top_k, top_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        # Noise is drawn on each generator's own device (CPU generators on a CUDA engine).
        noise = torch.empty_like(probs)
        v = probs.shape[1]
        unseeded = [r for r, i in enumerate(sampled) if seqs[i].generator is None]
        if unseeded:
            g = self.generator
            noise[unseeded] = torch.empty(len(unseeded), v, device=g.device).exponential_(
                generator=g
            ).to(dev)
        for r, i in enumerate(sampled):
            g = seqs[i].generator
            if g is not None:
                noise[r] = torch.empty(v, device=g.device).exponential_(generator=g).to(dev)
        picked = (probs / noise).argmax(dim=-1)
        tokens[sampled] = picked
        return tokens

    # --- logprobs ----------------------------------------------------------------
    def _logprobs(
        self,
        raw: torch.Tensor | None,
        tokens: torch.Tensor,
        seqs: list[Sequence],
        want: list[bool],
    ) -> SamplerOutput:
        token_list = tokens.tolist()
        if raw is None:
            return SamplerOutput(token_list, None, None, None, None)
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
        ranks = (raw > chosen.unsqueeze(1)).sum(dim=1) + 1
        max_n = max((s.params.logprobs or 0) for s in seqs)
        top_ids: list[list[int]] = [[] for _ in seqs]
        top_lps: list[list[float]] = [[] for _ in seqs]
        if max_n > 0:
            vals, ids = raw.topk(max_n, dim=-1)
            vals_l, ids_l = vals.tolist(), ids.tolist()
            for r, s in enumerate(seqs):
                n = s.params.logprobs or 0
                top_ids[r], top_lps[r] = ids_l[r][:n], vals_l[r][:n]
        return SamplerOutput(token_list, chosen.tolist(), ranks.tolist(), top_ids, top_lps)


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and then its top-p nucleus."""
    v = probs.shape[1]
    dev = probs.device
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    k = torch.tensor([kk if kk > 0 else v for kk in top_k], device=dev).unsqueeze(1)
    ranks = torch.arange(v, device=dev).unsqueeze(0)
    sorted_p = sorted_p.masked_fill(ranks >= k, 0.0)
    p = torch.tensor(top_p, device=dev).unsqueeze(1)
    renorm = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    before = renorm.cumsum(dim=-1) - renorm  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= p, 0.0)  # the top token always stays
    return torch.zeros_like(probs).scatter_(1, idx, sorted_p)
