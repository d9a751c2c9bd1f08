"""The CLI: bad input gives exit 2 and one `error:` line (no traceback); help and --show-args.

Each bad input goes through `areal_kit.cli.main([...])`; a few also through the installed
`areal-kit` script in a subprocess, which is what users run. --show-args also runs there with
its stdout piped (every row whole, as markdown), as JSON, and on a pseudo-terminal (a rich table).

    .venv/bin/python -m pytest tests/unit/test_cli.py -q
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_kit.cli import main
from areal_kit.config.loader import all_keys

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".venv" / "bin" / "areal-kit"


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AREAL_DEVICE", raising=False)
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):  # rich would take captured output for a terminal
        monkeypatch.delenv(name, raising=False)


def run(args, capsys):
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code, out, err, expected):
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err + out


def spec_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


GOOD_SPEC = {"cluster_type": "local", "cluster_name": "c", "fileroot": "/tmp/fr",
             "default_mount": "/storage:/storage", "n_gpus_per_node": 8}

# (argv, substring of the one error line). {tmp} is replaced by the test's tmp_path.
BAD_INPUTS = [
    # unknown presets
    (["train", "nosuch"], "unknown preset 'nosuch'; expected one of 1.5B_1gpu, 1.5B_n1, 1.5B_n16, 1.5B_n1_dapo, 1.5B_n4, 7B_n16, 7B_n1_lora, 7B_n4, tiny, tiny_dapo, tiny_lora, tiny_storage, tiny_tool or a path"),
    (["train", "1.5B_n8", "--dry-run"], "unknown preset '1.5B_n8'"),
    (["train", "{tmp}/missing.yaml"], "unknown preset"),
    # bad overrides
    (["train", "tiny", "actor.lrr=1"], "unknown config key 'actor.lrr'; did you mean 'actor.lr'?"),
    (["train", "tiny", "ppo.gen.max_new_token=8"], "did you mean 'ppo.gen.max_new_tokens'?"),
    (["train", "tiny", "ppo.kl_estimatr=k2"], "did you mean 'ppo.kl_estimator'?"),
    (["train", "tiny", "actor.lr=abc"], "actor.lr='abc' is not valid; expected float"),
    (["train", "tiny", "ppo.group_size=two"], "ppo.group_size='two' is not valid; expected int"),
    (["train", "tiny", "ppo.adv_norm=maybe"], "expected bool"),
    (["train", "tiny", "noequals"], "override 'noequals' is not key=value"),
    (["train", "tiny", "ppo.kl_estimator=k4"], "ppo.kl_estimator='k4' is not valid; expected one of k1, k2, k3"),
    (["train", "tiny", "ppo.eps_clip=1.5"], "ppo.eps_clip=1.5 is not valid"),
    (["train", "tiny", "ppo.group_size=1"], "a group of 1 has no baseline"),
    (["train", "tiny_tool", "agent.fn=areal_kit.agents.calculator:openai_agent"],
     ("agent.fn='areal_kit.agents.calculator:openai_agent' and ppo.workflow='areal_kit.agents.calculator:calculator' "
      "are both set; expected one")),
    (["train", "tiny", "agent.fn=x:y", "agent.timeout_s=0"], "agent.timeout_s=0.0 is not valid; expected > 0"),
    (["train", "tiny", "dataset.toy_task=cubes"], "dataset.toy_task='cubes' is not valid; expected one of sums, calc"),
    (["train", "tiny", "recover_mode=always"], "recover_mode='always' is not valid"),
    (["train", "tiny", "actor_train.mb_spec.max_tokens_per_mb=10"], "is smaller than one sequence"),
    (["train", "tiny", "experiment_name=a/b"], "experiment_name='a/b' is not valid"),
    # bad allocation strings
    (["train", "tiny", "allocation_mode=d2m1p1x"], "'d2m1p1x' is not a parallel strategy"),
    (["train", "tiny", "allocation_mode=d1d1"], "repeats a letter"),
    (["train", "tiny", "allocation_mode=d0m1p1"], "has a zero"),
    (["train", "tiny", "allocation_mode=sglang.d1p1m1+d1p1m1"], "generation backend 'sglang' is not supported"),
    (["train", "tiny", "allocation_mode=vllm.d1p1m1"], "expected vllm.GEN+TRAIN"),
    (["train", "tiny", "allocation_mode=vllm.d1p2m1+d1p1m1"], "generation pipeline parallel p2"),
    (["train", "tiny", "allocation_mode=actor_gen:d2,critic:d2"], "unknown role 'critic'"),
    (["train", "tiny", "allocation_mode="], "allocation_mode is empty"),
    # wrong GPU products, with the arithmetic
    (["train", "1.5B_n4", "n_nodes=3", "--dry-run"],
     "vllm.d16p1m1+d8p2m1 needs 16+16=32 GPUs, cluster has 3x8=24"),
    (["train", "7B_n16", "n_gpus_per_node=4", "--dry-run"],
     "vllm.d16p1m4+d32p2m1 needs 64+64=128 GPUs, cluster has 16x4=64"),
    (["train", "1.5B_n1", "allocation_mode=d4m1p1", "--dry-run"], "d4m1p1 needs 4 GPUs, cluster has 1x8=8"),
    (["train", "tiny", "allocation_mode=d3m1p1"], "d3m1p1 needs 3 GPUs, cluster has 1x2=2"),
    # malformed cluster spec files
    (["train", "tiny", "cluster={tmp}/nope.json", "--dry-run"], "nope.json: file not found"),
    (["train", "tiny", "cluster={tmp}/s_trunc.json", "--dry-run"], "invalid JSON at line 1"),
    (["train", "tiny", "cluster={tmp}/s_list.json", "--dry-run"], "expected a mapping of fields at the top level"),
    (["train", "tiny", "cluster={tmp}/s_type.json", "--dry-run"], "cluster_type: expected one of local, ray, slurm"),
    (["train", "tiny", "cluster={tmp}/s_gpus.json", "--dry-run"], "n_gpus_per_node: expected a non-negative integer"),
    (["train", "tiny", "cluster={tmp}/s_field.json", "--dry-run"], "unknown field 'bogus'"),
    (["train", "tiny", "cluster={tmp}/s_root.json", "--dry-run"], "fileroot: expected an absolute path"),
    (["train", "tiny", "cluster={tmp}/s_port.json", "--dry-run"], "port: expected an integer 1-65535"),
    (["train", "tiny", "cluster={tmp}/s_8gpu.json", "--dry-run"],
     "has n_gpus_per_node=8 but the config has n_gpus_per_node=2"),
    # malformed preset files
    (["train", "{tmp}/p_key.yaml", "--dry-run"], "unknown config key 'actor.lrr'; did you mean 'actor.lr'?"),
    (["train", "{tmp}/p_syntax.yaml", "--dry-run"], "not valid YAML at line 2"),
    (["train", "{tmp}/p_inherit.yaml", "--dry-run"], "inherit: unknown preset 'nosuch'"),
    # usage errors from the command line parser
    (["train"], "Missing argument"),
    (["train", "tiny", "--bogus"], "No such option: --bogus"),
    (["train", "tiny", "--dry-run=3"], "does not take a value"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
    (["train", "tiny", "--json"], "--json goes with --show-args"),
    # a run on a cluster's head (tests/unit/test_train_cluster.py has the rest)
    (["train", "tiny", "--train-wait", "5"], "--train-wait goes with --cluster"),
    (["train", "tiny", "--cluster", "lab", "--train-wait", "-1"], "Invalid value for '--train-wait'"),
    (["train", "tiny", "--cluster", "lab", "--json"], "--json goes with --show-args"),
    # a job for Slurm (tests/unit/test_slurm.py, tests/cluster/test_slurm_cluster.py have the rest)
    (["train", "tiny", "--partition", "gpu"], "--partition goes with --slurm"),
    (["train", "tiny", "--sbatch-arg", "--qos=high"], "--sbatch-arg goes with --slurm"),
    (["train", "tiny", "--slurm", "--cluster", "lab"], "--slurm and --cluster: pick one"),
    (["train", "tiny", "--slurm", "--time", "soon", "--dry-run"], "--time 'soon': expected sbatch's form"),
    (["train", "tiny", "--slurm", "--container", "x.sif", "--container-runtime", "docker", "--dry-run"],
     "--container-runtime 'docker': expected one of apptainer, pyxis"),
    (["train", "tiny", "--slurm", "--sbatch-arg", "qos=high", "--dry-run"], "expected one sbatch option"),
    (["train", "tiny", "--slurm", "--signal-grace", "5"], "Invalid value for '--signal-grace'"),
    (["doctor", "--partition", "gpu"], "--partition and --storage go with --slurm"),
]


@pytest.fixture
def bad_files(tmp_path):
    files = {
        "s_trunc.json": '{"cluster_type": "local"',
        "s_list.json": "[1, 2]",
        "s_type.json": json.dumps({**GOOD_SPEC, "cluster_type": "pbs"}),
        "s_gpus.json": json.dumps({**GOOD_SPEC, "n_gpus_per_node": "eight"}),
        "s_field.json": json.dumps({**GOOD_SPEC, "bogus": 1}),
        "s_root.json": json.dumps({**GOOD_SPEC, "fileroot": "relative/path"}),
        "s_port.json": json.dumps({**GOOD_SPEC, "hosts": [{"hostname": "h", "port": 70000}]}),
        "s_8gpu.json": json.dumps(GOOD_SPEC),
        "p_key.yaml": "inherit: tiny\nactor:\n  lrr: 1\n",
        "p_syntax.yaml": "actor: [\n",
        "p_inherit.yaml": "inherit: nosuch\n",
    }
    for name, text in files.items():
        spec_file(tmp_path, name, text)
    return tmp_path


@pytest.mark.parametrize("argv,expected", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_one_line_exit_2(argv, expected, bad_files, capsys):
    argv = [a.replace("{tmp}", str(bad_files)) for a in argv]
    code, out, err = run(argv, capsys)
    assert_one_line_error(code, out, err, expected)
    assert out == ""  # nothing started, nothing planned


def test_at_least_20_bad_inputs():
    assert len(BAD_INPUTS) >= 20


@pytest.mark.parametrize("argv,expected", [
    (["train", "tiny", "actor.lrr=1"], "did you mean 'actor.lr'?"),
    (["train", "1.5B_n4", "n_nodes=3", "--dry-run"], "needs 16+16=32 GPUs, cluster has 3x8=24"),
    (["train", "tiny", "--bogus"], "No such option: --bogus (see: areal-kit train --help)"),
    (["train", "nosuch"], "unknown preset 'nosuch'"),
])
@pytest.mark.slow
def test_bad_input_through_the_installed_script(argv, expected, tmp_path):
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} not installed (run bash .ci/install.sh)")
    env = {k: v for k, v in os.environ.items() if k != "AREAL_DEVICE"}
    r = subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True, cwd=tmp_path, env=env, check=False,
                       timeout=120)
    assert_one_line_error(r.returncode, r.stdout, r.stderr, expected)


def test_python_m_entry_point_names_the_program(tmp_path):
    r = subprocess.run([sys.executable, "-m", "areal_kit.cli", "train", "tiny", "--bogus"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert_one_line_error(r.returncode, r.stdout, r.stderr, "(see: areal-kit train --help)")


def test_no_arguments_shows_help(capsys):
    code, out, err = run([], capsys)
    assert code == 2
    assert "Traceback" not in out + err
    assert "train" in out + err
    assert "setup" in out + err


@pytest.mark.parametrize("sub", ["setup", "train", "eval", "filter", "status", "down", "logs", "plot"])
def test_every_subcommand_has_help(sub, capsys):
    code, out, err = run([sub, "--help"], capsys)
    assert code == 0, err
    assert "Usage:" in out
    assert f"areal-kit {sub}" in out


def test_train_help_lists_every_preset_file(capsys, monkeypatch):
    """The presets in `areal-kit train --help` are the YAML files in train_scripts/ (a `_`-file is a base)."""
    monkeypatch.setenv("COLUMNS", "1000")  # the list on one line
    code, out, err = run(["train", "--help"], capsys)
    assert code == 0, err
    listed = re.search(r"train_scripts/ \(([^)]*)\) or a path", out)
    assert listed, out
    files = sorted(p.stem for p in (ROOT / "train_scripts").glob("*.yaml") if not p.name.startswith("_"))
    assert len(files) >= 12
    assert listed[1].split(", ") == files


def test_show_args_lists_every_key_with_value_and_help(capsys):
    code, out, err = run(["train", "1.5B_n4", "--show-args", "ppo.gen.max_new_tokens=8192"], capsys)
    assert code == 0, err
    rows = table_rows(out)
    missing = [k for k in all_keys() if k not in rows]
    assert missing == [], f"keys without a row: {missing}"
    assert rows["ppo.gen.max_new_tokens"] == ["8192", "Most tokens generated per answer."]
    assert rows["ppo.kl_ctl"][0] == "0.001", rows["ppo.kl_ctl"]
    assert rows["ppo.kl_ctl"][1].startswith("KL coefficient"), rows["ppo.kl_ctl"]


def table_rows(out: str) -> dict[str, list[str]]:
    """key -> [value, help] of the markdown rows --show-args prints off a terminal."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and line.endswith(" |"):
            cells = [c.strip() for c in line[2:-2].split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


def areal_kit(args, cwd, **env) -> str:
    """The installed script's stdout, read through a pipe (not a terminal), with no terminal hints."""
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} not installed (run bash .ci/install.sh)")
    base = {k: v for k, v in os.environ.items()
            if k not in ("AREAL_DEVICE", "COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")}
    r = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, env={**base, **env},
                       check=False, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr}"
    return r.stdout


