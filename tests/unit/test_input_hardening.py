"""Bad input a user can give the config, the rendezvous variables, the host lists and
``commrt launch`` ends in a typed error that names what was wrong, never in a traceback from
deep inside (a UnicodeDecodeError, a ValueError from urllib, an UnboundLocalError) nor in a
host running out of memory. Found in a hardening review (branch wtT4); each case failed before
its fix."""
import math
import sys
import time

import pytest

from commrt.apps import launch_cmd
from commrt.deploy.hostlist import MAX_HOSTS, expand_hostlist, parse_hostfile, tasks_per_node
from commrt.deploy.plan import job_from_env
from commrt.obs import stats
from commrt.runtime import bootstrap, rendezvous
from commrt.runtime.config import Config, load_config
from commrt.runtime.errors import ConfigError


# -- config ----------------------------------------------------------------------------------

def test_a_config_file_that_is_not_text_is_a_config_error(tmp_path):
    f = tmp_path / "c.toml"
    f.write_bytes(b"[comm]\nbackend = \"zmq\"\n\xd0\xff\xfe\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f, environ={})


@pytest.mark.parametrize("text", ["train = 1\n", "train = [1, 2]\n"])
def test_a_train_section_that_is_not_a_table_is_a_config_error(tmp_path, text):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"\[train\] must be a table"):
        load_config(f, environ={})


@pytest.mark.parametrize("var,value", [
    ("COMMRT_PS_MOMENTUM", "nan"), ("COMMRT_PS_WEIGHT_DECAY", "nan"), ("COMMRT_PS_EPS", "inf"),
    ("COMMRT_PS_LR", "inf"), ("COMMRT_PS_MOMENTUM", "inf"),
])
def test_non_finite_optimizer_settings_are_refused(var, value):
    """NaN passed ``< 0`` checks (every comparison with NaN is false) and inf passed ``> 0``:
    a server would then turn every parameter into NaN without a word."""
    with pytest.raises(ConfigError, match=var):
        load_config(environ={var: value})


@pytest.mark.parametrize("var", ["COMMRT_COMM_MAX_FRAME_BYTES", "COMMRT_COMM_CHUNK_BYTES",
                                 "COMMRT_COMM_SMALL_BYTES", "COMMRT_PS_MAX_SEGMENT_BYTES"])
def test_byte_sizes_beyond_int64_are_config_errors_naming_their_variable(var):
    """ZeroMQ takes ZMQ_MAXMSGSIZE as an int64: 2**70 passed the config and failed much later
    with an OverflowError inside setsockopt."""
    with pytest.raises(ConfigError, match=var):
        load_config(environ={var: str(1 << 70)})


def test_an_override_that_is_not_a_mapping_is_a_config_error():
    with pytest.raises(ConfigError, match=r"overrides\['comm'\] must be a mapping"):
        load_config(overrides={"comm": "zmq"}, environ={})


@pytest.mark.parametrize("addr", ["tcp://h:abc", "tcp://127.0.0.1:99999", "tcp://:5000", "tcp://h:0", "tcp://h:5/x"])
def test_parameter_server_addresses_need_a_real_port(addr):
    with pytest.raises(ConfigError, match="COMMRT_PS_SERVERS"):
        load_config(environ={"COMMRT_PS_SERVERS": addr})


def test_finite_settings_still_load():
    cfg = load_config(environ={"COMMRT_PS_MOMENTUM": "0.9", "COMMRT_COMM_MAX_FRAME_BYTES": str(1 << 40),
                               "COMMRT_PS_SERVERS": "tcp://10.0.0.1:29600,tcp://node-2:29601,tcp://[::1]:5"})
    assert cfg.ps.momentum == 0.9 and cfg.comm.max_frame_bytes == 1 << 40 and math.isfinite(cfg.ps.lr)


# -- rendezvous ------------------------------------------------------------------------------

