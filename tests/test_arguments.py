"""The producer's check of a job's kwargs against its params' JSON schema (tasks.core.arguments):
pure, in-process; the fleet's side is in tests/test_fanout.py."""

from __future__ import annotations

from enum import Enum
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.core.arguments import argument_problems, check_arguments
from tasks.core.errors import InvalidJobArguments


class Optimizer(str, Enum):
    ADAM = "adam"
    SGD = "sgd"


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(1, ge=1)


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epochs: int = Field(20, ge=1, le=1000)
    lr: float = Field(0.01, gt=0)
    name: str = Field(..., min_length=1)
    optimizer: Optimizer = Optimizer.ADAM
    mode: Literal["fast", "slow"] = "fast"
    verbose: bool = False
    layers: list[int] = Field(default_factory=list, max_length=3)
    seed: int | None = None
    inner: Inner = Field(default_factory=Inner)


SCHEMA = Params.model_json_schema()


def problems(kwargs: dict) -> list[str]:
    return argument_problems(kwargs, SCHEMA)


def test_an_unknown_argument_names_its_value_and_the_closest_param():
    assert problems({"name": "a", "epoch": 3}) == ["unexpected argument 'epoch' (3); did you mean 'epochs'?"]
    assert problems({"name": "a", "zzz": 1}) == ["unexpected argument 'zzz' (1)"]
    assert problems({"name": "a", "inner": {"widht": 2}}) == [
        "unexpected argument 'inner.widht' (2); did you mean 'inner.width'?"]


def test_a_missing_required_argument():
    assert problems({}) == ["missing argument 'name'"]
    assert argument_problems({}, SCHEMA, sampled=["name"]) == []  # a study samples it
    # A sampled name is the study's to check, trial by trial, as before schemas.
    assert argument_problems({"name": "a"}, SCHEMA, sampled=["lrr"]) == []


def test_a_wrong_type_and_what_pydantic_coerces():
    assert problems({"name": "a", "epochs": "many"}) == ["epochs='many': expected an integer"]
    assert problems({"name": "a", "epochs": 2.5}) == ["epochs=2.5: expected an integer"]
    assert problems({"name": "a", "seed": "x"}) == ["seed='x': expected an integer or null"]
    assert problems({"name": 3}) == ["name=3: expected a string"]
    assert problems({"name": "a", "layers": [1, "x"]}) == ["layers[1]='x': expected an integer"]
    # pydantic's lax mode reads these: the producer must not refuse them.
    for fine in ({"epochs": "3"}, {"epochs": 3.0}, {"lr": 1}, {"lr": "0.5"}, {"verbose": "yes"},
                 {"verbose": 1}, {"seed": None}, {"optimizer": "sgd"}):
        Params.model_validate({"name": "a", **fine})
        assert problems({"name": "a", **fine}) == [], fine


def test_numeric_and_length_bounds():
    assert problems({"name": "a", "epochs": 0}) == ["epochs=0: must be >= 1"]
    assert problems({"name": "a", "epochs": 1001}) == ["epochs=1001: must be <= 1000"]
    assert problems({"name": "a", "lr": 0}) == ["lr=0: must be > 0"]
    assert problems({"name": ""}) == ["name='': must have at least 1 characters"]
    assert problems({"name": "a", "layers": [1, 2, 3, 4]}) == ["layers=[1, 2, 3, 4]: must have at most 3 items"]


def test_enum_values_with_a_suggestion():
    assert problems({"name": "a", "optimizer": "adma"}) == [
        "optimizer='adma': must be one of 'adam', 'sgd'; did you mean 'adam'?"]
    assert problems({"name": "a", "mode": "quick"}) == ["mode='quick': must be one of 'fast', 'slow'"]


@pytest.mark.parametrize("kwargs", [{"epochs": 0}, {"epoch": 1}, {"name": 3}, {"optimizer": "x"}, {"lr": -1},
                                    {"layers": "abc"}, {"inner": {"width": 0}}, {}])
def test_every_refusal_is_one_the_job_process_makes_too(kwargs):
    with pytest.raises(ValidationError):
        Params.model_validate({"name": "a", **kwargs} if kwargs else {})
    assert argument_problems({"name": "a", **kwargs} if kwargs else {}, SCHEMA)


def test_the_refusal_is_one_line_naming_job_and_trial():
    with pytest.raises(InvalidJobArguments) as refused:
        check_arguments("train", {"epoch": 3, "lr": -1}, SCHEMA, where="trial 2")
    assert str(refused.value) == ("train (trial 2): unexpected argument 'epoch' (3); did you mean 'epochs'?; "
                                  "lr=-1: must be > 0; missing argument 'name'")
    check_arguments("train", {"name": "a"}, SCHEMA)  # fine: no error


def test_a_whole_bound_reads_the_same_whichever_pydantic_wrote_the_schema() -> None:
    # pydantic writes Field(gt=0) as 0 on newer releases and 0.0 on older ones (the floors run).
    for bound in (0, 0.0):
        schema = {"type": "object", "properties": {"lr": {"type": "number", "exclusiveMinimum": bound}}}
        assert argument_problems({"lr": -0.5}, schema) == ["lr=-0.5: must be > 0"]
    schema = {"type": "object", "properties": {"p": {"type": "number", "maximum": 0.5}}}
    assert argument_problems({"p": 0.75}, schema) == ["p=0.75: must be <= 0.5"]
