"""Synchronous schedules take one batch size, divisible by n_microbatches: a batch that is not, or
one that differs from the first step's (a short last batch), is refused on every process before any
communication, naming n_microbatches and the fix, instead of failing inside torch/gloo (a loss
batch mismatch, 'Connection closed by peer', or SIGABRT). The pipeline stays usable afterwards:
the accepted steps train as single-process training does."""
import torch

from pipeline_helpers import batches, build_model, loss_fn, single_process, spawn, split_points

# (batch size, words of the refusal or None)
SIZES = [(7, "batch size 7 is not divisible by n_microbatches=2"), (8, None),
         (4, "batch size 4 differs from the first step's 8.*drop_last=True"),
         (12, "batch size 12 differs from the first step's 8"), (8, None)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def _data():
    return [batches(1, batch=b, seed=10 + i)[0] for i, (b, _) in enumerate(SIZES)]


def _worker(rank, world):
    from memsched import MemschedError
    from memsched.pipeline import Pipeline

    out = []
    with Pipeline(build_model(), split_points(world), optimizer=sgd, loss_fn=loss_fn, schedule="gpipe",
                  n_microbatches=2) as pipe:
        for x, y in _data():
            try:
                out.append(("ok", pipe.step((x, y))))
            except MemschedError as e:
                out.append(("refused", str(e)))
        x, y = _data()[1]
        try:
            pipe.step((x, y[:7]))
        except MemschedError as e:
            out.append(("refused", str(e)))
    return out


def test_uneven_or_changing_batch_sizes_are_refused_on_every_process_and_training_goes_on(tmp_path):
    import re

    results = spawn(_worker, 2, tmp_path)
    model = build_model()
    accepted = [b for b, (_, words) in zip(_data(), SIZES) if words is None]
    ref = single_process(model, sgd(model.parameters()), accepted)
    for rank, res in enumerate(results):
        for (kind, value), (_, words) in zip(res, SIZES):
            if words is None:
                assert kind == "ok", f"rank {rank}: {value}"
            else:
                assert kind == "refused" and re.search(words, value), f"rank {rank}: {kind} {value}"
        assert res[-1][0] == "refused" and "inputs have 8 rows but target has 7" in res[-1][1]
    losses = [v for k, v in results[1][:len(SIZES)] if k == "ok"]
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref), rtol=1e-5, atol=1e-6)
