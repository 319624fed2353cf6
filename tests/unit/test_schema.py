"""Schema.merged: the one check of a stage's request keys before its own checks."""

import pytest

from specops.schema import Option, Schema
from specops.stage import StageError

SCHEMA = Schema(
    "example",
    (
        Option("target", "path", "The model directory.", required=True),
        Option("batch", "int", "Rows a batch.", default=8),
        Option("devices", "list", "Devices to use.", default=["cuda:0"], elements="str"),
    ),
)


def test_a_request_lies_over_the_defaults_and_none_counts_as_unset():
    merged = SCHEMA.merged({"target": "/m", "batch": None})
    assert merged == {"target": "/m", "batch": 8, "devices": ["cuda:0"]}
    merged["devices"].append("cuda:1")
    assert SCHEMA.merged({"target": "/m"})["devices"] == ["cuda:0"]


def test_unknown_keys_are_named_with_the_keys_there_are():
    with pytest.raises(StageError) as error:
        SCHEMA.merged({"target": "/m", "batches": 3})
    assert str(error.value) == "unknown request keys ['batches']: the keys are ['batch', 'devices', 'target']"


@pytest.mark.parametrize(("request_", "said"), [({}, ""), ({"target": ""}, ": the model to score")])
def test_an_empty_required_key_is_named_with_what_it_is_for(request_, said):
    with pytest.raises(StageError) as error:
        SCHEMA.merged(request_, "the model to score" if said else "")
    assert str(error.value) == f"missing required keys ['target']{said}"
