"""Configuration: values converted by pydantic from TOML and `AENV_*` env vars, the precedence
of defaults < file < environment < overrides, errors naming the key, and `Paths`."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import DEFAULT_HOME, Config, ConfigError, Paths, load


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("false", False), ("0", False), ("no", False), ("off", False), ("true", True), ("1", True)],
)
def test_boolean_env_values_are_booleans(tmp_path: Path, raw: str, expected: bool) -> None:
    env = {"AENV_HOME": str(tmp_path), "AENV_PAUSE_ON_SHUTDOWN": raw}
    assert load(env=env).pause_on_shutdown is expected


def test_boolean_that_is_no_boolean_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pause_on_shutdown"):
        load(env={"AENV_HOME": str(tmp_path), "AENV_PAUSE_ON_SHUTDOWN": "maybe"})


def test_numbers_and_paths_are_converted(tmp_path: Path) -> None:
    config = load(env={"AENV_HOME": str(tmp_path), "AENV_PORT": "3001", "AENV_GUEST_CACHE": "/g"})
    assert config.port == 3001
    assert config.home == tmp_path
    assert config.guest_cache == Path("/g")
    assert config.paths.guest_cache == Path("/g")


def test_bad_number_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="port: cannot use 'x'"):
        load(env={"AENV_HOME": str(tmp_path), "AENV_PORT": "x"})


def test_empty_optional_string_is_unset(tmp_path: Path) -> None:
    config = load(env={"AENV_HOME": str(tmp_path), "AENV_DOMAIN": ""})
    assert config.domain is None


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(
        'port = 4000\nhost = "127.0.0.1"\nmax_sandboxes = 9\npause_on_shutdown = false\n'
    )
    env = {"AENV_HOME": str(tmp_path), "AENV_PORT": "4001", "AENV_MAX_SANDBOXES": "10"}
    config = load({"max_sandboxes": 11, "driver": None}, env=env)
    assert config.host == "127.0.0.1"  # the file
    assert config.port == 4001  # the environment over the file
    assert config.max_sandboxes == 11  # an override over both
    assert config.driver == "auto"  # an override of None leaves the default
    assert config.pause_on_shutdown is False


def test_config_file_elsewhere(tmp_path: Path) -> None:
    other = tmp_path / "other.toml"
    other.write_text("warm_slots_low = 1\n")
    assert load(env={"AENV_HOME": str(tmp_path), "AENV_CONFIG": str(other)}).warm_slots_low == 1


def test_a_home_given_on_the_command_line_has_its_config_file_read(tmp_path: Path) -> None:
    """`aenv nodes --home /srv/node-a` reads that node's config.toml (its Redis URL and
    secret), not the one of $AENV_HOME."""
    (tmp_path / "env-home").mkdir()
    (tmp_path / "env-home" / "config.toml").write_text("node_id = 'from-env-home'\n")
    (tmp_path / "node-a").mkdir()
    (tmp_path / "node-a" / "config.toml").write_text("node_id = 'node-a'\n")
    env = {"AENV_HOME": str(tmp_path / "env-home")}
    assert load({"home": tmp_path / "node-a"}, env=env).node_id == "node-a"
    assert load({"home": None}, env=env).node_id == "from-env-home"


def test_unknown_keys_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("prot = 1\n")
    with pytest.raises(ConfigError, match="unknown configuration keys: prot"):
        load(env={"AENV_HOME": str(tmp_path)})


def test_unknown_env_vars_are_not_settings(tmp_path: Path) -> None:
    # Test harnesses and benchmarks use AENV_* names of their own.
    assert load(env={"AENV_HOME": str(tmp_path), "AENV_TEST_ACCEL": "kvm"}).home == tmp_path


def test_broken_toml_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("port = \n")
    with pytest.raises(ConfigError, match=r"config\.toml"):
        load(env={"AENV_HOME": str(tmp_path)})


def test_defaults() -> None:
    config = load(env={})
    assert config == Config()
    assert config.home == DEFAULT_HOME
    assert config.paths.catalog == DEFAULT_HOME / "catalog.db"


def test_paths_under_home(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    named = [
        paths.config_file,
        paths.api_key,
        paths.api_keys,
        paths.jailer,
        paths.catalog,
        paths.template_tags,
        paths.templates,
        paths.sandboxes,
        paths.builds,
        paths.build_files,
        paths.detach,
        paths.repository,
        paths.cache,
        paths.guest_cache,
        paths.oci_cache,
        paths.oci_rootfs,
        paths.chunk_cache,
    ]
    assert all(p.is_relative_to(tmp_path) for p in named)
    assert len(set(named)) == len(named)
    # Guest memory is on tmpfs, one tree per data dir, the same for every spelling of the dir.
    assert paths.memory.parent == Path("/dev/shm")
    assert Paths(tmp_path / "." / "x" / "..").memory == paths.memory
    assert Paths(tmp_path / "y").memory != paths.memory


def test_a_sandboxs_paths_and_the_memory_root(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    assert paths.sandbox("s1") == paths.sandboxes / "s1"
    memory = [paths.sandbox_memory("s1"), paths.detach_memory]
    assert all(p.is_relative_to(paths.memory) for p in memory)
    # Another root (a test's node) moves every memory path, and nothing else.
    moved = Paths(tmp_path, memory_override=tmp_path / "shm")
    assert moved.sandbox_memory("s1") == tmp_path / "shm" / "sandboxes" / "s1"
    assert moved.detach_memory == tmp_path / "shm" / "detach"
    assert moved.sandbox("s1") == paths.sandbox("s1")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("", "repository"),
        ("store", "store"),
        ("/abs/repo", "/abs/repo"),
        ("off", None),
        ("s3://bucket/prefix", None),
    ],
)
def test_repository_directory(tmp_path: Path, setting: str, expected: str | None) -> None:
    directory = Config(home=tmp_path, repository=setting).repository_dir
    assert directory == (None if expected is None else tmp_path / expected)


def test_cold_reclaim_is_off_by_default_and_bounded(tmp_path: Path) -> None:
    assert load(env={"AENV_HOME": str(tmp_path)}).cold_reclaim_after == 0
    with pytest.raises(ConfigError, match="cold_reclaim_after is seconds"):
        load(env={"AENV_HOME": str(tmp_path), "AENV_COLD_RECLAIM_AFTER": "-1"})
    with pytest.raises(ConfigError, match="cold_reclaim_mb_per_s"):
        load(env={"AENV_HOME": str(tmp_path), "AENV_COLD_RECLAIM_MB_PER_S": "0"})


def test_share_slots_are_bounded(tmp_path: Path) -> None:
    assert load(env={"AENV_HOME": str(tmp_path)}).share_slots == 2
    assert load(env={"AENV_HOME": str(tmp_path), "AENV_SHARE_SLOTS": "0"}).share_slots == 0
    with pytest.raises(ConfigError, match="share_slots"):
        load(env={"AENV_HOME": str(tmp_path), "AENV_SHARE_SLOTS": "17"})
