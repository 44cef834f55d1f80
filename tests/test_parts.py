"""The sample ledger (ckpt/parts.py) against digests computed here, with Python integers, from
the index hashes' definition: the digest is the set's, whatever the order, batching, rank or
restart, and a replayed, skipped or swapped sample changes it."""

from __future__ import annotations

import pytest
import torch
from helpers import ThreadRanks

import distributed
from ckpt.parts import SampleLedger, digest

P = 2**31 - 1


def hand_totals(indices: list[int]) -> list[int]:
    """[count, sum of h1, sum of h2] of dataset indices, with h1 = (1103515245 i + 12345) mod P
    and h2 = (48271 h1 + 11) mod P."""
    h1 = [(i * 1103515245 + 12345) % P for i in indices]
    h2 = [(h * 48271 + 11) % P for h in h1]
    return [len(indices), sum(h1), sum(h2)]


def hand_digest(indices: list[int]) -> str:
    count, sum1, sum2 = hand_totals(indices)
    return f"{count}:{sum1:x}:{sum2:x}"


def ledger_of(*batches: list[int]) -> SampleLedger:
    ledger = SampleLedger()
    for batch in batches:
        ledger.add(torch.tensor(batch))
    return ledger


def test_the_digest_is_the_count_and_the_sums_of_the_index_hashes() -> None:
    # Indices up to 2^31 - 2: 1103515245 i is near 2^61, where an int32 product would wrap.
    batches = [[5, 0, 17], [2**31 - 2, 123_456_789]]
    totals, per_rank = ledger_of(*batches).totals()
    assert totals == hand_totals([5, 0, 17, 2**31 - 2, 123_456_789])
    assert per_rank == [totals]  # one process: its part is the whole
    assert digest(totals) == hand_digest([5, 0, 17, 2**31 - 2, 123_456_789])


def test_the_digest_depends_on_the_set_not_on_its_order_or_batches() -> None:
    expected = hand_digest(list(range(8)))
    assert digest(ledger_of([3, 1, 2], [0], [7, 6, 5, 4]).totals()[0]) == expected
    assert digest(ledger_of(list(range(8))).totals()[0]) == expected
    assert digest(ledger_of([], list(range(8)), []).totals()[0]) == expected  # empty batches


@pytest.mark.parametrize(
    "seen",
    [
        [*range(8), 3],  # sample 3 replayed
        [0, 1, 2, 3, 4, 6, 7],  # sample 5 skipped
        [0, 1, 2, 3, 4, 6, 7, 8],  # 5 skipped and 8 trained instead: the same count
        [0, 1, 2, 3, 4, 3, 6, 7],  # 5 skipped and 3 replayed: the same count again
    ],
)
def test_a_replayed_skipped_or_swapped_sample_changes_the_digest(seen: list[int]) -> None:
    got = digest(ledger_of(seen).totals()[0])
    assert got == hand_digest(seen)
    assert got != hand_digest(list(range(8)))


def test_a_resumed_process_carries_the_epoch_and_ends_with_the_whole_sets_digest() -> None:
    first = SampleLedger()
    first.start_epoch(3)
    first.add(torch.tensor([9, 0, 4, 7, 2]))
    state = first.state_dict()
    assert state == {"epoch": 3, "totals": hand_totals([9, 0, 4, 7, 2])}
    resumed = SampleLedger()  # another process, after a restart
    resumed.load_state_dict(state)
    resumed.add(torch.tensor([1, 8]))
    resumed.add(torch.tensor([3, 6, 5]))
    totals, per_rank = resumed.totals()
    assert resumed.epoch == 3 and digest(totals) == hand_digest(list(range(10)))
    assert per_rank == [hand_totals([1, 8, 3, 6, 5])]  # this process's part only


def test_a_new_epoch_starts_from_nothing_or_from_the_totals_it_is_given() -> None:
    ledger = ledger_of([0, 1, 2])
    ledger.start_epoch(1)
    assert ledger.epoch == 1 and ledger.totals()[0] == [0, 0, 0]
    ledger.add(torch.tensor([4]))
    ledger.start_epoch(2, carried=hand_totals([0, 1]))
    ledger.add(torch.tensor([2]))
    assert ledger.epoch == 2 and ledger.totals()[0] == hand_totals([0, 1, 2])


def test_ranks_digests_add_up_to_the_digest_of_the_whole_set(monkeypatch) -> None:
    """Two ranks, each its shard of the epoch plus the totals carried from a run on another
    world size: every rank sees the global totals and each rank's part."""
    ranks = ThreadRanks(2)
    monkeypatch.setattr(distributed, "all_gather_object", ranks.all_gather_object)
    shards = {0: [4, 6, 8], 1: [5, 7, 9]}

    def rank_fn(rank: int) -> tuple[list[int], list[list[int]]]:
        ledger = SampleLedger()
        ledger.load_state_dict({"epoch": 0, "totals": hand_totals([0, 1, 2, 3])})
        ledger.add(torch.tensor(shards[rank]))
        return ledger.totals()

    for totals, per_rank in ranks.run(rank_fn):
        assert digest(totals) == hand_digest(list(range(10)))
        assert per_rank == [hand_totals(shards[0]), hand_totals(shards[1])]
