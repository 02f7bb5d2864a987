"""Context-parallel training of a causal LM: batch sharding, loss normalisation, gradient sums.

Shape letters: B = sequences of a data-parallel replica's batch, S = sequence length,
T = this rank's local tokens (DualChunkSwap share of all B*S tokens, padding included),
V = vocabulary.

Who holds what. Ranks are laid out ``(dp, pp, pcp, tp)``. The ranks of one dp replica (all its
pcp x tp ranks) are fed the same batch; each PCP rank keeps its DualChunkSwap share of the
tokens, TP ranks of one PCP slice hold the same tokens and split the heads. Every rank computes
the loss of its own real tokens divided by the *global* token count (all dp replicas), so the
sum of the per-rank losses over dp x pcp is the mean loss of the global batch, and the sum of
the per-rank gradients over dp x pcp is its gradient. TP ranks are replicas of that sum (their
activations after each row-wise projection are equal), so a parameter's gradient is summed
over exactly the dp x pcp ranks at its (pp, tp) position, whether it is a TP-sharded DTensor
(its local shard) or a replicated plain tensor. FSDP2 on the flattened ``dp_pcp`` mesh axis
does that sum in the backward (:func:`cp_modules.training.apply_fsdp`, used by the Lightning
strategies); :meth:`CPTrainingContext.reduce_gradients` is the deprecated hand-written one.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from cp_modules.config import ParallelConfig
from cp_modules.modules import CPRuntime, CPStepMetadata, build_step_metadata
from cp_modules.partition.plan import _to_device

__all__ = [
    "IGNORE_INDEX",
    "CPBatch",
    "document_lengths",
    "CPTrainingContext",
    "init_cp_training",
    "lm_cross_entropy",
    "make_step_current",
]

IGNORE_INDEX = -100

# Gradients are summed in flat buckets of at most this many bytes: one collective per bucket
# instead of one per parameter, without doubling the memory of a large model.
_BUCKET_BYTES = 32 * 1024 * 1024


@dataclass
class CPBatch:
    """This rank's share of one training batch, ready for the model.

    Attributes:
        input_ids: [T] int64 local token ids.
        labels: [T] int64 target of each local token (``IGNORE_INDEX`` for padding slots and
            positions without a target).
        positions: [T] int64 true positions (RoPE).
        meta: the step's :class:`~cp_modules.modules.CPStepMetadata` (current while the model
            runs forward and backward on this batch).
        num_global_tokens: [] fp32 count of labelled tokens of the global batch (every dp
            replica), the loss denominator.
        num_sequences: B, sequences of this replica's batch.
        extra: the batch's other entries, unsharded (e.g. sample indices).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    meta: CPStepMetadata
    num_global_tokens: torch.Tensor
    num_sequences: int
    extra: dict


def make_step_current(meta: CPStepMetadata) -> None:
    """Deprecated: make ``meta`` the current step until another is set, unscoped.

    Run the forward under ``with cp_step(meta):`` instead; backwards need no current step (each
    attention op's backward uses the plan its forward saved).
    """
    import warnings

    import cp_modules.step as step

    warnings.warn(
        "make_step_current is deprecated: run the forward under `with cp_step(meta):`",
        DeprecationWarning,
        stacklevel=2,
    )
    if not isinstance(meta, CPStepMetadata):
        raise TypeError(f"make_step_current takes a CPStepMetadata, got {type(meta).__name__}")
    step._CURRENT = meta


def document_lengths(shape: tuple[int, ...], position_ids: torch.Tensor | None) -> np.ndarray:
    """Lengths of the documents of a [B, S] batch, row by row (host ints).

    Without ``position_ids`` every row is one document. With them (transformers' flattening
    convention), each row starts at position 0 and every later position either follows the
    previous one (``p + 1``) or is 0, which starts a new document.

    Raises:
        ValueError: naming the first row and index that break the convention.
    """
    num_rows, seq_len = int(shape[0]), int(shape[1])
    if num_rows == 0 or seq_len == 0:
        raise ValueError(
            f"batch['input_ids'] must hold at least one token, got shape {tuple(shape)}"
        )
    if position_ids is None:
        return np.full(num_rows, seq_len, dtype=np.int64)
    if position_ids.dtype.is_floating_point:
        raise ValueError(f"batch['position_ids'] must be integers, got {position_ids.dtype}")
    pos = position_ids.detach().cpu().numpy().astype(np.int64)  # ok: host (batch preparation)
    bad_first = np.nonzero(pos[:, 0] != 0)[0]
    if bad_first.size:
        r = int(bad_first[0])
        raise ValueError(
            f"batch['position_ids'] row {r} starts at {int(pos[r, 0])} (index 0): packed rows "
            "start every document at position 0 (transformers' flattening convention)"
        )
    ok = (pos[:, 1:] == pos[:, :-1] + 1) | (pos[:, 1:] == 0)
    bad = np.argwhere(~ok)
    if bad.size:
        r, j = int(bad[0, 0]), int(bad[0, 1]) + 1
        raise ValueError(
            f"batch['position_ids'] row {r} index {j}: {int(pos[r, j - 1])} -> {int(pos[r, j])}; "
            "within a packed row a position either follows the previous one or is 0 (a new "
            "document)"
        )
    starts = np.flatnonzero(pos.reshape(-1) == 0)
    return np.diff(np.append(starts, pos.size)).astype(np.int64)


