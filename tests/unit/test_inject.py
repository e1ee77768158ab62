import pytest

from trainguard.faults.inject import dumps, loads, parse_inject


def test_parses_every_kind() -> None:
    assert parse_inject("kill:rank=1:step=20", 0).kind == "kill"
    e = parse_inject("exit:rank=0:step=3:code=7", 1)
    assert (e.id, e.rank, e.step, e.code) == (1, 0, 3, 7)
    assert parse_inject("hang:rank=2:step=5", 0).step == 5
    assert parse_inject("node-down:node=1:step=9", 0).node == 1
    assert parse_inject("slow:rank=3:factor=1.5", 0).factor == 1.5


def test_round_trip() -> None:
    specs = [parse_inject("kill:rank=1:step=20", 0), parse_inject("slow:rank=0:factor=2", 1)]
    assert loads(dumps(specs)) == specs


@pytest.mark.parametrize(
    "bad",
    [
        "explode:rank=1",
        "kill:rank=1",
        "kill:rank=x:step=1",
        "kill:rank=1:step",
        "kill:rank=1:step=2:code=3",
        "slow:rank=1:factor=0.5",
        "kill:rank=-1:step=2",
    ],
)
def test_rejects_bad_specs_with_the_form(bad: str) -> None:
    with pytest.raises(ValueError, match="--inject"):
        parse_inject(bad, 0)


def test_timed_drills_for_any_script() -> None:
    s = parse_inject("kill:rank=1:after=2.5", 0)
    assert (s.step, s.after, s.describe()) == (None, 2.5, "kill:rank=1:after=2.5")
    assert parse_inject("node-down:node=1:after=3", 0).describe() == "node-down:node=1:after=3"
    assert loads(dumps([s])) == [s]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("exit:rank=1:code=2:after=3", "needs step=S"),  # only the runtime can exit the script
        ("kill:rank=1:step=3:after=2", "not both"),
        ("hang:rank=1:after=-1", ">= 0"),
        ("hang:rank=1:after=inf", ">= 0"),
    ],
)
def test_timed_drills_are_refused_where_they_cannot_work(bad: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_inject(bad, 0)
