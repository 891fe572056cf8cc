"""The butterfly all-reduce as pure functions: the simulator and the swarm call the same ones.

A vector of ``numel`` fp32 values is averaged over M members like this:

1. cut it into S = M·C slices on codec block edges (``slice_bounds``); member s mod M owns slice s.
   C, the pieces each member owns (``pieces_per_member``), follows from the vector's size, the codec
   and M alone, so every member cuts alike: a large slice comes in pieces, which an owner reduces
   and sends back one by one while later pieces still arrive;
2. every member encodes its slice s with the run's codec and sends it to its owner (``encode_slices``);
3. the owner decodes the M encodings of slice s, screens them and combines the members it keeps with
   the run's aggregation rule (``reduce_slice``, ``algorithms/aggregation.py``: by default the sum in
   member order divided by M, the same float operations wherever it runs), and encodes the result
   with the codec's ``mean_codec(M)`` (the codec itself, but for a top-k one: its M-fold union);
4. every member decodes the S encoded results and concatenates them (``assemble``).

Because a block codec quantizes each block on its own and slices end on block edges, the mean with
nobody screened out equals encoding the whole vector, averaging, and encoding the mean, bit for
bit. ``butterfly_mean`` does all four steps in one process, which is what the simulator uses, so a
swarm of M peers and the simulator with M workers agree exactly for every codec and rule (screening
and the robust rules work per slice: every owner judges its own slice, by what it measured there and
by its own record of each member's earlier cosines; an owner of C pieces judges each on its own
and records each member's mean cosine over them, ``owner_cosines``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from p2p_cocodc.algorithms.aggregation import MEAN, Aggregation, CosineRecord, Screening, aggregate
from p2p_cocodc.algorithms.codecs import Codec


def slice_bounds(numel: int, parts: int, block: int) -> list[int]:
    """Element offsets cutting ``numel`` values into ``parts`` slices on multiples of ``block``."""
    blocks = -(-numel // block)
    return [min(numel, block * (blocks * i // parts)) for i in range(parts + 1)]


def slice_sizes(numel: int, parts: int, block: int) -> list[int]:
    bounds = slice_bounds(numel, parts, block)
    return [bounds[j + 1] - bounds[j] for j in range(parts)]


PIECE_BYTES = 32 * 1024  # a member's slice is cut into pieces of about this many wire bytes
MAX_PIECES = 4  # at most this many pieces a member (each is a message, resent and acknowledged)


def pieces_per_member(numel: int, members: int, codec: Codec, piece_bytes: int = PIECE_BYTES) -> int:
    """C: how many slices each of ``members`` members owns of a vector of ``numel`` values: its
    largest slice's wire bytes in ``piece_bytes``, at least 1 and at most ``MAX_PIECES``."""
    largest = codec.wire_bytes(max(slice_sizes(numel, members, codec.block)))
    return max(1, min(MAX_PIECES, largest // piece_bytes))


def round_slice_sizes(numel: int, members: int, codec: Codec, piece_bytes: int = PIECE_BYTES) -> list[int]:
    """The sizes of the S = M·C slices a round of ``members`` members cuts a vector of ``numel``
    values into (C: ``pieces_per_member``), in slice order: member s mod M owns slice s."""
    slices = members * pieces_per_member(numel, members, codec, piece_bytes)
    return slice_sizes(numel, slices, codec.block)


def owner_cosines(pieces: Sequence[Screening]) -> tuple[float, ...]:
    """What an owner's ``CosineRecord`` takes for a round from the screenings of its pieces (in
    slice order): each member's mean cosine over them (empty where nothing was screened)."""
    if not pieces or any(not screening.cosines for screening in pieces):
        return ()
    return tuple(
        math.fsum(c) / len(c) for c in zip(*(screening.cosines for screening in pieces), strict=True)
    )


def encode_slices(vector: torch.Tensor, parts: int, codec: Codec) -> list[bytes]:
    """Step 2: this member's vector, cut into ``parts`` slices, each encoded."""
    bounds = slice_bounds(vector.numel(), parts, codec.block)
    return [codec.encode(vector[bounds[j] : bounds[j + 1]]) for j in range(parts)]


def reduce_slice(
    encoded: Sequence[bytes],
    numel: int,
    codec: Codec,
    aggregation: Aggregation = MEAN,
    earlier: Sequence[Sequence[float]] = (),
    members: int | None = None,
    weights: Sequence[float] = (),
) -> tuple[bytes, Screening]:
    """Step 3: the owner's aggregate of one slice over every member's encoding, encoded again with
    ``codec.mean_codec(members)`` (``members``: the round's M, default ``len(encoded)``; fewer are
    encoded when some were left out before screening), and its screening (the members, positions
    in ``encoded``, left out of it as outliers, and their cosines; ``earlier``: each member's earlier
    cosines at this owner). With nobody screened out, the mean is the sum in member order divided by
    M; ``weights``: each member's share of the window's steps (``aggregate``). Raises UserError (from
    the codec) on a payload of the wrong size or non-finite."""
    decoded = [codec.decode(data, numel) for data in encoded]
    value, screening = aggregate(decoded, aggregation, earlier, weights)
    return codec.mean_codec(members or len(encoded)).encode(value), screening


def assemble(means: Sequence[bytes], sizes: Sequence[int], codec: Codec, members: int) -> torch.Tensor:
    """Step 4: the averaged vector from the encoded mean of every slice (S of them: ``members``·C)."""
    mean_codec = codec.mean_codec(members)
    return torch.cat([mean_codec.decode(data, n) for data, n in zip(means, sizes, strict=True)])


class ButterflyMean(NamedTuple):
    """``butterfly_mean``'s outcome: the average, the members (positions) screened out of any slice
    (ascending), and what each owner j measured: each member's c_i at slice j (empty where nothing
    was screened), which its ``CosineRecord`` takes once the round is applied."""

    average: torch.Tensor
    excluded: tuple[int, ...]
    cosines: tuple[tuple[float, ...], ...]


def butterfly_mean(
    vectors: Sequence[torch.Tensor],
    codec: Codec,
    aggregation: Aggregation = MEAN,
    owners: Sequence[CosineRecord] | None = None,
    members: Sequence[Hashable] | None = None,
    weights: Sequence[float] = (),
    piece_bytes: int = PIECE_BYTES,
) -> ButterflyMean:
    """What every member of a butterfly all-reduce ends with, computed in one process. ``owners[j]``:
    the cosine record of the owner of slice j (member j), by which it judges ``members`` (ids, in the
    order of ``vectors``); none: every member is new to every owner. Nothing is recorded here: an
    owner's record takes the round's cosines when the round is applied (a round sent later is judged
    by the rounds applied before its send, as in a swarm). ``weights``: each member's share of the
    window's steps, in the order of ``vectors``. ``piece_bytes``: ``pieces_per_member``'s."""
    if len(vectors) == 1:
        return ButterflyMean(vectors[0].clone(), (), ((),))
    count = len(vectors)
    sizes = round_slice_sizes(vectors[0].numel(), count, codec, piece_bytes)
    slices = len(sizes)
    encoded = [encode_slices(v, slices, codec) for v in vectors]
    reduced = []
    for s in range(slices):
        j = s % count  # its owner
        earlier = owners[j].earlier(members) if owners is not None and members is not None else ()
        reduced.append(
            reduce_slice([e[s] for e in encoded], sizes[s], codec, aggregation, earlier, None, weights)
        )
    excluded = sorted({i for _, screening in reduced for i in screening.excluded})
    cosines = tuple(owner_cosines([screening for _, screening in reduced[j::count]]) for j in range(count))
    average = assemble([data for data, _ in reduced], sizes, codec, count)
    return ButterflyMean(average, tuple(excluded), cosines)
