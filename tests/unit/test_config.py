import pytest

from commrt.runtime.config import Config, CommConfig, env_table, load_config
from commrt.runtime.errors import ConfigError


def test_defaults_are_secure_and_valid():
    cfg = load_config(environ={})
    assert cfg.cluster.bind_host == "127.0.0.1"
    assert cfg.comm.backend == "auto" and cfg.security.allow_insecure is False


def test_toml_env_and_overrides_in_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[comm]\nbackend = "gloo"\ntimeout_s = 10\n[cluster]\nworld_size = 4\n[train]\nstage = 3\n')
    cfg = load_config(f, environ={})
    assert (cfg.comm.backend, cfg.comm.timeout_s, cfg.cluster.world_size) == ("gloo", 10.0, 4)
    cfg = load_config(f, environ={"COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_TIMEOUT_S": "5"})
    assert (cfg.comm.backend, cfg.comm.timeout_s) == ("zmq", 5.0)
    cfg = load_config(f, overrides={"comm": {"backend": "nccl"}}, environ={"COMMRT_COMM_BACKEND": "zmq"})
    assert cfg.comm.backend == "nccl"


def test_config_file_from_environment(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[comm]\nchunk_bytes = 65536\n')
    assert load_config(environ={"COMMRT_CONFIG": str(f)}).comm.chunk_bytes == 65536


@pytest.mark.parametrize("text,needle", [
    ('[comm]\nbackend = "mpi"\n', "valid: ['auto', 'zmq', 'gloo', 'nccl']"),
    ('[comm]\nbakend = "zmq"\n', "unknown key 'bakend' in [comm]; valid:"),
    ('[comm]\ntimeout_s = -1\n', "must be > 0"),
    ('[comm]\ntimeout_s = "soon"\n', "expected float"),
    ('[comm]\nchunk_bytes = 1048576\nmax_frame_bytes = 1048576\n', "must exceed chunk_bytes"),
    ('[cluster]\nrendezvous = "http://x"\n', "valid: 'env://' or 'tcp://host:port'"),
    ('[security]\nmode = "tls"\n', "valid: ['secret', 'curve', 'none']"),
    ('[security]\nallow_insecure = "maybe"\n', "valid: true/false"),
    ('comm = 3\n', "must be a table"),
    ('[comm\n', "not valid TOML"),
])
def test_bad_values_say_what_is_valid(tmp_path, text, needle):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        load_config(f, environ={})
    assert needle in str(info.value)


def test_bad_env_value():
    with pytest.raises(ConfigError, match="COMMRT|expected int|chunk_bytes"):
        load_config(environ={"COMMRT_COMM_CHUNK_BYTES": "lots"})


def test_digest_covers_shared_settings_only():
    a = Config()
    b = Config(comm=CommConfig(chunk_bytes=1 << 16))
    assert a.digest() != b.digest()
    c = load_config(overrides={"cluster": {"rank": 3, "bind_host": "127.0.0.2"}}, environ={})
    assert c.digest() == a.digest()


def test_config_is_frozen():
    with pytest.raises(Exception):
        Config().comm.backend = "zmq"


def test_env_table_lists_every_setting():
    names = [row[0] for row in env_table()]
    assert "COMMRT_COMM_BACKEND" in names and "COMMRT_SECURITY_MODE" in names


def test_plaintext_beyond_loopback_is_refused_unless_allowed():
    from commrt.transport.security import check_bind
    check_bind(Config(), ["127.0.0.1", "localhost", "127.0.0.5"])
    with pytest.raises(ConfigError, match="allow_insecure"):
        check_bind(Config(), ["127.0.0.1", "198.18.0.1"])
    allowed = load_config(overrides={"security": {"allow_insecure": True}}, environ={})
    check_bind(allowed, ["198.18.0.1"])
    check_bind(load_config(overrides={"security": {"mode": "curve"}}, environ={}), ["198.18.0.1"])  # authenticated


@pytest.mark.parametrize("text,needle", [
    ('[comm]\ntimeout_s = inf\n', "[comm] timeout_s = inf is invalid; it must be > 0 and <= 1000000"),
    ('[comm]\ntimeout_s = 3e6\n', "[comm] timeout_s = 3000000.0 is invalid; it must be > 0 and <= 1000000"),
    ('[comm]\ntimeout_s = nan\n', "[comm] timeout_s = nan is invalid"),
    ('[comm]\nheartbeat_s = inf\n', "[comm] heartbeat_s = inf is invalid; it must be > 0 and <= 3600"),
    ('[ps]\ntimeout_s = inf\n', "[ps] timeout_s = inf is invalid; it must be > 0 and <= 1000000"),
    ('[cluster]\nrendezvous = "tcp://10.0.0.1"\n', "[cluster] rendezvous = 'tcp://10.0.0.1' is invalid"),
    ('[cluster]\nrendezvous = "tcp://node0:29k"\n', "[cluster] rendezvous = 'tcp://node0:29k' is invalid"),
    ('[comms]\nbackend = "zmq"\n', "unknown section [comms]; valid: ['comm', 'cluster', 'security', 'ps', 'quant', 'log', 'train']"),
])
def test_out_of_range_values_and_unknown_sections_are_config_errors(tmp_path, text, needle):
    """Issue 13.17: these passed `commrt config` and then crashed init with a raw OverflowError
    (timeouts become int32 milliseconds in ZeroMQ options), or were silently ignored ([comms])."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f, environ={})
    assert needle in str(info.value)


def test_out_of_range_values_from_the_environment_too():
    with pytest.raises(ConfigError, match=r"timeout_s = inf is invalid"):
        load_config(environ={"COMMRT_COMM_TIMEOUT_S": "inf"})


def test_the_largest_valid_timeouts_make_valid_zmq_options():
    """At the bounds, the Transport's socket options (int32 milliseconds) still fit."""
    from commrt.transport.transport import Transport
    cfg = load_config(overrides={"comm": {"timeout_s": 1e6, "heartbeat_s": 3600}, "security": {"mode": "none"}},
                      environ={})
    t = Transport(cfg, "rank0")
    try:
        import zmq
        sock, _ = t.listen(zmq.ROUTER, "127.0.0.1")
        sock.close(linger=0)
    finally:
        t.close()


def test_an_unresolvable_bind_host_is_a_lookup_error_not_a_security_one():
    from commrt.transport.security import check_bind
    with pytest.raises(ConfigError, match="'no-such-host.invalid' .*cannot be resolved"):
        check_bind(Config(), ["no-such-host.invalid"])


def test_digest_leaves_out_per_host_paths_and_timeouts():
    """Hosts that keep the secret file or keys in different places must still agree (issue 12)."""
    a = Config()
    b = load_config(overrides={"security": {"secret_file": "/elsewhere/s", "keys_dir": "/other/keys"},
                               "comm": {"timeout_s": 77.0}}, environ={})
    assert a.digest() == b.digest()
    for change in ({"security": {"mode": "curve"}}, {"comm": {"small_bytes": 1}},
                   {"comm": {"check_call_sites": True}}, {"comm": {"backend": "gloo"}},
                   {"cluster": {"store_proxy": False}},  # a rank expecting a proxy its leader lacks
                   {"comm": {"shm_slot_bytes": 1 << 20}}):  # ranks read each other's slots
        assert load_config(overrides=change, environ={}).digest() != a.digest(), change


def test_quant_pieces_profile_and_cpu_codec_are_settings(tmp_path):
    """Issue 28 item 4: what were module switches (COMMRT_QUANT_PIECES read at import,
    quant.profile.ON, quant.collectives.TORCH_CODEC_ON_CPU) are [quant] fields, read like any other."""
    f = tmp_path / "c.toml"
    f.write_text('[quant]\npieces = 1\ncpu_codec = "torch"\n')
    cfg = load_config(f, environ={"COMMRT_QUANT_PROFILE": "1"})
    assert (cfg.quant.pieces, cfg.quant.profile, cfg.quant.cpu_codec) == (1, True, "torch")
    assert load_config(environ={"COMMRT_QUANT_PIECES": "3"}).quant.pieces == 3
    names = [row[0] for row in env_table()]
    assert {"COMMRT_QUANT_PIECES", "COMMRT_QUANT_PROFILE", "COMMRT_QUANT_CPU_CODEC"} <= set(names)
    # ranks must agree on the pieces (each is a collective call), not on profiling or the CPU codec
    assert load_config(environ={"COMMRT_QUANT_PIECES": "3"}).digest() != Config().digest()
    assert cfg.digest() != Config().digest()
    same = load_config(environ={"COMMRT_QUANT_PROFILE": "1", "COMMRT_QUANT_CPU_CODEC": "torch"})
    assert same.digest() == Config().digest()


def test_quant_modules_hold_no_switches():
    import commrt.quant.collectives as qc
    import commrt.quant.hierarchical as qh
    import commrt.quant.profile as qp
    assert not hasattr(qc, "TORCH_CODEC_ON_CPU") and not hasattr(qh, "PIECES") and not hasattr(qp, "ON")


def test_settings_are_read_from_the_environment_in_one_place():
    """No module but the config's loader reads a COMMRT_<SECTION>_<FIELD> variable itself."""
    import ast
    import pathlib
    from commrt.runtime.config import SECTION_TYPES
    prefixes = tuple(f"COMMRT_{s.upper()}_" for s in SECTION_TYPES)
    root = pathlib.Path(__file__).resolve().parents[2] / "commrt"
    # known readers, each for a reason other than a setting's value (owners: see the comments)
    allowed = {"apps/ps_train.py": "COMMRT_PS_PRINT_STATS, the demo's own switch (not a setting)",
               "bench/ps.py": "COMMRT_PS_SERVERS set: this process is a launched rank of the PS benchmark"}
    bad = []
    for path in root.rglob("*.py"):
        if (path.parent.name == "config" and path.parent.parent.name == "runtime") or \
                str(path.relative_to(root)) in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            reads = (isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("get", "getenv")
                     and node.args) and node.args[0] or (isinstance(node, ast.Subscript) and node.slice)
            if (isinstance(reads, ast.Constant) and isinstance(reads.value, str) and reads.value.startswith(prefixes)
                    and "environ" in ast.unparse(node)) or (isinstance(node, ast.Call) and "getenv" in ast.unparse(node.func)
                                                            and isinstance(reads, ast.Constant)
                                                            and str(reads.value).startswith(prefixes)):
                bad.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


@pytest.mark.parametrize("section,key,value,needle", [
    ("comm", "chunk_bytes", 1.5, "expected an integer, got float"),
    ("comm", "small_bytes", True, "expected an integer, got bool"),
    ("comm", "shm_slot_bytes", 4097, "a multiple of 4096 from 65536"),
    ("comm", "shm_slot_bytes", 4096, "a multiple of 4096 from 65536"),
    ("cluster", "world_size", 2.5, "expected an integer"),
    ("cluster", "bind_host", "", "give an interface's address"),
    ("ps", "workers", -1, "must be >= 0"),
    ("ps", "servers", ("tcp://a",), "each entry must be 'tcp://host:port'"),
    ("quant", "pieces", 0, "must be an integer >= 1"),
    ("quant", "cpu_codec", "cuda", "valid: ['numpy', 'torch']"),
    ("log", "comms", 1, "expected true or false"),
])
def test_every_setting_is_validated_in_code_too(section, key, value, needle):
    """Issue 30 item 13: a Config built in code is checked like a loaded one (no 1.5 chunk bytes)."""
    from commrt.runtime.config import SECTION_TYPES
    with pytest.raises(ConfigError) as info:
        SECTION_TYPES[section](**{key: value})
    assert needle in str(info.value) and f"[{section}] {key}" in str(info.value)


@pytest.mark.parametrize("env,text,needle", [
    ({"COMMRT_COMM_BACKEND": "mpi"}, "", "from the environment variable COMMRT_COMM_BACKEND"),
    ({}, '[comm]\nbackend = "mpi"\n', "from the config file "),
    ({"COMMRT_QUANT_PIECES": "many"}, "", "from the environment variable COMMRT_QUANT_PIECES"),
    ({}, '[comm]\nchunk_bytes = 1048576\nmax_frame_bytes = 1048576\n', "max_frame_bytes = 1048576 is invalid"),
])
def test_errors_say_where_the_bad_value_came_from(tmp_path, env, text, needle):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f, environ=env)
    assert needle in str(info.value)
    assert "from the environment" in str(info.value) or "from the config file" in str(info.value)


