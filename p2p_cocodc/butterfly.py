"""The butterfly all-reduce as pure functions: the simulator and the swarm call the same ones.

A vector of ``numel`` fp32 values is averaged over M members like this:

1. cut it into M slices on codec block edges (``slice_bounds``); member i owns slice i;
2. every member encodes its slice j with the run's codec and sends it to member j (``encode_slices``);
3. owner j decodes the M encodings of slice j, sums them in member order and divides by M
   (``reduce_slice``, the same float operations wherever it runs), and encodes that mean;
4. every member decodes the M encoded means and concatenates them (``assemble``).

Because a block codec quantizes each block on its own and slices end on block edges, this equals
encoding the whole vector, averaging, and encoding the mean, bit for bit; ``butterfly_mean`` does
all four steps in one process, which is what the simulator uses, so a swarm of M peers and the
simulator with M workers agree exactly for every codec.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2p_cocodc.codecs import Codec, mean_in_order


def slice_bounds(numel: int, parts: int, block: int) -> list[int]:
    """Element offsets cutting ``numel`` values into ``parts`` slices on multiples of ``block``."""
    blocks = -(-numel // block)
    return [min(numel, block * (blocks * i // parts)) for i in range(parts + 1)]


def slice_sizes(numel: int, parts: int, block: int) -> list[int]:
    bounds = slice_bounds(numel, parts, block)
    return [bounds[j + 1] - bounds[j] for j in range(parts)]


def encode_slices(vector: torch.Tensor, parts: int, codec: Codec) -> list[bytes]:
    """Step 2: this member's vector, cut into ``parts`` slices, each encoded."""
    bounds = slice_bounds(vector.numel(), parts, codec.block)
    return [codec.encode(vector[bounds[j] : bounds[j + 1]]) for j in range(parts)]


def reduce_slice(encoded: Sequence[bytes], numel: int, codec: Codec) -> bytes:
    """Step 3: the owner's mean of one slice over every member's encoding, in member order,
    encoded again. Raises UserError (from the codec) on a payload of the wrong size or non-finite."""
    return codec.encode(mean_in_order([codec.decode(data, numel) for data in encoded]))


def assemble(means: Sequence[bytes], sizes: Sequence[int], codec: Codec) -> torch.Tensor:
    """Step 4: the averaged vector from every owner's encoded mean slice."""
    return torch.cat([codec.decode(data, n) for data, n in zip(means, sizes, strict=True)])


def butterfly_mean(vectors: Sequence[torch.Tensor], codec: Codec) -> torch.Tensor:
    """What every member of a butterfly all-reduce ends with, computed in one process."""
    if len(vectors) == 1:
        return vectors[0].clone()
    members = len(vectors)
    numel = vectors[0].numel()
    sizes = slice_sizes(numel, members, codec.block)
    encoded = [encode_slices(v, members, codec) for v in vectors]
    means = [reduce_slice([e[j] for e in encoded], sizes[j], codec) for j in range(members)]
    return assemble(means, sizes, codec)
