"""The decode batch shared by the colocated engine and the decode worker: members joining and
leaving between steps, ragged lengths, greedy tokens equal to one request decoded alone."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.engine.batching import DecodeBatch  # noqa: E402
from kvstore.engine.colocated import reference_generate  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

SPEC = tiny_spec(seed=5)


@pytest.fixture(scope="module")
def model() -> object:
    return build_reference_model(SPEC)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def prefill(model: object, tokens: list[int]) -> tuple[object, int]:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=True)  # type: ignore[operator]
    return out.past_key_values, int(torch.argmax(out.logits[0, -1]))


def test_members_join_and_leave_between_steps(model: object) -> None:
    # (name, prompt length, tokens wanted, step at which it joins)
    plan = [("a", 9, 7, 0), ("b", 40, 12, 0), ("c", 1, 6, 2), ("d", 23, 3, 3), ("e", 64, 9, 6),
            ("f", 5, 2, 11)]
    prompts = {name: prompt(n, seed=i) for i, (name, n, _w, _j) in enumerate(plan)}
    wanted = {name: w for name, _n, w, _j in plan}
    batch = DecodeBatch(model)
    tokens: dict[str, list[int]] = {}
    sizes = []
    step = 0
    while step < 40 and (len(tokens) < len(plan) or len(batch)):
        for name, _n, _w, joins_at in plan:
            if joins_at == step:
                cache, first = prefill(model, prompts[name])
                tokens[name] = [first]
                batch.join(name, cache)
        if len(batch):
            sizes.append(len(batch))
            last = {name: tokens[name][-1] for name in tokens if name in batch}
            for name, token in batch.step(last).items():
                tokens[name].append(token)
                if len(tokens[name]) == wanted[name]:
                    batch.leave(name)
        step += 1
    for name, toks in tokens.items():
        assert toks == reference_generate(model, prompts[name], wanted[name]), name
    assert max(sizes) >= 3 and 1 in sizes  # ragged batches and a lone member both happened
    assert batch.pad_s > 0 and len(batch) == 0


def test_membership_is_checked(model: object) -> None:
    batch = DecodeBatch(model)
    cache, first = prefill(model, prompt(4, seed=1))
    batch.join("x", cache)
    with pytest.raises(InvalidArgument):
        batch.join("x", cache)
    with pytest.raises(InvalidArgument):
        batch.leave("y")
    with pytest.raises(InvalidArgument):
        batch.step({"x": first, "y": 1})
    assert set(batch.step({"x": first})) == {"x"}
    batch.leave("x")
    with pytest.raises(InvalidArgument):
        batch.step({})
