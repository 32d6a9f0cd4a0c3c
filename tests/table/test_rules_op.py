"""The rules op (dynamicemb::rules, csrc/rules.cpp): the JSON that
dynamicemb.rules reads, the same from the kernel, its fake and a compiled
caller; generated opchecks cover it."""
import json
import torch

from dynamicemb import rules
from dynamicemb._ops import ops


def test_the_op_states_what_dynamicemb_rules_reads():
    stated = json.loads(ops.rules())
    assert [o["code"] for o in stated["optimizers"]] == [o.code for o in rules.OPTIMIZERS]
    assert {s["code"] for s in stated["score_strategies"]} == set(rules.STRATEGIES)
    assert ops.rules() == ops.rules()  # a constant of the build



def test_the_rules_op_is_the_only_op_that_is_never_traced():
    """A str result cannot be traced (Dynamo: "torch.* op returned
    non-Tensor"), so rules() is read once at import and has no fake kernel;
    test_op_coverage leaves out such ops, and only this one."""
    schema = torch.ops.dynamicemb.rules.default._schema
    assert [str(r.type) for r in schema.returns] == ["str"] and not schema.arguments