@pytest.mark.parametrize("zero,needle", [
    ({"stage": 3, "zero_hpz_partition_size": 1.5}, "zero_hpz_partition_size = 1.5 is invalid; valid: an integer >= 1"),
    ({"stage": 3, "zero_hpz_partition_size": "AUTO"}, "zero_hpz_partition_size = 'AUTO' is invalid; valid: an integer"),
    ({"stage": 3, "mics_shard_size": "x"}, "mics_shard_size = 'x' is invalid; valid: -1 (off) or an integer >= 1"),
    ({"sharding_strategy": "HYBRID_SHARD", "shard_group_size": 0}, "shard_group_size = 0 is invalid; valid: an integer >= 1"),
    ({"stage": "two"}, "stage = 'two' is invalid; valid: [0, 1, 2, 3]"),
    ({"overlap_comm": "yes"}, "overlap_comm = 'yes' is invalid; valid: true or false"),
])
def test_train_settings_are_validated_at_load(zero, needle):
    """Issue 30 item 13: these were accepted (1.5 became 1, a group of 0 ranks) or raised a raw ValueError."""
    from commrt.train.config import TrainConfig
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"zero_optimization": zero})
    assert needle in str(info.value)
    assert TrainConfig.from_dict({"zero_optimization": {"reduce_bucket_size": 5e8}}).zero.reduce_bucket_size == 500_000_000