@pytest.mark.slow
def test_show_args_in_a_pipe_keeps_every_row_whole(tmp_path):
    out = areal_kit(["train", "tiny", "--show-args"], tmp_path)
    assert "…" not in out, "a cell was cut with an ellipsis"
    assert "\x1b[" not in out, "colour codes in a pipe"
    keys = all_keys()
    longest = max(keys, key=len)
    for key in ("ppo.max_head_offpolicyness", longest):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"| {key} ")), None)
        assert line is not None, f"no row starts with the whole key {key}"
        help_ = keys[key].metadata["help"].replace("|", "\\|")
        assert line.endswith(f"| {help_} |"), f"the help of {key} is not whole on its row: {line}"
    missing = [k for k in keys if k not in table_rows(out)]
    assert missing == [], f"keys without a row: {missing}"


@pytest.mark.slow
def test_show_args_json_has_every_option_and_the_overrides(tmp_path):
    out = areal_kit(["train", "tiny", "--show-args", "--json", "ppo.gen.max_new_tokens=2", "actor.lr=2e-6",
                     "ppo.reward_fns=[toy,math]", "experiment_name=piped"], tmp_path)
    options = json.loads(out)
    by_key = {o["key"]: o for o in options}
    missing = [k for k in all_keys() if k not in by_key]
    assert missing == [], f"keys missing from the JSON: {missing}"
    no_field = [o["key"] for o in options if not {"key", "value", "type", "default", "help"} <= set(o)]
    assert no_field == [], f"options without key, value, type, default or help: {no_field}"
    given = {"ppo.gen.max_new_tokens": 2, "actor.lr": 2e-6, "ppo.reward_fns": ["toy", "math"],
             "experiment_name": "piped"}
    for key, value in given.items():
        assert by_key[key]["value"] == value, f"{key}: printed {by_key[key]['value']!r}, given {value!r}"
    assert by_key["ppo.kl_estimator"]["choices"] == ["k1", "k2", "k3"], by_key["ppo.kl_estimator"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a pseudo-terminal")
def test_show_args_on_a_terminal_is_a_rich_table(tmp_path):
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} not installed (run bash .ci/install.sh)")
    env = {k: v for k, v in os.environ.items() if k not in ("AREAL_DEVICE", "NO_COLOR", "FORCE_COLOR")}
    cmd = shlex.join([str(SCRIPT), "train", "tiny", "--show-args"])
    r = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, cwd=tmp_path,
                       env={**env, "COLUMNS": "100"}, check=False, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout[-2000:]}"
    assert "│" in r.stdout, "no rich table borders on a terminal"
    assert "| --- |" not in r.stdout, "markdown rows on a terminal"
    assert "ppo.max_head_offpolicyness" in r.stdout, "a key was cut on a 100-column terminal"


