"""The generated click log: a pure function of the sample index, ids over
2**40 with Zipf skew, new ids over time, labels that follow the hidden model."""
import torch
from torchmetrics.functional.classification import binary_auroc

from example_data import NATIVE_FEATURES, SPARSE_FEATURES, ClickRows
from example_data.synthetic import ID_SPACE, NATIVE_VOCAB, PERIOD, HiddenModel, generated_log

DYNAMIC = [j for j, f in enumerate(SPARSE_FEATURES) if f not in NATIVE_FEATURES]


def _equal(a: ClickRows, b: ClickRows):
    for k in ("dense", "ids", "present", "labels"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k


def test_samples_do_not_depend_on_how_they_are_batched():
    m = HiddenModel(3)
    _equal(m.rows(1000, 900), ClickRows.concat([m.rows(1000, 300), m.rows(1300, 1), m.rows(1301, 599)]))
    _equal(HiddenModel(3).rows(1000, 50), m.rows(1000, 50))  # the seed fixes the log
    assert not torch.equal(HiddenModel(4).rows(1000, 50).ids, m.rows(1000, 50).ids)


def test_held_out_samples_come_after_the_training_ones():
    log = generated_log(5000, 700, seed=1)
    assert log.train_size is None
    _equal(log.eval, HiddenModel(1).rows(5000, 700))
    _equal(log.train(100, 20), HiddenModel(1).rows(100, 20))


def test_ids_are_skewed_over_a_2_pow_40_space():
    rows = HiddenModel(0).rows(0, 20000)
    ids = rows.ids[:, DYNAMIC]
    assert int(ids.min()) >= 0 and int(ids.max()) < ID_SPACE and int(ids.max()) > 2**36
    for j, f in enumerate(SPARSE_FEATURES):
        col = rows.ids[:, j][rows.present[:, j]]
        if f in NATIVE_FEATURES:
            assert int(col.max()) < NATIVE_VOCAB[f]
            continue
        _, counts = col.unique(return_counts=True)
        top = counts.sort(descending=True).values
        assert top[:100].sum() > 0.25 * col.numel(), f"{f}: the 100 most frequent ids are not a large share"
        assert (counts == 1).sum() > 0.3 * counts.numel(), f"{f}: no long tail of ids seen once"


def test_new_ids_appear_over_time():
    m = HiddenModel(0)
    before = m.rows(0, 8000)
    same_period, later = m.rows(8000, 8000), m.rows(3 * PERIOD, 8000)

    def new_share(rows):
        return sum((~torch.isin(rows.ids[:, j], before.ids[:, j])).float().mean() for j in DYNAMIC) / len(DYNAMIC)

    assert new_share(later) > new_share(same_period) + 0.05


def test_labels_follow_the_hidden_model():
    rows, probability = HiddenModel(0).generate(0, 20000)
    ctr = rows.labels.mean().item()
    assert 0.1 < ctr < 0.4
    assert abs(ctr - probability.mean()) < 0.01
    assert binary_auroc(torch.from_numpy(probability), rows.labels.long()).item() > 0.8  # learnable
