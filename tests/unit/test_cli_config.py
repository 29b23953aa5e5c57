"""``commrt config`` (issue 31 items 4-6) and the CLI's start-up (issue 31 item 5)."""
import os
import pathlib
import subprocess
import sys

import pytest

from commrt import cli
from commrt.runtime.config import load_config, markdown_env_table, unknown_variables

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(capsys, *argv):
    code = cli.main(["config", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_prints_every_section_as_toml_with_sources_and_round_trips(tmp_path, capsys, monkeypatch):
    from commrt.train.config import TrainConfig
    f = tmp_path / "c.toml"
    f.write_text('[comm]\nbackend = "gloo"\n[train.zero_optimization]\nstage = 3\nzero_hpz_partition_size = 2\n')
    monkeypatch.setenv("COMMRT_QUANT_PIECES", "2")
    code, out, _ = _config(capsys, str(f))
    assert code == 0
    for header in ("[comm]", "[cluster]", "[security]", "[ps]", "[quant]", "[log]", "[train]",
                   "[train.zero_optimization]", "[train.optimizer]"):
        assert f"\n{header}\n" in out, header
    assert f'backend = "gloo"  # file {f}' in out and "pieces = 2  # environment COMMRT_QUANT_PIECES" in out
    assert "timeout_s = 300.0  # default" in out and f"zero_hpz_partition_size = 2  # file {f}" in out
    again = tmp_path / "again.toml"
    again.write_text(out)  # the output is a config file that means the same
    monkeypatch.delenv("COMMRT_QUANT_PIECES")
    assert load_config(again) == load_config(f, environ={"COMMRT_QUANT_PIECES": "2"})
    assert TrainConfig.from_dict(tomllib.loads(out)["train"]) == TrainConfig.from_dict(tomllib.loads(f.read_text())["train"])


def test_strings_beyond_the_basic_plane_round_trip(tmp_path, capsys):
    """Found in review C: strings were rendered with json.dumps, whose escapes for characters
    beyond U+FFFF are UTF-16 surrogate pairs ("\\ud83d\\ude00"), which TOML refuses: the output
    of ``commrt config`` for a path with such a character was not a config file at all."""
    f = tmp_path / "c.toml"
    f.write_text('[log]\ntrace_file = "/runs/\U0001F600/\U00020000.json"\n', encoding="utf-8")
    code, out, _ = _config(capsys, str(f))
    assert code == 0
    again = tmp_path / "again.toml"
    again.write_text(out, encoding="utf-8")
    assert load_config(again, environ={}) == load_config(f, environ={})


def test_validates_train_and_says_where_a_bad_value_came_from(tmp_path, capsys, monkeypatch):
    f = tmp_path / "c.toml"
    f.write_text("[train.zero_optimization]\nstag = 3\n")
    code, _, err = _config(capsys, str(f))
    assert code == 1 and "unknown key(s) ['stag'] in zero_optimization" in err and str(f) in err
    monkeypatch.setenv("COMMRT_COMM_BACKEND", "mpi")
    code, _, err = _config(capsys)
    assert code == 1 and "from the environment variable COMMRT_COMM_BACKEND" in err


def test_unknown_commrt_variables_warn_or_fail_under_strict(capsys, monkeypatch):
    monkeypatch.setenv("COMMRT_COMM_BAKEND", "zmq")
    code, out, err = _config(capsys)
    assert code == 0 and "warning: COMMRT_COMM_BAKEND is set but no setting reads it" in err and "[comm]" in out
    code, out, err = _config(capsys, "--strict")
    assert code == 2 and "error: COMMRT_COMM_BAKEND" in err and out == ""


def test_every_commrt_variable_the_code_reads_is_known():
    """A COMMRT_* name read anywhere in the shipped code (commrt/, deploy/) is a setting or listed
    in OTHER_VARIABLES, so `commrt config` does not call it misspelt and the README's table has
    it (COMMRT_FT_STORE, read by apps/train_lm.py, was warned about as 'no setting reads it')."""
    import re
    names = set()
    for folder in ("commrt", "deploy"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".sbatch", ".yaml", ".toml"):
                names |= set(re.findall(r"COMMRT_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    from commrt.runtime.config.env import OTHER_VARIABLES, RESERVED_PREFIXES, setting_variables
    known = [*setting_variables(), *OTHER_VARIABLES, *RESERVED_PREFIXES]
    stems = {n for n in names if any(k.startswith(n + "_") for k in known)}  # prefixes in f-strings
    names -= stems | {"COMMRT_COMM_BAKEND"}  # env.py's example of a misspelling
    assert unknown_variables({n: "" for n in names}) == [], "add them to env.OTHER_VARIABLES"


def test_readme_env_table_is_the_generated_one():
    """The README's table is `commrt config --env-table`'s output, character for character."""
    table = markdown_env_table()
    assert "`COMMRT_COMM_INTRA_NODE`" in table and "`COMMRT_QUANT_PIECES`" in table
    assert table in (ROOT / "README.md").read_text(), "regenerate it: commrt config --env-table"


def _fresh(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize("argv", [["--help"], ["launch", "--help"], ["bench", "--help"], ["config", "--help"]])
def test_help_imports_no_subcommand_code(argv):
    """Building the parser imports no command's machinery (the launcher's ranks, the benchmark,
    the parameter server): only what `import commrt` itself loads."""
    proc = _fresh("import sys, commrt; before = set(sys.modules)\n"
                  "from commrt import cli\n"
                  f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
                  "new = sorted(m for m in set(sys.modules) - before if m.startswith('commrt.'))\n"
                  "heavy = [m for m in new if m.startswith(('commrt.bench.runner', 'commrt.ps.', 'commrt.emulate'))]\n"
                  "print('HEAVY', heavy)")
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("argv", [["--help"], *[[c, "--help"] for c in
                                  ("launch", "bench", "config", "server", "server-status", "keygen", "estimate")]])
def test_help_does_not_import_torch(argv):
    """Issue 31 item 5: help answers at once (torch alone took 1.4 s of 1.9)."""
    proc = _fresh("import sys\nfrom commrt import cli\ntry:\n"
                  f"    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
                  "print('TORCH', 'torch' in sys.modules)")
    assert "TORCH False" in proc.stdout, proc.stdout + proc.stderr


def test_import_commrt_registers_the_torch_backend_before_or_after_torch():
    """The README's promise survives the lazy front door: ``import commrt`` registers "commrt"
    with torch.distributed whether torch was loaded first or comes later."""
    for code in ("import commrt, torch.distributed as d", "import torch, commrt, torch.distributed as d"):
        proc = _fresh(code + "\nprint('REGISTERED', 'COMMRT' in d.Backend._plugins)")
        assert "REGISTERED True" in proc.stdout, (code, proc.stdout + proc.stderr)


def test_a_misspelt_bench_backend_fails_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "all_reduce", "--backend", "zmq,glooo"])
    assert "--backend 'glooo' is invalid; valid: ['zmq', 'gloo', 'nccl']" in str(info.value)


def test_every_option_says_what_it_does():
    """Issue 31 item 5: no option without a description (estimate's are commrt/plan's)."""
    import argparse
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {a.option_strings or a.dest}" for name, p in subs.choices.items() if name != "estimate"
            for a in p._actions if not a.help and not isinstance(a, argparse._HelpAction)]
    assert not bare, bare
    assert "``" not in parser.format_help() and ":class:" not in parser.format_help()