def test_a_failed_run_is_one_line_exit_1(capsys, monkeypatch):
    """A run that started and failed (not bad input): exit 1, one `error:` line, no traceback."""
    from areal_kit.errors import RunFailed
    from areal_kit.rl.driver import launch

    def failing(cfg, fresh=False, discard=False):
        try:
            raise ValueError("kv cache larger than memory")
        except ValueError as e:
            raise RunFailed("run tiny/run0 failed: RolloutWorker.setup: ValueError: kv cache larger than memory "
                            "(traceback in /x/train.log)") from e

    monkeypatch.setattr(launch, "launch", failing)
    code, out, err = run(["train", "tiny"], capsys)
    assert code == 1
    assert out == ""
    assert err == ("error: run tiny/run0 failed: RolloutWorker.setup: ValueError: kv cache larger than memory "
                   "(traceback in /x/train.log)\n")


def test_discard_deletes_only_beside_fresh(capsys, monkeypatch):
    """--discard alone is refused before anything runs (it would delete a run's progress without the
    --fresh that says to start over); --fresh --discard reaches the launch."""
    from areal_kit.rl.driver import launch

    got = []
    monkeypatch.setattr(launch, "launch", lambda cfg, fresh=False, discard=False: got.append((fresh, discard)) or 0)
    for argv in (["train", "tiny", "--discard"], ["train", "tiny", "--slurm", "--discard"]):
        code, out, err = run(argv, capsys)
        assert code == 2 and out == ""
        assert err.startswith("error: --discard goes with --fresh (areal-kit train PRESET --fresh --discard deletes ")
        assert len(err.strip().splitlines()) == 1
    assert got == []
    code, _, err = run(["train", "tiny", "--fresh", "--discard"], capsys)
    assert (code, got) == (0, [(True, True)]), err


def test_sigterm_and_ctrl_c_exit_codes(capsys, monkeypatch):
    """SIGTERM (Interrupted) exits 143 and Ctrl-C 130, each saying so (typer alone would turn Ctrl-C
    into a silent 130)."""
    from areal_kit.interrupts import Interrupted
    from areal_kit.rl.driver import launch

    for exc, code, said in ((Interrupted("SIGTERM", 143), 143, "interrupted (SIGTERM)\n"),
                            (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)\n")):
        def interrupted(cfg, fresh=False, discard=False, exc=exc):
            raise exc

        monkeypatch.setattr(launch, "launch", interrupted)
        got, _, err = run(["train", "tiny"], capsys)
        assert (got, err.strip()) == (code, said.strip())


def test_every_command_summary_is_one_line():
    """The command list shows a docstring's first paragraph as typed: a summary that wraps in the
    source shows a line break in the middle of a sentence."""
    import typer

    from areal_kit.cli import app

    group = typer.main.get_command(app)
    assert set(group.commands) >= {"setup", "train", "eval", "filter", "down", "logs", "plot"}
    for name, command in group.commands.items():
        summary = command.help.strip().split("\n\n")[0]
        assert "\n" not in summary, f"{name}: {summary!r}"
