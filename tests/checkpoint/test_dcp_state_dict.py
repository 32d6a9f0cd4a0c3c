"""A TorchRec user's checkpoint keeps the dynamic tables (issue 34):
dcp.save(model.state_dict()) on 1, 2 and 3 ranks, then dcp.load into a
freshly built model and load_state_dict, for SGD, Adam and row-wise Adagrad
(and, in test_dcp_tiers.py, cached tables and a FileStore).

- Same world size: the loaded model holds exactly the original's entries
  (read from the hash tables themselves, not through the export that saves
  use), gives identical eval outputs, and trains on identically.
- Another world size (1 -> 2 -> 3, and 3 -> 1): every key is present exactly
  once, on the rank that routing gives it, with its value, optimizer state,
  score and admission count, and eval outputs equal the original's.
"""
import pytest

import dcp_helpers as D


@pytest.mark.parametrize("w", D.SIZES)
@pytest.mark.parametrize("optimizer", list(D.OPTIMIZERS))
def test_dcp_round_trip_and_training_goes_on(optimizer, w):
    D.check_round_trip(D.results(optimizer), w)


@pytest.mark.parametrize("direction", ["1->2", "2->3", "3->1"])
@pytest.mark.parametrize("optimizer", list(D.OPTIMIZERS))
def test_dcp_reshards_every_key_to_its_owner(optimizer, direction):
    D.check_reshard(D.results(optimizer), direction)
