"""RequestSpec is checked in one place (validate.check_spec): a malformed spec is refused with a message naming
what is wrong, a good one comes back normalized (a list of ints, a tuple of guesses)."""

import numpy as np
import pytest
import torch

from qasr.engine.engine import Continuation, RequestSpec
from qasr.engine.request import KVLease
from qasr.engine.validate import Limits, check_spec

AUDIO = 7
HIDDEN = 4
LIMITS = Limits(audio_token_id=AUDIO, vocab_size=100, hop_length=160, num_mel_bins=8, conv_chunk_frames=100,
                kv_tokens=64)
PROMPT = [1, 2, AUDIO, AUDIO, AUDIO, 3]
ROWS = torch.zeros(3, HIDDEN)


def check(spec: object, grid: int = 2) -> RequestSpec:
    return check_spec(spec, LIMITS, HIDDEN, torch.device("cpu"), grid)  # type: ignore[arg-type]


def spec(**changes: object) -> RequestSpec:
    return RequestSpec(**{"prompt": PROMPT, "max_new_tokens": 4, "audio_embeds": ROWS, **changes})  # type: ignore[arg-type]


def test_a_good_spec_comes_back_normalized() -> None:
    got = check(spec(prompt=np.array(PROMPT), max_new_tokens=np.int64(4), ignore_eos=np.bool_(True),
                     continuation=Continuation(draft=[np.int64(5), 6])))
    assert got.prompt == PROMPT and all(type(t) is int for t in got.prompt) and got.ignore_eos is True
    assert type(got.max_new_tokens) is int and got.continuation.draft == (5, 6)
    assert got.audio_embeds is ROWS


@pytest.mark.parametrize(("changes", "match"), [
    (dict(waveform=np.zeros(16000, np.float32)), "audio_embeds instead of waveform"),
    (dict(audio_embeds=None), "exactly one of waveform or features"),
    (dict(audio_embeds=ROWS[:2]), "audio placeholders"),
    (dict(audio_embeds=torch.zeros(3, HIDDEN + 1)), "audio_embeds must be"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=61), "KV-cache tokens"),
    (dict(prompt=[*PROMPT, 100]), "outside"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
    (dict(interactive="yes"), "interactive must be a bool"),
    (dict(group=["a", "list"]), "group must be hashable"),
    (dict(continuation=Continuation(draft=[100])), "draft"),
    (dict(continuation=Continuation(keep_kv=None)), "keep_kv"),
    (dict(continuation={"keep_kv": True}), "continuation must be a Continuation"),
])
def test_a_malformed_spec_is_refused_naming_what_is_wrong(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check(spec(**changes))


def test_a_kv_prefix_must_fit_the_grid_the_lease_and_the_prompt() -> None:
    lease = KVLease(blocks=[0], valid=4, prompt=tuple(PROMPT[:4]))
    assert check(spec(continuation=Continuation(kv_prefix=(lease, 4)))).continuation.kv_prefix == (lease, 4)
    for n, grid in ((3, 2), (0, 1), (5, 1)):  # off the grid; empty; beyond the lease
        with pytest.raises(ValueError, match="kv_prefix length"):
            check(spec(continuation=Continuation(kv_prefix=(lease, n))), grid)
    other = KVLease(blocks=[0], valid=4, prompt=(9, 9, 9, 9))
    with pytest.raises(ValueError, match="does not start with"):
        check(spec(continuation=Continuation(kv_prefix=(other, 2))))
    with pytest.raises(ValueError, match="kv_prefix must be"):
        check(spec(continuation=Continuation(kv_prefix=([0], 2))))  # type: ignore[arg-type]


def test_submit_takes_a_spec_not_keywords() -> None:
    with pytest.raises(TypeError, match="RequestSpec"):
        check(PROMPT)
