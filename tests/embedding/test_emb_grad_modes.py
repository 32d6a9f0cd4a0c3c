"""Forwards whose grad mode and module mode disagree, where a native table
and a dynamic one part ways, and what the dynamic table says about it:
- training mode under no_grad: a native table only reads; a dynamic one
  stores new keys and refreshes scores as a training step does (it may evict
  trained rows), which it says once;
- eval mode with grad on: a native FUSED table still trains in backward; a
  dynamic eval forward stores nothing, so its backward updates no row, which
  it says once, instead of leaving the rows untouched silently."""
import warnings

import torch

from emb_helpers import DEBUG_INIT, bags, debug_rows, make_module


def _module():
    return make_module([4], initializer_args=DEBUG_INIT, module_kwargs={"learning_rate": 0.5})


def _notes(fn):
    """fn()'s result and the messages of the dynamicemb RuntimeWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught
                 if issubclass(w.category, RuntimeWarning) and str(w.message).startswith("dynamicemb")]


def test_a_training_forward_under_no_grad_stores_its_keys_and_says_so_once():
    m = _module()
    idx, off = bags([[1, 2], [3]])
    with torch.no_grad():
        _, first = _notes(lambda: m(idx, off))
        _, second = _notes(lambda: m(*bags([[4]])))
    assert len(first) == 1 and "under torch.no_grad()" in first[0] and "model.eval()" in first[0], first
    assert str(m.table_names) in first[0]
    assert second == []  # once per module
    assert m.storage.stats(0)["size"] == 4  # the behaviour itself is unchanged: keys 1-4 stored

    plain = _module()  # a training step with grad on, and any eval forward, says nothing of it
    _, with_grad = _notes(lambda: plain(idx, off).sum().backward())
    plain.eval()
    with torch.no_grad():
        _, in_eval = _notes(lambda: plain(*bags([[9]])))
    assert with_grad == [] and in_eval == []


def test_a_backward_through_an_eval_forward_updates_no_row_and_says_so_once():
    m = _module()
    idx, off = bags([[1, 2], [3, 7]])
    m(idx, off).sum().backward()  # keys 1, 2, 3, 7 stored and trained once
    trained = m.storage.weights()[0].clone()
    m.eval()
    with torch.no_grad():
        want = m(idx, off)
    out = m(idx, off)
    assert out.requires_grad and torch.equal(out.detach(), want)  # the same numbers, hooked into autograd
    initial = torch.stack([debug_rows([1, 2], 4).sum(0), debug_rows([3, 7], 4).sum(0)])
    assert (want - initial).abs().max() > 0.1  # the rows read are the trained ones
    _, first = _notes(lambda: (out * 2).sum().backward())
    _, second = _notes(lambda: m(idx, off).sum().backward())
    assert len(first) == 1 and "eval mode updates none of their rows" in first[0] and "model.train()" in first[0]
    assert second == []
    assert torch.equal(m.storage.weights()[0], trained)  # no row moved, and no key stored
    assert m.storage.stats(0)["size"] == 4


def test_an_eval_output_with_grad_on_can_be_modified_in_place():
    m = _module()
    m.eval()
    out = m(*bags([[1], [2]]))
    out.mul_(2)  # not a view made inside the autograd function
    assert torch.equal(out, torch.zeros(2, 4))  # missing keys read zeros in eval


def test_a_compiled_eval_forward_says_so_too():
    """Under torch.compile the eval output is hooked into autograd as in
    eager: the backward warns (it was left out when compiling)."""
    m = _module()
    idx, off = bags([[1, 2], [3, 7]])
    m(idx, off).sum().backward()
    trained = m.storage.weights()[0].clone()
    m.eval()
    run = torch.compile(m, backend="aot_eager")
    out, _ = _notes(lambda: run(idx, off))
    _, said = _notes(lambda: out.sum().backward())
    assert len(said) == 1 and "eval mode updates none of their rows" in said[0], said
    assert torch.equal(m.storage.weights()[0], trained)
