"""A tensor whole or in shards: FSDP2 holds parameters as DTensors, each rank its rows of dim 0.

Checkpoints, the weight average, `model.weights` and the start-up broadcast move values
between the whole tensor (the same on every rank) and this rank's shard. Each helper takes any
tensor: what is not a DTensor passes through as it is, so callers do not branch on the strategy.
`full_tensor`, `full_from_local`, `full_state_dict`, `host_full_tensor` (they gather a DTensor),
`broadcast_module_from_main` and `check_same_weights` are collectives: every rank calls them
for the same tensors, in the same order. The others are local.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from config import ConfigError
from distributed import DistInfo, active, all_gather_object, broadcast_object


def full_tensor(value: Any) -> Any:
    """A DTensor's whole tensor (a collective: every rank calls it for the same tensors);
    anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def dim0_rows(value: DTensor) -> tuple[int, int] | None:
    """Rows [start, stop) of a DTensor that this rank holds, when it is sharded on dim 0 over
    one mesh dimension and replicated over any others (FSDP2, hybrid): Shard(0) splits as
    torch.chunk does, ceil(rows / shards) each, the last ones short or empty. None for any
    other layout."""
    from torch.distributed.tensor import Shard

    mesh, placements = value.device_mesh, value.placements
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(sharded) != 1 or placements[sharded[0]].dim != 0:
        return None
    dim, rows = sharded[0], value.shape[0]
    size = -(-rows // mesh.size(dim)) if rows else 0
    index = mesh.get_local_rank(dim)
    start, stop = min(rows, index * size), min(rows, (index + 1) * size)
    if value.to_local().shape[0] != stop - start:
        return None
    return start, stop


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` under each of its names (a tied or shared
    tensor under each), non-persistent buffers included (a state dict leaves those out),
    detached: an alias that keeps the storage it has now, also after fully_shard moves the
    parameter's data to the device."""
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return {name: tensor.detach() for name, tensor in named}


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view of its storage); any other tensor itself."""
    return value.to_local() if isinstance(value, DTensor) else value


def like_local(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` as this rank's part of a tensor sharded as `like` is (a DTensor, without
    communication); `local` itself when `like` is not a DTensor."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def full_from_local(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `local` is this rank's part, sharded as `like` is (a
    collective under fsdp), in host memory; `local` itself when `like` is not a DTensor."""
    whole = like_local(local, like)
    # one whole tensor on the device at a time
    return whole.full_tensor().cpu() if isinstance(whole, DTensor) else whole


class LazyRows:
    """A whole tensor of a checkpoint not read yet: its shape, its dtype, and `read(start,
    stop)`, which reads rows [start, stop) of dim 0 into a tensor of their own. A sharded
    checkpoint's loader hands these out so that each rank reads only the rows it keeps
    (`shard_like`), as torch.distributed.checkpoint's per-rank load plans do: built whole on
    every rank, a model that trains under fsdp because it does not fit could not resume."""

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, read: Callable[[int, int], torch.Tensor]
    ) -> None:
        self.shape, self.dtype, self.read = torch.Size(shape), dtype, read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def whole(self) -> torch.Tensor:
        return self.read(0, self.shape[0])


def read_whole(value: Any) -> Any:
    """A `LazyRows` read whole; anything else as it is."""
    return value.whole() if isinstance(value, LazyRows) else value


def shard_like(full: Any, like: Any) -> Any:
    """`full` (the same on every rank, or a `LazyRows`) as `like` holds it: this rank's shard
    when `like` is a DTensor (cut or read locally, no communication), else on `like`'s device
    and dtype."""
    rows = dim0_rows(like) if isinstance(like, DTensor) else None
    if isinstance(full, LazyRows):
        if rows is None:
            full = full.whole()
        else:  # only this rank's rows are read
            local = full.read(*rows).to(device=like.device, dtype=like.dtype)
            return DTensor.from_local(
                local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
            )
    if not isinstance(full, torch.Tensor):
        return full
    if isinstance(like, DTensor):
        if rows is not None:  # this rank's rows cut where they are: only they reach the device
            start, stop = rows
            # A copy, never a view: `.to()` returns the slice itself on the same device and
            # dtype, and an optimizer would keep the whole tensor alive (and torch.save write it).
            local = full[start:stop].to(device=like.device, dtype=like.dtype, copy=True)
            return DTensor.from_local(
                local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
            )
        full = full.to(device=like.device, dtype=like.dtype)
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    if isinstance(like, torch.Tensor):
        return full.to(device=like.device, dtype=like.dtype)
    return full


def full_state_dict(module: nn.Module) -> dict[str, Any]:
    """`module.state_dict()` with whole tensors (a collective under FSDP, where the parameters
    are DTensor shards; each gathered tensor goes to host memory at once, so the device never
    holds more than one whole tensor)."""
    return {key: host_full_tensor(value) for key, value in module.state_dict().items()}


def host_full_tensor(value: Any) -> Any:
    """`full_tensor`, a gathered DTensor moved to host memory; anything else as it is."""
    return value.full_tensor().cpu() if isinstance(value, DTensor) else value


def load_full_state_dict(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load whole tensors (the same on every rank) into `module`, each rank keeping its shard
    of a sharded parameter."""
    own = module.state_dict()
    local = {key: shard_like(value, own.get(key)) for key, value in state.items()}
    module.load_state_dict(local, strict=strict)