def lm_cross_entropy(logits: torch.Tensor, batch: CPBatch) -> torch.Tensor:
    """This rank's share of the global mean next-token loss: local token losses / global count.

    Summed over the dp x pcp ranks (TP ranks hold equal copies) it is the mean cross entropy of
    the whole global batch, as one process would compute it.

    Args:
        logits: [T, V] for the local tokens of ``batch``.
        batch: the :class:`CPBatch` the logits were computed from.
    """
    # At least fp32 (bf16/fp16 logits are upcast; fp64 stays fp64).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    local = F.cross_entropy(logits, batch.labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return local / batch.num_global_tokens


@dataclass
class CPTrainingContext:
    """This rank's view of a context-parallel training run (groups, runtime, reductions).

    Build it with :func:`init_cp_training` on every rank (it creates process groups), or
    :meth:`single` for the one-process reference.
    """

    config: ParallelConfig
    runtime: CPRuntime
    device: torch.device
    groups: object | None = None
    replica_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> CPTrainingContext:
        """One process, no parallelism: the run every layout must reproduce."""
        return cls(config=ParallelConfig(), runtime=CPRuntime.single(), device=torch.device(device))

    @property
    def dp_size(self) -> int:
        return self.config.dp

    @property
    def mesh(self):
        """The (dp, pp, pcp, tp) DeviceMesh, or None in a single process."""
        return None if self.groups is None else self.groups.mesh

    def shard_batch(self, batch: Mapping[str, torch.Tensor]) -> CPBatch:
        """Split a replica's batch of causal-LM rows over PCP with DualChunkSwap.

        A row is one sequence, or several packed documents in transformers' flattening
        convention (``DataCollatorWithFlattening``): ``position_ids`` restart at 0 at every
        document. Each document is a segment of its own (DualChunkSwap-split like a request,
        so ranks stay balanced): no token attends a token of another document.

        Every rank of a dp replica must pass the same batch (the distributed sampler of the
        Lightning strategies sees to it); the call plans the step (a small collective) and
        all-reduces the token count over dp, so every rank calls it in step. Run the model's
        forward on the result under ``with cp_step(cp_batch.meta):``.

        Args:
            batch: ``input_ids`` [B, S] integer tokens; optional ``position_ids`` [B, S]
                (default ``0 .. S-1`` per row: one document a row; otherwise each row starts
                at 0 and a position either follows the previous one or is 0, which starts a
                document); optional ``labels`` [B, S], the *target* of each token (already
                shifted; ``IGNORE_INDEX`` for none; default: the next token of the same
                document, ``IGNORE_INDEX`` at each document's last token). Other entries pass
                through unchanged in ``CPBatch.extra``.

        Raises:
            ValueError: when ``input_ids`` is missing or not [B, S] integers, ``labels`` /
                ``position_ids`` do not match its shape, or ``position_ids`` break the
                flattening convention (the message names the row and index).
        """
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError(
                "batch must be a mapping with 'input_ids' [B, S] (and optionally 'labels', "
                f"'position_ids'), got {type(batch).__name__}"
                + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            )
        ids = batch["input_ids"]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
            raise ValueError(
                "batch['input_ids'] must be an integer tensor [B, S], got "
                f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}"
            )
        labels = batch.get("labels")
        position_ids = batch.get("position_ids")
        for name, t in (("labels", labels), ("position_ids", position_ids)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != ids.shape):
                raise ValueError(
                    f"batch['{name}'] must have the shape of input_ids {tuple(ids.shape)}, got "
                    f"{tuple(getattr(t, 'shape', ()))}"
                )
        doc_lens = document_lengths(ids.shape, position_ids)
        flat_ids = ids.reshape(-1).to(self.device, torch.int64)
        if labels is None:
            # The next token (the roll puts the first token last: every document's last
            # token, the row's last among them, is then set to IGNORE_INDEX).
            flat_labels = flat_ids.roll(-1)
            if len(doc_lens) == ids.shape[0] and ids.shape[1] > 0:
                # One document a row: its ends are every S-th token (no host copy).
                s = ids.shape[1]
                ends = torch.arange(s - 1, ids.numel(), s, device=flat_ids.device)
            else:
                # Pinned and asynchronous off the CPU: a pageable copy waits for the stream.
                ends = _to_device({"ends": np.cumsum(doc_lens) - 1}, self.device)["ends"]
            # index_fill_, not ``flat_labels[ends] = ...``: that index_put waited for the GPU.
            flat_labels.index_fill_(0, ends, IGNORE_INDEX)
        else:
            flat_labels = labels.reshape(-1).to(self.device, torch.int64)

        meta = build_step_metadata(self.runtime, doc_lens.tolist(), device=self.device)
        if meta.plan.pcp_size == 1:
            # One rank: the local tokens are the batch's, in order, none of them padding.
            local_ids, local_labels = flat_ids, flat_labels
        else:
            idx = meta.token_indices
            local_ids = flat_ids[idx]
            local_labels = flat_labels[idx].masked_fill(~meta.plan.local_valid, IGNORE_INDEX)
        count = (flat_labels != IGNORE_INDEX).sum().to(torch.float32)
        if self.dp_group is not None:
            dist.all_reduce(count, group=self.dp_group)
        # A batch with no labelled token has loss 0 (not 0/0).
        count = count.clamp_min(1.0)
        extra = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids")}
        return CPBatch(
            input_ids=local_ids,
            labels=local_labels,
            positions=meta.positions,
            meta=meta,
            num_global_tokens=count,
            num_sequences=int(ids.shape[0]),
            extra=extra,
        )

    def reduce_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Deprecated: sum the gradients of ``params`` over the dp x pcp ranks, in place.

        Shard the model with :func:`cp_modules.training.apply_fsdp` instead (the Lightning
        strategies do): FSDP2 sums the gradients in the backward. This path remains for models
        without FSDP2: TP-sharded (DTensor) parameters sum their local shards, replicated
        parameters their full gradients. Call once per optimizer step, after the last backward.

        Raises:
            ValueError: for a parameter that FSDP2 already manages (its gradient is summed
                already; a second sum would scale it by dp x pcp).
        """
        import warnings

        from cp_modules.training.fsdp import DP_PCP_AXIS

        warnings.warn(
            "CPTrainingContext.reduce_gradients is deprecated: shard the model with "
            "cp_modules.training.apply_fsdp(model, mesh), which sums gradients in the backward",
            DeprecationWarning,
            stacklevel=2,
        )
        params = list(params)
        for p in params:
            if isinstance(p, DTensor) and DP_PCP_AXIS in (p.device_mesh.mesh_dim_names or ()):
                raise ValueError(
                    "reduce_gradients got a parameter sharded by FSDP2 (apply_fsdp) over "
                    f"{DP_PCP_AXIS!r}: its gradient is already summed over dp x pcp; do not "
                    "call reduce_gradients for FSDP2 models"
                )
        if self.replica_group is None:
            return
        seen: set[int] = set()
        grads: list[torch.Tensor] = []
        with torch.no_grad():
            for p in params:
                if id(p) in seen or p.grad is None:
                    continue
                seen.add(id(p))
                g = p.grad
                grads.append(g.to_local() if isinstance(g, DTensor) else g)
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for g in grads:
                by_kind.setdefault((g.dtype, g.device), []).append(g)
            for bucket_grads in by_kind.values():
                for bucket in _buckets(bucket_grads):
                    flat = torch.cat([g.reshape(-1) for g in bucket])
                    dist.all_reduce(flat, group=self.replica_group)
                    offset = 0
                    for g in bucket:
                        g.copy_(flat[offset : offset + g.numel()].view_as(g))
                        offset += g.numel()

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Global mean loss from this rank's share (sum over dp x pcp); detached, for logging."""
        total = loss.detach().clone()
        if self.replica_group is not None:
            dist.all_reduce(total, group=self.replica_group)
        return total


