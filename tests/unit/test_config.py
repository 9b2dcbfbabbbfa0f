import dataclasses
import json
import os
import re
import subprocess
import sys

import paths
import pytest

from deadpool_hpc.config import RunConfig, parse_train_arg
from deadpool_hpc.faultinject.spec import Fault, parse_fault
from deadpool_hpc.errors import ConfigError
from deadpool_hpc.train.demo import DemoConfig


def test_parse_fault():
    assert parse_fault("kill", "node1@60") == Fault("kill", "node", 1, 60)
    assert parse_fault("hang", "rank2@7").target == "rank2"
    with pytest.raises(ConfigError, match="nodeN@STEP"):
        parse_fault("kill", "node1-60")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(nodes=0), "--nodes 0"),
    (dict(spares=-1), "--spares -1"),
    (dict(steps=0), "--steps 0"),
    (dict(faults=[Fault("kill", "node", 7, 10)]), "unknown fault target node7"),
    (dict(faults=[Fault("kill", "rank", 3, 10)]), "unknown fault target rank3"),
    (dict(faults=[Fault("kill", "node", 1, 200)]), "past --steps"),
    (dict(spares=1, faults=[Fault("kill", "node", 1, 10), Fault("kill", "node", 2, 20)]), "only 1 spare"),
    (dict(nodes=1, spares=1), "at least 2 active nodes"),
    (dict(train_args={"lr": float("nan")}), r"--train-arg lr=nan: accepted"),
    (dict(train_args={"layers": [1, 2]}), r"--train-arg layers=\[1, 2\]: accepted"),
    (dict(train_args={"n-layer": 2}), r"--train-arg 'n-layer': accepted"),
    (dict(max_requeues=-1), "max_requeues -1"),
    (dict(interleave_replication=-2), "interleave_replication -2: accepted"),
    (dict(interleave_replication=4, replicate=False), "needs replication on and no faults"),
    (dict(interleave_replication=4, faults=[Fault("kill", "node", 1, 10)]), "needs replication on and no faults"),
])
def test_bad_layouts_name_the_value(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        RunConfig(**{**dict(nodes=3, spares=1, steps=100), **kwargs}).validate()


def test_json_roundtrip():
    cfg = RunConfig(nodes=2, spares=1, steps=5, faults=[Fault("hang", "rank", 1, 3)],
                    train_args={"n_layer": 3, "lr": 1e-3, "name": "x", "flag": True}).validate()
    back = RunConfig.from_json(cfg.to_json())
    assert back == cfg and back.train_args == {"n_layer": 3, "lr": 1e-3, "name": "x", "flag": True}


def test_parse_train_arg():
    assert parse_train_arg("n_layer=4") == ("n_layer", 4)
    assert parse_train_arg("lr=3e-3") == ("lr", 3e-3)
    assert parse_train_arg("flag=True") == ("flag", True) and parse_train_arg("flag=false") == ("flag", False)
    assert parse_train_arg("name=tiny=1") == ("name", "tiny=1")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_train_arg("n_layer")


def test_demo_config_defaults_and_errors():
    # a failure-free run's parameters depend on these: they are the values RunConfig carried before
    assert DemoConfig.from_args({}) == DemoConfig(batch_size=8, context=128, n_layer=2, n_head=4, d_model=128,
                                                  lr=3e-3, warmup_steps=20, seed=1337)
    assert DemoConfig.from_args({"lr": 1, "n_layer": 3}) == DemoConfig(lr=1.0, n_layer=3)
    with pytest.raises(ValueError, match=r"n_layr: not a setting of the demo; accepted: batch_size, .*seed"):
        DemoConfig.from_args({"n_layr": 3})
    with pytest.raises(ValueError, match=r"d_model=130 is not divisible by n_head=4"):
        DemoConfig.from_args({"d_model": 130})
    with pytest.raises(ValueError, match=r"batch_size='8': accepted: an integer >= 1"):
        DemoConfig.from_args({"batch_size": "8"})


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "0"], "--nodes 0"),
    (["--kill", "node9@10"], "unknown fault target node9"),
    (["--kill", "node1@500"], "past --steps"),
    (["--kill", "node1@10", "--kill", "node2@20"], "only 1 spare"),
    (["--lr", "-1"], "--train-arg lr=-1.0: accepted"),
    (["--train-arg", "n_layr=3"], "--train-arg n_layr: not a setting of the demo; accepted: batch_size"),
    (["--train-arg", "n_layer"], "accepted: KEY=VALUE"),
    (["--train-fn", "nosuch.module:train"], "cannot import 'nosuch.module'"),
    (["--train-fn", "deadpool_hpc.train.demo:nosuch"], "has no function 'nosuch'"),
    (["--nodes", "40", "--ranks-per-node", "2"], "the local launcher (deadpool run) runs at most 64"),
    (["--slow", "node1@first"], "--slow 'node1@first' is not a slow-node spec; accepted: nodeN@startup[:FACTOR]"),
    (["--slow", "node1@500:2"], "past --steps"),
    (["--straggler-factor", "1"], "--straggler-factor 1.0: accepted: a number > 1"),
    (["--straggler-factor", "0.5"], "--straggler-factor 0.5: accepted: a number > 1"),
    (["--straggler-window", "0"], "--straggler-window 0.0: accepted: seconds > 0"),
    (["--straggler-window", "-5"], "--straggler-window -5.0: accepted: seconds > 0"),
    (["--slow", "node1@startup:1"], "factor '1': accepted: a number > 1"),
    (["--slow", "node7@build"], "unknown fault target node7"),
    (["--slow", "node1@build", "--slow", "node2@startup"], "only 1 spare"),   # a slow node is replaced: a loss
    (["--preflight-factor", "0.5"], "--preflight-factor 0.5: accepted: a number > 1"),
    (["--nic-down", "rank1"], "--nic-down 'rank1' is not a node; accepted: nodeN"),
    (["--nic-down", "node5"], "unknown fault target node5"),
    (["--nic-down", "node1", "--preflight-factor", "0"], "--nic-down node1 with --preflight-factor 0"),
    (["--nic-down", "node1", "--kill", "node2@startup"], "only 1 spare"),   # a node whose data plane is down: a loss
    (["--nic-down", "node1@10"], "--nic-down node1@10: from a step on, only an idle spare's interface goes down"),
    (["--nic-down", "node3@10", "--spare-check-every", "0"], "accepted: node3..node3 with --spare-check-every > 0"),
    (["--spare-check-every", "-1"], "--spare-check-every -1.0: accepted: seconds >= 0"),
    (["--crash-loop-limit", "-1"], "--crash-loop-limit: '-1': accepted: an integer >= 0"),
    (["--crash-loop-limit", "two"], "--crash-loop-limit: 'two': accepted: an integer >= 0"),
    (["--crash-loop-limit", "1.5"], "--crash-loop-limit: '1.5': accepted: an integer >= 0"),
    (["--resume"], "--resume: "),
    (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi' (choose from 'auto', 'nccl', 'gloo')"),
])
def test_cli_rejects_bad_input_with_exit_2_before_starting(tmp_path, capsys, args, needle):
    """In process (the CLI's own ``main``; test_cli_hang_timeout_0_exits_2_from_the_command checks the exit status
    of the command itself): pure argument checking, no process may start."""
    from deadpool_hpc.launch.cli import main

    run_dir = tmp_path / "run"
    try:   # argparse keeps the last value of a repeated option, so the test's own --nodes wins
        code = main(["run", "--run-dir", str(run_dir), "--nodes", "3", "--spares", "1", "--steps", "100", *args])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err
    assert not run_dir.exists(), "no process may start (and no run dir be made) on bad input"


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", ""])
def test_cli_hang_timeout_refuses_what_is_not_seconds_or_off(tmp_path, capsys, value):
    """--hang-timeout takes seconds > 0 or the word off: anything else exits 2 (argparse's usage error, as every
    ill-typed option) with a message naming the value and what is accepted, before anything runs."""
    from deadpool_hpc.launch.cli import main

    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["run", "--run-dir", str(run_dir), "--nodes", "2", "--spares", "1", "--hang-timeout", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert f"argument --hang-timeout: {value!r}: accepted: seconds > 0 (e.g. 120), or off" in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("value, seconds", [("off", 0.0), ("OFF", 0.0), ("120", 120.0), ("2.5", 2.5)])
def test_cli_hang_timeout_off_turns_hang_detection_off(tmp_path, value, seconds):
    import argparse

    from deadpool_hpc.launch.options import add_run_options, config_from_args

    p = argparse.ArgumentParser()
    add_run_options(p)
    a = p.parse_args(["--run-dir", str(tmp_path / "run"), "--hang-timeout", value])
    assert a.hang_timeout == seconds
    if seconds == 0.0 or seconds >= RunConfig().timeouts.heartbeat_deadline:
        assert config_from_args(a).timeouts.hang_timeout == seconds  # 0.0: RunConfig's "off"


@pytest.mark.e2e
def test_cli_hang_timeout_0_exits_2_from_the_command(tmp_path):
    """The same through the installed entry point's module (a process: the exit status a user sees)."""
    p = subprocess.run([sys.executable, "-m", "deadpool_hpc.launch.cli", "run", "--run-dir", str(tmp_path / "run"),
                        "--hang-timeout", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--hang-timeout: '0': accepted: seconds > 0 (e.g. 120), or off" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_the_64_process_cap_is_the_local_launchers_only():
    """A Slurm job of 512 nodes x 8 is a valid layout; only the local launcher refuses more than 64 processes."""
    cfg = RunConfig(nodes=512, spares=8, ranks_per_node=8, steps=10).validate()
    assert cfg.layout.total_processes == 520 * 8


def test_interleaved_replication_alternates_blocks_of_steps():
    """benchmarks/overhead.py's within-run estimator: steps 0..K-1 replicate, K..2K-1 do not, and so on."""
    from deadpool_hpc.worker.steps import StepSequence

    def on(cfg, steps):
        seq = StepSequence(world_size=1, replicate=cfg.replication.replicate, interleave=cfg.internal.interleave_replication,
                           wait_timeout=1.0, generation=lambda: 0, failure=None, watch=None, beat=lambda: None)
        return [seq.replicating(s) for s in steps]

    assert on(RunConfig(interleave_replication=3), range(8)) == [True] * 3 + [False] * 3 + [True] * 2
    assert on(RunConfig(), range(4)) == [True] * 4
    assert on(RunConfig(replicate=False), range(4)) == [False] * 4


def test_slow_node_specs_parse():
    from deadpool_hpc.faultinject.spec import SLOW_FACTOR

    assert parse_fault("slow", "node2@build:12") == Fault("slow", "node", 2, None, "build", 1, 12.0)
    f = parse_fault("slow", "node1@startup")
    assert (f.phase, f.factor, f.at_start, str(f)) == ("startup", SLOW_FACTOR, True, f"--slow node1@startup:{SLOW_FACTOR:g}")
    assert RunConfig.from_json(RunConfig(faults=[f]).to_json()).internal.faults == [f]
    g = parse_fault("slow", "node1@40:2")   # from a step on: the straggler check's fault
    assert (g.step, g.phase, g.factor, g.at_start, str(g)) == (40, None, 2.0, False, "--slow node1@40:2")
    # not a loss in the fault plan (the straggler check may only report it): a second fault still finds the spare
    RunConfig(nodes=3, spares=1, faults=[g, parse_fault("kill", "node2@60")]).validate()
    for bad in ("rank1@startup", "node1@first", "node1@startup:x", "node1@startup:0.9", "node1@40:1"):
        with pytest.raises(ConfigError, match="--slow"):
            parse_fault("slow", bad)


def test_nic_down_specs_parse():
    from deadpool_hpc.faultinject.spec import NIC_DOWN_IFNAME

    f = parse_fault("nic_down", "node2")
    assert f == parse_fault("nic_down", "node2@startup") == Fault("nic_down", "node", 2, None, "startup")
    assert (f.at_start, str(f)) == (True, "--nic-down node2")
    assert RunConfig.from_json(RunConfig(spares=1, faults=[f]).to_json()).internal.faults == [f]
    assert NIC_DOWN_IFNAME not in os.listdir("/sys/class/net")   # an interface no machine has
    later = parse_fault("nic_down", "node4@10")
    assert later == Fault("nic_down", "node", 4, 10) and str(later) == "--nic-down node4@10"
    for bad in ("rank1", "node1@build", "node1@x", "node"):
        with pytest.raises(ConfigError, match="--nic-down"):
            parse_fault("nic_down", bad)


def test_link_check_pairs_a_ring_and_blames_only_a_node_whose_partners_passed_elsewhere():
    """agent/preflight.py's link check, the pure part: each node pairs with the node before and after it on the
    ring of the nodes it saw built; a node is blamed when every link it checked failed and one of those partners
    passed with another node."""
    from deadpool_hpc.agent.preflight import blame, link_pair_of, ring_pairs

    assert ring_pairs(2, range(5)) == [(1, 1, 2), (3, 2, 3)]
    assert ring_pairs(0, [0, 1, 2, 3, 4]) == [(1, 0, 1), (4, 0, 4)]   # the ring closes
    assert ring_pairs(4, [0, 4]) == [(0, 0, 4)]          # two nodes: one pair
    assert ring_pairs(3, [0, 2, 5, 3]) == [(2, 2, 3), (5, 3, 5)]   # a node not in the view is skipped
    assert ring_pairs(1, [0, 2]) == [] and ring_pairs(0, [0]) == []
    assert link_pair_of("link/2-13/0/view1") == (2, 13) and link_pair_of("pg/0/1") is None
    # node2 of a ring 0..4 with its interface down: its links to 1 and 3 fail; they passed with 0 and 4
    links = {1: {0: True, 2: False}, 2: {1: False, 3: False}, 3: {2: False, 4: True}}
    assert blame(links[2], links, me=2) == [1, 3]
    assert blame(links[1], links, me=1) is None and blame(links[3], links, me=3) is None
    # two nodes in all: the one link failed, and nothing says whose fault it is
    assert blame({1: False}, {1: {0: False}}, me=0) is None
    # a node between two bad ones: each partner failed every link, so it is not blamed (they are: each has a
    # partner that passed elsewhere, in a ring 0..5 with 1 and 3 bad)
    links = {0: {5: True, 1: False}, 1: {0: False, 2: False}, 2: {1: False, 3: False}, 3: {2: False, 4: False},
             4: {3: False, 5: True}}
    assert blame(links[2], links, me=2) is None
    assert blame(links[1], links, me=1) == [0, 2] and blame(links[3], links, me=3) == [2, 4]
    assert blame({}, {}, me=0) is None   # no partner came: nothing judged


def test_preflight_judges_against_the_other_nodes_median():
    """agent/preflight.py's verdict: far slower than the median of the other nodes' figures; nothing to compare
    with, or the check off, is never slow."""
    from deadpool_hpc.agent.preflight import judge

    assert judge(0.31, [0.047, 0.052, 0.049, 0.047], 3.0) == (True, 0.048)
    assert judge(0.05, [0.047, 0.31, 0.049, 0.047], 3.0) == (False, 0.048)   # a slow peer does not make us slow
    assert judge(0.14, [0.05], 3.0) == (False, 0.05)   # 2.8 x: under the factor
    assert judge(9.0, [], 3.0) == (False, None)
    assert judge(9.0, [0.05], 0) == (False, 0.05)


# ---- the sections: each one's checks, the options and parameters derived from them, the nested JSON ---------------
from deadpool_hpc import config as config_mod  # noqa: E402
from deadpool_hpc.config import SECTIONS, flat_fields, run_parameters  # noqa: E402


@pytest.mark.parametrize("section, kwargs, needle", [
    ("layout", dict(ranks_per_node=-1), "--ranks-per-node -1: accepted: 1 or more, or 0 (one per GPU of the node)"),
    ("layout", dict(backend="mpi"), "--backend 'mpi': accepted: auto, nccl or gloo"),
    ("layout", dict(nodes=1, spares=1), "hot-swap needs at least 2 active nodes"),
    ("train", dict(steps=True), "--steps True: accepted: 1 or more"),
    ("train", dict(train_args={"a b": 1}), "--train-arg 'a b': accepted"),
    ("replication", dict(replicas=3), "--replicas 3 with --nodes 3: each replica lives on another active node"),
    ("replication", dict(replica_transport=""), "--replica-transport '': accepted: a replica transport's name"),
    ("timeouts", dict(heartbeat_period=0), "--heartbeat-period 0: accepted: seconds > 0"),
    ("timeouts", dict(heartbeat_deadline=0.3), "heartbeat deadline 0.3 s: must exceed twice the period"),
    ("timeouts", dict(heartbeat_ceiling=1.5), "--heartbeat-ceiling 1.5: accepted: seconds >= 2 x the heartbeat"),
    ("timeouts", dict(hang_timeout=0.5), "--hang-timeout 0.5: accepted: off, or at least the heartbeat deadline"),
    ("timeouts", dict(startup_timeout=float("inf")), "--startup-timeout inf: accepted: seconds > 0"),
    ("preflight", dict(health_check="a\0b"), "--health-check 'a\\x00b': accepted: a shell command"),
    ("stragglers", dict(straggler_action="kill"), "--straggler-action 'kill': accepted: swap, report, off"),
    ("comeback", dict(spare_return="yes"), "spare_return 'yes': accepted: True or False"),
    ("comeback", dict(quarantine=-1), "--quarantine -1: accepted: seconds >= 0"),
    ("comeback", dict(health_check_timeout=0), "--health-check-timeout 0: accepted: seconds > 0"),
    ("persistence", dict(persist_every=float("nan")), "--persist-every nan: accepted: seconds >= 0"),
    ("persistence", dict(max_requeues=-1), "max_requeues -1: accepted: 0 or more"),
    ("output", dict(log_every=0), "--log-every 0: accepted: 1 or more"),
    ("output", dict(metrics_port=65535), "--metrics-port 65535: accepted: a TCP port 1..65531"),
    ("output", dict(metrics_textfile="/nonexistent/dir"), "--metrics-textfile '/nonexistent/dir': no such directory"),
    ("internal", dict(interleave_replication=-1), "interleave_replication -1: accepted: 0 (off) or a block"),
])
def test_each_section_names_its_bad_value_and_what_is_accepted(section, kwargs, needle):
    cfg = RunConfig(**{**dict(nodes=3, spares=1, steps=100), **kwargs})
    with pytest.raises(ConfigError, match=re.escape(needle)):
        getattr(cfg, section).validate(cfg)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        cfg.validate()


def test_flat_names_read_and_set_the_sections():
    """The flat names (the CLI's and submitit's vocabulary) read and set the sections; the lines marked for
    /work/codemod-config.py keep them, as they are what is tested."""
    cfg = RunConfig(nodes=4, straggler_factor=2.0, spare_return=False, faults=[parse_fault("kill", "node1@5")])
    assert cfg.layout.nodes == cfg.nodes == 4  # codemod: keep
    assert cfg.stragglers.factor == cfg.straggler_factor == 2.0  # codemod: keep
    assert cfg.comeback.enabled is cfg.spare_return is False  # codemod: keep
    assert cfg.internal.faults == cfg.faults  # codemod: keep
    assert cfg.layout.world_size == cfg.world_size == 4  # codemod: keep
    assert cfg.timeouts.wait_timeout == cfg.wait_timeout == 64.0  # codemod: keep
    assert RunConfig.train_fn == "deadpool_hpc.train.demo:train"  # codemod: keep
    assert RunConfig.heartbeat_deadline == 1.0  # codemod: keep
    cfg.run_dir = "/x"  # codemod: keep (a flat assignment replaces the frozen section)
    assert cfg.output.run_dir == "/x" and cfg.run_dir == "/x"  # codemod: keep
    assert cfg.replace(run_dir="/y").output.run_dir == "/y" and cfg.output.run_dir == "/x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.output.run_dir = "/z"
    with pytest.raises(AttributeError, match="world_size is computed from the layout section"):
        cfg.world_size = 3  # codemod: keep
    with pytest.raises(ConfigError, match="unknown setting 'nodez'; accepted: nodes, spares"):
        RunConfig(nodez=3)
    assert cfg.flat()["straggler_factor"] == 2.0 and set(cfg.flat()) == {ff.name for ff in flat_fields()}


def test_json_roundtrip_is_nested_and_keeps_every_section():
    cfg = RunConfig(nodes=4, spares=2, ranks_per_node=2, backend="gloo", fork_server=False, steps=9,
                    train_args={"lr": 0.5}, replicas=2, replica_transport="unix", heartbeat_ceiling=5.0,
                    health_check="true", preflight_factor=0, spare_check_every=0, straggler_action="report",
                    spare_return=False, crash_loop_limit=0, persist_every=1.0, requeue=True, max_requeues=1,
                    run_dir="/r", summary_path="/s.json", log_every=3, metrics_port=9400,
                    faults=[parse_fault("kill", "rank1@3"), parse_fault("slow", "node2@startup:4")]).validate()
    text = cfg.to_json()
    d = json.loads(text)
    assert set(d) == set(SECTIONS) and d["stragglers"]["action"] == "report" and d["comeback"]["enabled"] is False
    assert d["internal"]["faults"][1] == {"kind": "slow", "target_kind": "node", "index": 2, "step": None,
                                          "phase": "startup", "nth": 1, "factor": 4.0}
    back = RunConfig.from_json(text)
    assert back == cfg and back.to_json() == text
    with pytest.raises(ConfigError, match=r"unknown config sections \['nodes'\]; accepted: \['comeback'"):
        RunConfig.from_json('{"nodes": 3}')
    with pytest.raises(ConfigError, match=r"unknown config keys \['n'\] in layout; accepted: \['backend'"):
        RunConfig.from_json('{"layout": {"n": 3}}')


def test_every_setting_with_a_flag_is_an_option_with_the_fields_default():
    import argparse

    from deadpool_hpc.launch.options import _from_args, add_run_options

    p = argparse.ArgumentParser()
    add_run_options(p)
    flags = {s for a in p._actions for s in a.option_strings}
    d = RunConfig()
    for ff in flat_fields():
        flag = config_mod.cli_flag(ff.field)
        if flag:
            assert flag in flags, flag
    assert _from_args(p.parse_args([])) == {k: v for k, v in d.flat().items()
                                            if k not in ("train_args", "max_requeues", "faults",
                                                         "interleave_replication")}
    a = p.parse_args(["--no-spare-return", "--requeue", "--no-replicate", "--straggler-factor", "2", "--summary",
                      "s.json", "--backend", "gloo"])
    got = _from_args(a)
    assert got["spare_return"] is False and got["requeue"] is True and got["replicate"] is False
    assert got["straggler_factor"] == 2.0 and got["summary_path"] == "s.json" and got["backend"] == "gloo"


def test_submitit_parameters_are_the_public_settings():
    params = run_parameters()
    public = {ff.name for ff in flat_fields() if ff.field.metadata["public"]} - {"nodes"}
    assert set(params) == public and "backend" in params and "faults" not in params
    d = RunConfig().flat()
    for name, (check, accepted) in params.items():
        assert check(d[name]) and accepted, name   # every default passes its own check
    assert not params["spares"][0](-1) and not params["straggler_action"][0]("kill")


def test_the_readme_lists_every_option_as_generated():
    from deadpool_hpc.launch.options import options_markdown

    readme = open(os.path.join(paths.ROOT, "README.md")).read()
    block = readme.split("<!-- options: generated -->\n", 1)[1].split("<!-- /options -->", 1)[0]
    assert block == options_markdown(), "README's options differ: paste options_markdown()'s output"


def test_backend_nccl_needs_cuda_where_the_config_is_checked(monkeypatch):
    # "auto" is resolved where the training processes run (dataplane/backend.py, tests/unit/dataplane/test_backend.py)
    monkeypatch.setattr(config_mod, "cuda_available", lambda: False)
    assert RunConfig().validate().layout.backend == "auto"
    assert RunConfig(backend="gloo").validate().layout.backend == "gloo"
    with pytest.raises(ConfigError, match=re.escape("--backend 'nccl': CUDA is not available here")) as info:
        RunConfig(backend="nccl").validate()
    assert "accepted: auto (gloo here) or gloo" in str(info.value)
    monkeypatch.setattr(config_mod, "cuda_available", lambda: True)
    assert RunConfig(backend="nccl").validate().layout.backend == "nccl"


def test_cli_backend_nccl_without_cuda_exits_2_before_starting(tmp_path, capsys, monkeypatch):
    from deadpool_hpc.launch.cli import main

    monkeypatch.setattr(config_mod, "cuda_available", lambda: False)
    run_dir = tmp_path / "run"
    try:
        code = main(["run", "--run-dir", str(run_dir), "--nodes", "2", "--spares", "0", "--steps", "3", "--backend",
                     "nccl"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "--backend 'nccl': CUDA is not available here" in err, err
    assert not run_dir.exists()
