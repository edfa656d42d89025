"""The Kunlun GEM model: OneSeq tiers, Kunlun layers with CompSkip, MoWE, multi-task heads.

    X⁰ = FeatureEmbeddings(inputs)                           [B, N_ns, d]
    S_t = OneSeqEncoder_t(inputs)                            [ΣL_t, d_t] + offsets, per tier t
    layer l (CompSkip on: even l = global path, odd l = local path; off: both):
        X_sum = Gate(LCE(X))                                 [B, n_sum, d]
        global: S_t = PFFN_t(S_t, X_sum);  H_t = HSP_t(S_t)  (cached)
        local:  S_t = S_t + BlockAttn_t(S_t)                 (H_t = the cached summary)
        S_sum_t = Gate(Proj([H_t ‖ last_K(S_t)]))            [B, n_out_t + K_t, d]
        X = LN(X + MoWE([X ‖ S_sum_all]))
    logits = Heads(flatten(LN([X ‖ Gate(LCE(X)) ‖ S_sum_all])), surface)
           + WideHeads(flatten(LN(X⁰)) [‖ triu(T·Tᵀ)], surface)      (wide_heads; off: the first term)
    T = [X⁰ ‖ Σ-pooled events per type / √d]: DLRM's dot interaction      (wide_dots; off by default)

Within a global layer the personalised FFN runs before HSP, so the summary the interaction
reads is already conditioned on the candidate (X_sum holds the candidate ad's tokens); with the
opposite order a two-layer model would never give the interaction a candidate-aware summary.
The wide heads read the embeddings as they are, so a per-id effect (an ad's own conversion rate)
needs no path through the trunk: without them GEM learned no post-click conversion from 128k
impressions (docs/quality.md). See docs/architecture.md for this and the other choices.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from gem.modules.attention import BlockAttentionLayer
from gem.modules.common import (JaggedModule, SelfGate, TokenLinear, add_flops, linear_flops, pairwise_dots,
                               pairwise_dots_flops)
from gem.modules.config import KunlunConfig, TierConfig
from gem.modules.dot_interaction import DotInteraction
from gem.modules.embeddings import FeatureEmbeddings
from gem.modules.generative import HistoryGenerativeLoss
from gem.modules.heads import MultiTaskHeads, multitask_loss
from gem.modules.hsp import HierarchicalSeedPooling
from gem.modules.inputs import GemInputs
from gem.modules.mowe import MixtureOfWukongExperts
from gem.modules.oneseq import OneSeqEncoder, TierBatch
from gem.modules.pffn import PersonalizedFFN, TokenFFN
from gem.ops import jagged_last_k
from gem.ops.activations import check_activations


class WeightGen(nn.Module):
    """X_sum = Gate(LCE(X)): N_ns tokens compressed to n_sum along the token axis, self-gated."""

    def __init__(self, num_in: int, num_out: int, dim: int):
        super().__init__()
        self.lce = TokenLinear(num_in, num_out)
        self.gate = SelfGate(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lce(x))

    def flops(self, batch: int, dim: int) -> float:
        return self.lce.flops(batch, dim) + self.gate.flops(batch * self.lce.weight.shape[1])


class SummaryGate(nn.Module):
    """S_sum_t = Gate(Proj([H_t ‖ last_K(S_t)])): the tier's summary tokens at the model width."""

    def __init__(self, tier: TierConfig, dim: int):
        super().__init__()
        self.tier = tier
        self.proj = nn.Linear(tier.dim, dim)
        self.gate = SelfGate(dim)

    def forward(self, summary: torch.Tensor, tb: TierBatch, kernel) -> torch.Tensor:
        recent, valid = jagged_last_k(tb.values, tb.offsets, self.tier.num_recent, kernel=kernel)  # [B, K, d_t]
        tokens = self.proj(torch.cat([summary.to(recent.dtype), recent], dim=1))  # [B, n_out + K, d]
        mask = torch.cat([valid.new_ones(valid.shape[0], summary.shape[1]), valid], dim=1)
        return self.gate(tokens) * mask.unsqueeze(-1).to(tokens.dtype)  # missing recent events -> 0

    def flops(self, batch: int) -> float:
        n = self.tier.num_summary_tokens + self.tier.num_recent
        return linear_flops(batch * n, self.tier.dim, self.proj.out_features) + self.gate.flops(batch * n)