def _buckets(grads: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and size + nbytes > _BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def init_cp_training(
    config: ParallelConfig,
    device: torch.device | str,
    *,
    timeout_s: float | None = None,
) -> CPTrainingContext:
    """Build every group of ``config`` (mesh, DCP groups, gradient-sum groups) on this rank.

    Needs an initialised default process group whose size is ``config.world_size``.

    Raises:
        ValueError: if ``pipeline_parallel_size`` is not 1 (training here has no pipeline
            schedule) or the world size does not match the configuration.
    """
    from cp_modules.distributed.groups import init_cp_groups

    if config.pp != 1:
        raise ValueError(
            f"pipeline_parallel_size={config.pp} is not supported for training; valid: 1"
        )
    device = torch.device(device)
    groups = init_cp_groups(config, device_type=device.type, timeout_s=timeout_s)
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    replica_group = None
    # Every rank creates every group, in the same order (torch.distributed's rule).
    for ranks in groups.layout.dp_pcp_groups:  # all dp x pcp ranks of one (pp, tp) position
        g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            replica_group = g
    return CPTrainingContext(
        config=config,
        runtime=CPRuntime.from_groups(groups),
        device=device,
        groups=groups,
        replica_group=replica_group,
        dp_group=groups.dp if config.dp > 1 else None,
        dp_rank=groups.layout.coords(rank)["dp"],
    )
