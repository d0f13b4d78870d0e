"""``thundersync``'s first contact: every bad argument is one line on stderr and exit 2, before any work.

GPUs needed: 0 (CPU only). No run starts: a bad ``demo`` is refused before verl is imported.
"""

from __future__ import annotations

import json
import sys

import pytest

from thundersync_verl.cli import main

BAD = {
    "demo --steps 0": "--steps: 0 is not a positive whole number",
    "demo --steps -3": "--steps: -3 is not a positive whole number",
    "demo --steps many": "--steps: 'many' is not a whole number",
    "demo --mode foo": "--mode: invalid choice: 'foo'",
    "plan --params abc --gpus 8": "'abc' is not a parameter count",
    "plan --params 8B --gpus 8 --tp 3": "learner_gpus=4 is not a multiple of tp*pp*cp=3",
    "plan --params 8B --gpus 8 --learner-gpus 9": "learner_gpus=9 must be in 1..gpus-1=7",
    "plan --params 8B": "the following arguments are required: --gpus",
    "simulate --modes foo": "'foo' is not among sync, async, fully_async, thundersync",
    "simulate --modes sync,bar": "'bar' is not among",
    "simulate --trace /no/such/trace.jsonl": "/no/such/trace.jsonl is not a file",
    "simulate --preset scale --gpus 7": "does not fit 3 learner GPUs",
    "simulate --steps 1": "steps=1 must exceed warmup_steps=1",
    "simulate --gpus 0": "0 is not a positive whole number",
    "recipes chek": "expected the subcommand 'check'",
    "recipes check --root /no/such/folder": "is not a folder",
    "frobnicate": "invalid choice: 'frobnicate'",
}


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("argv", sorted(BAD))
def test_a_bad_argument_is_one_line_and_exit_2(argv, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "thundersync_verl.demo", None)  # a bad demo must not get as far as importing it
    code = _run(argv.split())
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and BAD[argv] in lines[0], err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("argv", ["recipes check --help", "plan --help", "simulate --help", "demo --help", "--help"])
def test_help_is_help(argv, capsys):
    assert _run(argv.split()) == 0
    assert "usage: thundersync" in capsys.readouterr().out


def test_good_arguments_still_run(capsys):
    assert main("plan --params 8B --gpus 16 --steps 4".split()) == 0
    assert "open groups" in capsys.readouterr().out
    assert main("simulate --modes sync,thundersync --steps 4 --json".split()) == 0
    summaries = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(k.split("/")[0] for k in summaries) == ["sync", "thundersync"]