def broadcast_module_from_main(
    module: nn.Module, whole: dict[str, torch.Tensor] | None, info: DistInfo
) -> None:
    """Collective: give every rank's `module` (sharded or not, its tensors allocated but
    holding anything) rank 0's values, which rank 0 passes as `whole`: its tensors by name
    (`module_tensors`) from before sharding. Rank 0 sends each tensor whole, one at a time,
    and every other rank keeps its rows of a sharded one, so no rank but rank 0 ever holds
    the whole model. The ranks first agree that their models have the same tensors (names,
    shapes, dtypes): a factory that builds another model on another rank is named."""
    mine = module_tensors(module)
    listing = [(name, tuple(t.shape), str(t.dtype)) for name, t in mine.items()]
    theirs = broadcast_object(listing if info.is_main else None)
    differ = None
    if listing != theirs:
        differ = next(
            (f"{a} against rank 0's {b}" for a, b in zip(listing, theirs, strict=False) if a != b),
            f"{len(listing)} tensors against rank 0's {len(theirs)}",
        )
    # Every rank raises the same error, naming every rank that differs: rank 0's log says it.
    reports = [(rank, d) for rank, d in enumerate(all_gather_object(differ)) if d is not None]
    if reports:
        raise ConfigError(
            "; ".join(f"rank {rank} built another model than rank 0 ({d})" for rank, d in reports)
            + ": the model factory must build the same model on every rank"
        )
    with torch.no_grad():
        for name, own in mine.items():
            if info.is_main:
                assert whole is not None
                full = whole[name].to(info.device)
            else:
                full = torch.empty(own.shape, dtype=own.dtype, device=info.device)
            dist.broadcast(full, src=0)
            if info.is_main:
                continue  # its shards were cut from these very values
            if isinstance(own, DTensor):
                rows = dim0_rows(own)
                if rows is None:
                    raise ValueError(
                        f"{name}: a {own.placements} layout, not rows of dim 0 (fsdp, hybrid)"
                    )
                full = full[rows[0] : rows[1]]
            local_tensor(own).copy_(full)


def weights_digest(module: nn.Module) -> str:
    """A SHA-256 of the module's parameters and buffers, by name (a copy to the CPU)."""
    digest = hashlib.sha256()
    for name, tensor in full_state_dict(module).items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def check_same_weights(module: nn.Module, what: str) -> None:
    """Collective: ConfigError on every rank, naming the ranks, unless every rank's module holds
    the same weights after `what` (a file read on each node, which nodes may hold in different
    versions)."""
    if not active() or dist.get_world_size() == 1:
        return
    digests = all_gather_object(weights_digest(module))
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        described = "; ".join(
            f"ranks {','.join(map(str, ranks))}: sha256 {digest[:12]}"
            for digest, ranks in groups.items()
        )
        raise ConfigError(
            f"{what} gave the ranks different weights ({described}): the file differs between "
            "nodes; give every node the same file (or one on a shared filesystem)"
        )
