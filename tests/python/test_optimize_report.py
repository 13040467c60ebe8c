"""run.report()'s notes read as English for every count: "1 step did not match", never "1 step(s)" or
"1 storages" (optimize.py, with memsched/wording.py)."""
import warnings

import torch
import torch.nn as nn

import memsched


def test_counts_of_one_in_the_report_are_singular():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mismatch warning: the point of this run
        with memsched.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), budget="1GiB",
                               profile="offload", max_reprofiles=1) as run:
            for batch in (4, 4, 6, 6):  # the third step saves other shapes: one mismatch, one re-profile
                model(torch.randn(batch, 8)).sum().backward()
                run.step()
    table = run.report().table
    assert "1 step did not match the profiled trace" in table and "; 1 re-profile\n" in table + "\n"
    assert "(s)" not in table and "1 storages" not in table
    assert f"{run.profile_stats.offloaded} storages" in table  # several: plural