@pytest.mark.parametrize("init,environ,needle", [
    ("env://", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"}, "MASTER_PORT"),
    ("env://", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ("env://", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}, "MASTER_PORT"),
    ("tcp://127.0.0.1:notaport", {}, "tcp://host:port"),
    ("tcp://127.0.0.1:99999", {}, "tcp://host:port"),
])
def test_bad_rendezvous_ports_are_config_errors(init, environ, needle):
    with pytest.raises(ConfigError, match=needle):
        rendezvous.resolve(init, 0, 1, environ)


@pytest.mark.parametrize("value", ["", "four", "-2"])
def test_a_malformed_local_world_size_is_a_config_error_naming_it(value):
    """init_world read int(LOCAL_WORLD_SIZE) first of all: a ValueError traceback."""
    spec = rendezvous.RendezvousSpec("127.0.0.1", 1, 0, 1)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        bootstrap.init_world(Config(), spec, environ={"LOCAL_WORLD_SIZE": value})


def test_a_good_rendezvous_port_resolves():
    spec = rendezvous.resolve("env://", 0, 2, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (spec.host, spec.port, spec.world_size) == ("127.0.0.1", 29500, 2)


# -- host lists ------------------------------------------------------------------------------

def test_a_host_list_whose_bracket_groups_multiply_past_the_bound_fails_at_once():
    """Each group was bounded alone, then multiplied out: r[1-50000]n[1-50000] built 2.5e9 names
    before any check (tens of GiB)."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match=str(MAX_HOSTS)):
        expand_hostlist("r[1-50000]n[1-50000]")
    assert time.monotonic() - start < 5  # generous: the old code needed minutes and GiBs


def test_slurm_task_counts_repeated_past_the_bound_fail_at_once():
    with pytest.raises(ConfigError, match=str(MAX_HOSTS)):
        tasks_per_node("4,2(x99999999999)")
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]


@pytest.mark.parametrize("value", ["\u00b2", "1\u00b2", "-1", "x"])
def test_scheduler_counts_that_are_not_numbers_are_config_errors(value):
    """str.isdigit() accepts superscripts, which int() refuses: a ValueError traceback."""
    with pytest.raises(ConfigError, match="COMMRT_DEPLOY_NPROC"):
        job_from_env({"COMMRT_DEPLOY_WORKER_NODES": "1", "COMMRT_DEPLOY_NPROC": value})


@pytest.mark.parametrize("slots", ["\u00b2", "1\u00b2"])
def test_host_file_slots_that_are_not_numbers_are_config_errors_naming_the_line(slots):
    """isdigit() again (deploy/hostlist.py): 'slots=²' passed it and int() raised a bare ValueError,
    a traceback from `commrt launch --hostfile`."""
    with pytest.raises(ConfigError, match="host file line 2: 'slots="):
        parse_hostfile(f"node1 slots=2\nnode2 slots={slots}\n")
    assert parse_hostfile("node1 slots=12\n")[0].slots == 12


def test_algorithm_sizes_and_peer_names_with_superscripts_are_refused_not_a_valueerror():
    """The same isdigit() in [comm] algorithms' sizes (a ValueError from load_config) and in the
    peer names comm_stats parses (a ValueError from comm_stats for a peer named 'rank²')."""
    with pytest.raises(ConfigError, match="algorithms"):
        load_config(overrides={"comm": {"algorithms": "all_reduce=ring@\u00b2-4MiB"}}, environ={})
    assert stats._peer_rank("rank\u00b2") is None and stats._peer_rank("rank12") == 12


def test_host_list_products_within_the_bound_expand():
    assert len(expand_hostlist("r[1-100]n[1-100]")) == 10_000
    assert expand_hostlist("a[1-2]b[1-2]") == ["a1b1", "a1b2", "a2b1", "a2b2"]


# -- commrt launch's arguments ---------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["-n", "0", "--", "true"], "--nproc"),
    (["-n", "1", "--max-restarts", "-1", "--", "true"], "--max-restarts"),
    (["-n", "1", "--servers", "-1", "--", "true"], "--servers"),
    (["-n", "1", "--timeout", "0", "--", "true"], "--timeout"),
    (["-n", "1", "--master-port", "70000", "--", "true"], "--master-port"),
    (["-n", "1", "--nnodes", "1:2", "--rdzv-timeout", "-1", "--node-rank", "0", "--master-addr", "x",
      "--master-port", "1", "--", "true"], "--rdzv-timeout"),
])
def test_launch_refuses_out_of_range_arguments(argv, needle, capsys):
    with pytest.raises(SystemExit, match=needle):
        launch_cmd.main(argv)


def test_launch_of_one_node_of_several_refuses_servers(capsys):
    """Found in review C: ``--servers S`` with ``--nnodes N > 1`` started S shards on every host's
    loopback, each told to expect all N x G workers (COMMRT_PS_WORKERS): every node's workers
    trained against their own shards, unreachable from the other nodes, so a sync job ended in
    PeerLost after the worker timeout and an async one silently trained N separate models."""
    from commrt.launch import Nodes, launch
    with pytest.raises(SystemExit, match="--servers"):
        launch_cmd.main(["-n", "1", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                         "--master-port", "29999", "--servers", "1", "--", "true"])
    with pytest.raises(ValueError, match="servers"):
        launch(1, ["true"], servers=1, nodes=Nodes(2, 0, "127.0.0.1"))


def test_launch_warns_about_a_misspelt_setting_variable(capsys, monkeypatch):
    """Found in review C: a misspelt variable (COMMRT_COMM_BAKEND=gloo) reached every rank and was
    ignored without a word: the job ran on the default backend. Only `commrt config` said so."""
    monkeypatch.setenv("COMMRT_COMM_BAKEND", "gloo")
    assert launch_cmd.main(["-n", "1", "--timeout", "60", "--", sys.executable, "-c", "pass"]) == 0
    assert "warning: COMMRT_COMM_BAKEND is set but no setting reads it" in capsys.readouterr().err


def test_launch_of_a_missing_program_is_an_exit_status_not_a_traceback(capsys):
    assert launch_cmd.main(["-n", "2", "--", "/nonexistent/commrt-test-program"]) == 127
    assert "/nonexistent/commrt-test-program" in capsys.readouterr().err


def test_launch_with_a_missing_host_file_names_it():
    with pytest.raises(SystemExit, match="nonexistent-hosts"):
        launch_cmd.main(["-n", "1", "--hosts", "/nonexistent-hosts", "--", sys.executable, "-c", "pass"])


def test_keygen_refuses_a_job_without_ranks(tmp_path):
    """-n 0 or -n -3 wrote an empty allow-list and said 'wrote 0 key pairs': a job that cannot start."""
    from commrt.cli import main
    with pytest.raises(SystemExit, match="-n -3 must be >= 1"):
        main(["keygen", str(tmp_path / "keys"), "-n", "-3"])
    assert not (tmp_path / "keys").exists()


def test_keygen_refuses_a_directory_others_can_write(tmp_path):
    """Found in review C: keygen wrote into an existing directory whatever its mode, so in a
    shared (group- or world-writable) one anyone could later replace allow.txt with their own
    public key, or a rank's .key with a pair they know; the readers check neither."""
    from commrt.cli import main
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(SystemExit, match="writable by others"):
        main(["keygen", str(shared), "-n", "1"])
    assert not list(shared.iterdir())


def test_keygen_where_it_cannot_write_is_one_line(tmp_path):
    """Found in review C: a directory keygen cannot make was a FileNotFoundError traceback."""
    from commrt.cli import main
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="commrt keygen: cannot write"):
        main(["keygen", str(tmp_path / "file" / "keys"), "-n", "1"])


def test_launch_hosts_with_an_ssh_that_does_not_exist_names_it(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a\nnode-b\n")
    with pytest.raises(SystemExit, match="cannot run --ssh '/nonexistent-ssh'"):
        launch_cmd.main(["-n", "1", "--hosts", str(hosts), "--ssh", "/nonexistent-ssh", "--", "true"])


@pytest.mark.parametrize("argv,needle", [
    (["--nproc", "0"], "--nproc 0 must be >= 1"), (["-n", "0"], "--iters 0 must be >= 1"),
    (["-w", "-1"], "--warmup -1 must be >= 0"), (["-f", "1.0"], "factor > 1"), (["-b", "4X"], "4X"),
])
def test_bench_refuses_bad_counts_and_sizes_before_starting_ranks(argv, needle):
    from commrt.cli import main
    with pytest.raises(SystemExit, match=needle):
        main(["bench", "all_reduce", *argv])


def test_a_slurm_rank_whose_program_does_not_exist_exits_127(monkeypatch, capsys):
    import os
    from commrt.apps import node
    monkeypatch.setattr(os, "environ", dict(os.environ))  # node.main adds torchrun's variables to it
    for k, v in dict(SLURM_JOB_NODELIST="n1", SLURM_NODEID="0", SLURM_PROCID="0", SLURM_NTASKS="1",
                     SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="1").items():
        monkeypatch.setenv(k, v)
    assert node.main(["slurm", "rank", "--", "/nonexistent/commrt-test-program"]) == 127
    assert "/nonexistent/commrt-test-program" in capsys.readouterr().err
