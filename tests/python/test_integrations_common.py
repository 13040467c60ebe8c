"""memsched.integrations._common, the framework-free part of the Trainer and Lightning callbacks."""
from memsched.integrations._common import short_accumulation_refusal


def _refusal(batches, k, global_step=0, max_steps=0):
    return short_accumulation_refusal(batches, k, global_step, max_steps, "gradient_accumulation_steps",
                                      "ooo=True", "the dataset's size")


def test_a_short_last_accumulation_is_refused_naming_a_step_limit_within_the_epoch():
    e = _refusal(6, 4)
    assert "an epoch has 6 batches, not a multiple of 4" in str(e) and "max_steps < 2" in str(e)


def test_an_epoch_shorter_than_one_accumulation_names_no_impossible_step_limit():
    """2 batches an epoch, 3 per step: no max_steps >= 1 stops before the epoch's one (short) step."""
    e = _refusal(2, 3)
    assert "an epoch has 2 batches, not a multiple of 3" in str(e)
    assert "max_steps" not in str(e) and "ooo=False" in str(e)


def test_whole_accumulations_and_a_limit_before_the_short_step_are_not_refused():
    assert _refusal(8, 4) is None and _refusal(6, 1) is None
    assert _refusal(6, 4, max_steps=1) is None
