"""python -m memsched <command> --help states every option's default (an option whose default writes a file,
like plan's --out, wrote timeline.png into the working folder without the help saying so)."""
import argparse
import importlib

import pytest

from memsched.__main__ import COMMANDS


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_with_a_default_names_it_in_its_help(name):
    parser = argparse.ArgumentParser()
    importlib.import_module(f"memsched.commands.{name}").add_arguments(parser)
    silent = [a.option_strings for a in parser._actions
              if a.option_strings and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                                         argparse._HelpAction))
              and a.default is not None and "default" not in (a.help or "")]
    assert silent == []


def test_plan_device_help_says_which_preset_each_alias_names():
    # was: "aliases h100, h100-pcie5" beside the default h100-pcie, while h100 is h100-sxm
    from memsched import load_device
    parser = argparse.ArgumentParser()
    importlib.import_module("memsched.commands.plan").add_arguments(parser)
    text = next(a.help for a in parser._actions if "--device" in a.option_strings)
    assert "aliases h100 and h100-sxm5 for h100-sxm, h100-pcie5 for h100-pcie" in text
    for alias, preset in (("h100", "h100-sxm"), ("h100-sxm5", "h100-sxm"), ("h100-pcie5", "h100-pcie")):
        assert load_device(alias).name == preset