class KunlunLayer(JaggedModule):
    def __init__(self, cfg: KunlunConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.runs_global, self.runs_local = cfg.layer_runs(index)
        self.pools_summary = self.runs_global and self.refreshes_summary()
        self.recent_after_attention = self.runs_local and self.reads_recent_after_attention()
        n_ns, d = cfg.num_non_seq_tokens, cfg.dim
        local_index = index // 2 if cfg.compskip else index  # alternate block shifts across local layers
        self.weight_gen = WeightGen(n_ns, cfg.num_sum_tokens, d)
        self.seq_ffn, self.hsp, self.attn = nn.ModuleDict(), nn.ModuleDict(), nn.ModuleDict()
        self.summary = nn.ModuleDict()
        for t in cfg.tiers:
            if self.runs_global:
                self.seq_ffn[t.name] = (
                    PersonalizedFFN(t, dim=d, num_sum_tokens=cfg.num_sum_tokens, activation=cfg.gdpa_activation)
                    if cfg.seq_ffn == "pffn" else TokenFFN(t, mult=cfg.token_ffn_mult, activation=cfg.gdpa_activation))
            if self.pools_summary:
                self.hsp[t.name] = HierarchicalSeedPooling(t, rank=cfg.sum_kron_rank, activation=cfg.gdpa_activation)
            if self.runs_local:
                self.attn[t.name] = self.make_attention(t, shift=(local_index % 2) * (t.block_size // 2))
            self.summary[t.name] = SummaryGate(t, d)
        self.mowe = MixtureOfWukongExperts(
            num_in=n_ns + cfg.num_summary_tokens_total, num_out=n_ns, dim=d, num_experts=cfg.num_experts,
            expert_tokens=cfg.expert_tokens, rank=cfg.fm_rank, hidden=cfg.fm_hidden)
        self.norm = nn.LayerNorm(d)

    def refreshes_summary(self) -> bool:
        """Whether this global layer pools a fresh HSP summary (always; benchmarks.diagnose's
        gem_compskip_off_first_summary probe pools it in layer 0 only)."""
        return True

    def reads_recent_after_attention(self) -> bool:
        """Whether the summary gate's last-K events are taken after this layer's block attention
        (always; benchmarks.diagnose's gem_compskip_off_early_recent probe takes layer 0's before it,
        as CompSkip's global layer 0, which runs no attention, does)."""
        return True

    def make_attention(self, tier: TierConfig, *, shift: int) -> nn.Module:
        """The local sequence layer; the padded-attention baseline overrides this."""
        return BlockAttentionLayer(tier, shift=shift)

    def forward(self, x: torch.Tensor, tiers: dict[str, TierBatch], cache: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, TierBatch], torch.Tensor]:
        """x [B, N_ns, d]; tiers updated in place of the dict; cache: tier -> HSP summary [B, n_out, d_t]."""
        x_sum = self.weight_gen(x)  # [B, n_sum, d]
        summaries = []
        for t in self.cfg.tiers:
            tb = tiers[t.name]
            if self.runs_global:
                tb = tb.replace_values(self.seq_ffn[t.name](tb, x_sum))
            if self.pools_summary:
                cache[t.name] = self.hsp[t.name](tb)  # fresh summary, reused by the next local layer
            recent = tb  # the events the summary gate takes its last K from
            if self.runs_local:
                tb = tb.replace_values(self.attn[t.name](tb))
            if self.recent_after_attention:
                recent = tb
            tiers[t.name] = tb
            summaries.append(self.summary[t.name](cache[t.name], recent, self.kernel))
        s_sum = torch.cat(summaries, dim=1)  # [B, Σ(n_out + K), d]
        z = torch.cat([x, s_sum.to(x.dtype)], dim=1)
        return self.norm(x + self.mowe(z)), tiers, s_sum

    def flops(self, batch: int, lengths: dict[str, torch.Tensor]) -> dict[str, float]:
        acc: dict[str, float] = {}
        d = self.cfg.dim
        add_flops(acc, "weight_gen", self.weight_gen.flops(batch, d))
        for t in self.cfg.tiers:
            tokens = float(lengths[t.name].sum())
            if self.runs_global:
                name = "pffn" if self.cfg.seq_ffn == "pffn" else "token_ffn"
                add_flops(acc, name, self.seq_ffn[t.name].flops(batch, tokens))
            if self.pools_summary:
                add_flops(acc, "hsp", self.hsp[t.name].flops(batch, tokens))
            if self.runs_local:
                add_flops(acc, "block_attention", self.attn[t.name].flops(lengths[t.name]))
            add_flops(acc, "summary", self.summary[t.name].flops(batch))
        add_flops(acc, "mowe", self.mowe.flops(batch))
        return acc


class KunlunModel(JaggedModule):
    layer_cls = KunlunLayer

    def __init__(self, cfg: KunlunConfig):
        super().__init__()
        try:  # here, not in the torch-free config: the names live in gem.ops.activations
            check_activations(cfg.gdpa_activation, 1)
        except ValueError as e:
            raise ValueError(f"gdpa_activation: {e}") from None
        self.cfg = cfg
        d = cfg.dim
        self.embeddings = FeatureEmbeddings(cfg)
        self.encoders = nn.ModuleDict({t.name: OneSeqEncoder(cfg, t) for t in cfg.tiers})
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.final_weight_gen = WeightGen(cfg.num_non_seq_tokens, cfg.num_sum_tokens, d)
        self.head_norm = nn.LayerNorm(d)
        num_head_tokens = cfg.num_non_seq_tokens + cfg.num_sum_tokens + cfg.num_summary_tokens_total
        self.heads = MultiTaskHeads(num_head_tokens * d, cfg)
        # Its own norm: LoopFM's logger hooks head_norm and expects one call per forward.
        self.wide_norm = nn.LayerNorm(d) if cfg.wide_heads else None
        # wide_dots: no parameters, so the state-dict keys stay those of the default model
        self.num_dot_tokens = cfg.num_non_seq_tokens + len(cfg.features.event_types) if cfg.wide_dots else 0
        wide_in = cfg.num_non_seq_tokens * d + self.num_dot_tokens * (self.num_dot_tokens - 1) // 2
        self.wide_heads = MultiTaskHeads(wide_in, cfg) if cfg.wide_heads else None
        # last, so that the trunk's initial weights are those of the model without it
        self.affinity = DotInteraction(cfg, history_decay=True) if cfg.affinity_branch else None
        # one per embedding set it trains (the trunk's, the branch's); after every other module, and
        # drawing nothing, so the rest of the model starts the same with it
        self.generative = (nn.ModuleList(HistoryGenerativeLoss(d) for _ in range(1 + cfg.affinity_branch))
                           if cfg.generative_loss_weight > 0 else None)

    def encode(self, inputs: GemInputs) -> tuple[torch.Tensor, dict[str, TierBatch]]:
        x = self.embeddings.non_sequence(inputs)  # [B, N_ns, d]; sparse-feature tokens come first
        names = [s.name for s in self.cfg.features.sparse]
        cand = [names.index(c) for c in self.cfg.features.candidate]
        candidate = x[:, cand].sum(1) if cand else None  # [B, d]
        tiers = {name: enc(inputs, self.embeddings, candidate) for name, enc in self.encoders.items()}
        return x, tiers

    def forward(self, inputs: GemInputs) -> dict[str, torch.Tensor]:
        """Logits per task, each float32 [B]."""
        x0, tiers = self.encode(inputs)
        x = x0
        cache: dict[str, torch.Tensor] = {}
        s_sum = None
        for layer in self.layers:
            x, tiers, s_sum = layer(x, tiers, cache)
        h = torch.cat([x, self.final_weight_gen(x), s_sum.to(x.dtype)], dim=1)  # [B, N_ns + n_sum + Σ(n_out+K), d]
        logits = self.heads(self.head_norm(h).flatten(1), inputs.surface)
        extra = []  # logits of the wide heads and the affinity branch, [B] per task
        if self.wide_heads is not None:
            extra.append(self.wide_heads(self.wide_input(x0, inputs), inputs.surface))
        if self.affinity is not None:
            # In its weights' precision: float32 weights stay float32 under autocast (at 0.2% of the
            # FLOPs it costs nothing, and autocast's bf16 put its gradients 10-30% off float32's at
            # init: its top-MLP ReLUs sit near 0 and flip); bf16 weights (DeepSpeed's bf16 mode) keep
            # autocast, which makes the float32 dense features meet them in bf16. (No autocast on
            # the meta device, where the model is sized without memory.)
            device = inputs.dense.device.type
            fp32 = self.affinity.top[-1].weight.dtype == torch.float32 and torch.amp.is_autocast_available(device)
            with torch.autocast(device, enabled=False) if fp32 else contextlib.nullcontext():
                extra.append(self.affinity(inputs))
        return {task: sum((e[task] for e in extra), logits[task]) for task in logits}

    def auxiliary_loss(self, inputs: GemInputs) -> torch.Tensor | None:
        """generative_loss_weight x the generative objective over the history (gem.modules.generative),
        averaged over the trunk's and the branch's tables; None when it is off. Training adds it to
        the task losses (gem.train.task); evaluation never computes it."""
        if self.generative is None:
            return None
        sets = [self.embeddings] + ([self.affinity.embeddings] if self.affinity is not None else [])
        loss = sum(g(emb, inputs) for g, emb in zip(self.generative, sets, strict=True))
        return self.cfg.generative_loss_weight * loss / len(sets)

    def wide_input(self, x0: torch.Tensor, inputs: GemInputs) -> torch.Tensor:
        """What the wide heads read: flatten(LN(X⁰)), and with wide_dots the pairwise dot products
        of the raw tokens and each event type's pooled history (a user x ad affinity is a dot
        product of latent vectors; measured, the heads did not learn more of it: docs/quality.md)."""
        flat = self.wide_norm(x0).flatten(1)  # [B, N_ns·d]
        if not self.num_dot_tokens:
            return flat
        tokens = torch.cat([x0, self.embeddings.pooled_events(inputs).to(x0.dtype)], dim=1)  # [B, n, d]
        return torch.cat([flat, pairwise_dots(tokens).to(flat.dtype)], dim=1)

    def tp_plan(self, tp: int) -> dict[str, str]:
        """The layers tensor parallelism splits at degree tp (parallelize reads this; gem/parallel/tensor_parallel.py).

        Block attention whose heads divide by tp: w_qkv split by heads in each of q, k, v, w_o by the
        same heads' input columns (Megatron's attention split: one all-reduce per layer, heads stay
        whole). Per-token FFNs (seq_ffn=token_ffn) whose width divides by tp: w1 colwise, w2 rowwise.
        Nothing else splits cleanly: PFFN generates its weights per example, the summaries and the
        head input feed gates and einsums over the full width.
        """
        from gem.parallel.tensor_parallel import COLWISE, QKV_COLWISE, ROWWISE

        plan: dict[str, str] = {}
        for name, mod in self.named_modules():
            if isinstance(mod, BlockAttentionLayer) and mod.tier.num_heads % tp == 0:
                plan[f"{name}.w_qkv"], plan[f"{name}.w_o"] = QKV_COLWISE, ROWWISE
            elif isinstance(mod, TokenFFN) and mod.hidden % tp == 0:
                plan[f"{name}.w1"], plan[f"{name}.w2"] = COLWISE, ROWWISE
        return plan

    def loss(self, inputs: GemInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total, parts): the task losses, plus the generative objective's ("generative") when it is on."""
        total, parts = multitask_loss(self(inputs), inputs.labels, self.cfg.tasks, inputs.weight)
        aux = self.auxiliary_loss(inputs)
        return (total, parts) if aux is None else (total + aux, {**parts, "generative": aux})

    # ------------------------------------------------------------------ FLOPs

    def tier_lengths(self, inputs: GemInputs) -> dict[str, torch.Tensor]:
        """Events per example of every tier after merging and truncation, int64 [B] each."""
        out = {}
        for t in self.cfg.tiers:
            total = sum(inputs.sequences[e].offsets.diff() for e in t.event_types)
            out[t.name] = total.clamp(max=t.max_seq_len)
        return out

    def flops(self, lengths: dict[str, torch.Tensor]) -> dict[str, float]:
        """Forward FLOPs of one batch by component (matmul-like work only, counted from shapes).

        lengths: tier -> events per example [B] (see tier_lengths). Multiply by 3 for fwd + bwd.
        """
        B = int(next(iter(lengths.values())).numel())
        acc: dict[str, float] = {}
        add_flops(acc, "embeddings", self.embeddings.flops(B))
        for t in self.cfg.tiers:
            add_flops(acc, "oneseq", self.encoders[t.name].flops(float(lengths[t.name].sum())))
        for layer in self.layers:
            for k, v in layer.flops(B, lengths).items():
                add_flops(acc, k, v)
        add_flops(acc, "weight_gen", self.final_weight_gen.flops(B, self.cfg.dim))
        add_flops(acc, "heads", self.heads.flops(B))
        if self.wide_heads is not None:
            dots = pairwise_dots_flops(B, self.num_dot_tokens, self.cfg.dim)  # 0 without wide_dots
            add_flops(acc, "heads", self.wide_heads.flops(B) + dots)
        if self.affinity is not None:
            add_flops(acc, "affinity_branch", self.affinity.flops(B))
        return acc
