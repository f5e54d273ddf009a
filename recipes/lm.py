"""Language modelling on text from a known source: a small transformer LM (token and position
embeddings, pre-norm attention blocks with LayerNorm, a decoder head) trained on sequences from a
random first-order Markov chain.

The model has the tensor shapes where compression breaks: embeddings whose rows of rare tokens get
a gradient only now and then, LayerNorm gains and biases of a few dozen values next to wide
attention and feed-forward matrices. The source is offline and exact: its entropy rate is known, so
a run's validation loss can be read against the best any model can do (its entropy rate).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .algorithms import build_optimizer
from .common import StopOnDivergence
from .data import InMemoryDataModule

__all__ = ["LanguageModel", "MarkovSource", "MarkovTextDataModule", "TinyLM"]


class MarkovSource:
    """A first-order Markov chain over ``vocab`` tokens: every token is followed by one of ``branching``
    tokens with Dirichlet(1) weights. Its stationary distribution is far from uniform, so some tokens
    are rare; its entropy rate is the expected next-token loss of the true model, the floor of any
    model's validation loss (every prediction has the previous token in its context)."""

    def __init__(self, vocab: int = 64, branching: int = 3, seed: int = 0) -> None:
        if not 1 <= branching <= vocab:
            raise ValueError(f"need 1 <= branching <= vocab, got {branching} and {vocab}")
        g = torch.Generator().manual_seed(seed)
        succ = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
        w = -torch.rand(vocab, branching, generator=g, dtype=torch.float64).log()  # Exp(1): Dirichlet(1) weights
        self.P = torch.zeros(vocab, vocab, dtype=torch.float64).scatter_(1, succ, w / w.sum(1, keepdim=True))
        pi = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
        for _ in range(10_000):  # power iteration to the stationary distribution
            nxt = pi @ self.P
            if torch.allclose(nxt, pi, atol=1e-15, rtol=0):
                break
            pi = nxt
        self.pi = pi
        self.vocab = vocab

    def entropy_rate(self) -> float:
        """H(next | current) in nats under the stationary distribution."""
        logp = torch.where(self.P > 0, self.P.log(), 0.0)
        return float(-(self.pi[:, None] * self.P * logp).sum())

    def sample(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` sequences of ``length`` tokens (int64), the first drawn from the stationary distribution."""
        out = torch.empty(n, length, dtype=torch.int64)
        out[:, 0] = torch.multinomial(self.pi.float(), n, replacement=True, generator=generator)
        for t in range(1, length):
            out[:, t] = torch.multinomial(self.P[out[:, t - 1]].float(), 1, generator=generator).view(-1)
        return out


class TinyLM(nn.Module):
    """A causal transformer LM: embeddings, ``layers`` pre-norm blocks (attention + MLP), a final
    LayerNorm and a linear decoder."""

    def __init__(self, vocab: int = 64, d_model: int = 64, heads: int = 4, layers: int = 2, ff: int = 256,
                 context: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.context = context

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens, the model's context is {self.context}")
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def lm_loss(net: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``net`` on ``seqs`` [batch, length]."""
    logits = net(seqs[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))


class MarkovTextDataModule(InMemoryDataModule):
    """``train_size`` and ``val_size`` sequences of ``length`` tokens from a :class:`MarkovSource`
    (its own seed ``source_seed``; the samples follow the run's ``seed``). Offline, no files."""

    def __init__(self, vocab: int = 64, branching: int = 3, source_seed: int = 0, length: int = 33,
                 train_size: int = 4096, val_size: int = 512, batch_size: int = 16, num_workers: int = 0,
                 seed: int = 0, root: str | None = None, download: bool = False,
                 worker_start_method: str = "forkserver") -> None:
        super().__init__(batch_size, num_workers, seed, worker_start_method)
        self.source = MarkovSource(vocab, branching, source_seed)
        self.length, self.train_size, self.val_size = length, train_size, val_size

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.train_set = TensorDataset(self.source.sample(self.train_size, self.length, g))
        self.val_set = TensorDataset(self.source.sample(self.val_size, self.length, g))


class LanguageModel(StopOnDivergence, L.LightningModule):
    """Next-token training of a :class:`TinyLM`; logs ``train_loss`` per step and ``val_loss`` and
    ``val_gap`` (val_loss minus the source's entropy rate: 0 is the best any model can do) per epoch."""

    def __init__(self, net: dict[str, Any], algorithm: dict[str, Any], source_loss: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyLM(**net)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net, batch[0])
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        loss = lm_loss(self.net, batch[0])
        self.log("val_loss", loss, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("val_gap", loss - self.hparams.source_loss, on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return build_optimizer(dict(self.hparams.algorithm), self.parameters())
