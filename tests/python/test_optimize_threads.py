"""Note [One thread per step] (optimize.py): a step's forward, backward and run.step() share a thread."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memsched
from memsched.optimize import optimize


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


@pytest.mark.parametrize("planned", [False, True])
def test_run_step_on_another_thread_than_the_forward_is_refused_clearly_and_the_run_goes_on(planned):
    model = _model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), planner="offload_all_prefetch",
                  budget=1.0) as run:
        if planned:
            F.mse_loss(model(x), y).backward()
            run.step()
        with ThreadPoolExecutor(max_workers=1) as worker:   # one worker thread for both calls
            loss = worker.submit(lambda: F.mse_loss(model(x), y)).result()
            with pytest.raises(memsched.MemschedError, match="another thread than this step's forward"):
                run.step()

            def finish():
                loss.backward()
                run.step()   # the step can still be ended on the forward's thread

            worker.submit(finish).result()
        F.mse_loss(model(x), y).backward()   # and the next steps run on the main thread
        run.step()


def test_a_backward_on_another_thread_than_the_profiled_forward_is_named():
    model = _model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget=0.5) as run:
        loss = F.mse_loss(model(x), y)
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
        with pytest.raises(memsched.MemschedError, match="backward ran on another thread"):
            run.step()
